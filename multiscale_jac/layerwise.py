"""Per-layer closed forms for sums of squared per-sample gradients (diag Fisher, Jacobian norm).

The model runs once on a batch (samples stacked, as in a training step); for every objective
``s = sum_i s_i`` (a sum of per-sample scalars: log-likelihoods, output rows, probes) one
backward pass gives, at the output ``z`` of every layer, ``delta_i = ds_i / dz_i`` (samples do
not interact in the batched run). The per-sample gradient of a layer's parameter is a function
of ``delta_i`` and the layer's input ``a_i`` alone, so no parameter gradient is ever formed by
autograd: backward computes data gradients only, and each layer's rule runs as its gradient
arrives (a tensor hook), then drops the layer's input.

Shapes (stated once): a batch of ``N`` samples; a layer in *column form* has ``D`` ``(N, Co, L)``
(``delta`` per output channel and position) and ``U`` ``(N, Ck, L)`` (the input columns each
weight row multiplies): Linear ``(N, *, in)`` -> ``L`` = the middle positions, ``Ck = in``;
Conv1d/2d -> ``U = unfold(a)``, ``Ck = C_in / groups * prod(kernel)`` per group. The per-sample
weight gradient is ``G_i = D_i U_i^T`` (per group), the bias gradient ``D_i.sum(-1)``.

Rules, one per selected tensor (:attr:`LayerwisePlan.rules`, tabled in ``docs/derived.md``):
``gram`` (``sum_i G_i^2`` as one matmul per kernel offset over the pairs ``l <= l'`` of
positions whose columns are not zero padding, inner size ``N`` x pairs, ``G_i`` never formed),
``per_sample`` (``G_i`` formed for a chunk of samples, squared and summed; the calls' gradients
of a layer called several times per sample are summed before squaring), ``norm_affine``
(BatchNorm with running statistics, GroupNorm, LayerNorm: ``sum delta_i * xhat_i`` and
``sum delta_i`` over the non-channel dims) and ``vmap`` (no closed form: the caller computes
these tensors with ``torch.func.vmap(grad)``).

``gram`` vs ``per_sample`` is picked by a cost model in flop-equivalents, per objective
``2 N L Co Ck + COST_PER_ENTRY * N Co Ck`` for ``per_sample`` (forming, squaring and summing
``N Co Ck`` entries is bound by memory traffic) and ``2 N Co Ck`` times the mean pairs per
offset for ``gram`` (at most ``L (L + 1) / 2``; a 3x3 convolution on a 2x2 map has 26 pairs
over its 9 offsets, not ``9 L^2 = 144``). With several objectives (the exact GGN's one per
class) their ``D`` pair products are summed first (``COST_PER_ENTRY`` per pair entry and
objective) and the ``gram`` matmul runs once.

A convolution's ``per_sample`` gradients are formed either from columns (im2col, ``bmm``) or
as the weight gradient of one grouped convolution over a chunk of samples; which is faster
depends on the channels and the backend, so it is timed once per layer and size class
(:meth:`LayerwiseRun._kernel`). The backward passes stop at the outputs of the layers that
read a model input directly (unless something else reads it): the input's own gradient is
never formed.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ._memory import CACHE_BYTES, DEFAULT_TEMP_BYTES, chunk_in, tensor_bytes
from ._ops import named, numeric_padding
from ._row_replay import ROW_PLANS, RowPlan, describe
from ._tuning import Route, decided, tune
from .adapter import PerSampleFunction
from .enums import LayerRule, Tune
from .rows import RowGroups, RowTracker, groups_of, output_rows
from .subset import ParamSubset

__all__ = [
    "COST_PER_ENTRY",
    "LayerwisePlan",
    "LayerwiseRun",
    "NotLayerwiseError",
    "batched_run",
    "check_separable",
    "settle_rows",
    "plan_layers",
    "unfold_columns",
]

#: flop-equivalents per per-sample gradient entry formed, squared and summed (memory bound)
COST_PER_ENTRY = 12.0
#: a convolution's per-sample gradients (flops of forming them) below which its two kernels
#: are not timed against each other (about a millisecond on one CPU core)
PROBE_MIN_FLOPS = 5e7
#: channels (samples x channels per sample) per grouped convolution at most: past about this
#: many, oneDNN's grouped weight gradient on CPU was 3-10x slower per sample
GROUPED_CHANNELS = 2048

_CONV = (nn.Conv1d, nn.Conv2d)
_NORMS = (_BatchNorm, nn.GroupNorm, nn.LayerNorm)
_SUPPORTED = (nn.Linear, *_CONV, *_NORMS)


class NotLayerwiseError(RuntimeError):
    """The batched run cannot give per-sample layer gradients (the message says why)."""


@dataclass
class _Site:
    """One parameter tensor with a closed form: the modules that own it and their calls."""

    name: str
    role: str  # "weight" or "bias"
    modules: tuple[nn.Module, ...]
    calls: list[_Call] = field(default_factory=list)


@dataclass
class _Call:
    module: nn.Module
    input: Tensor | None
    received: int = 0  # objectives whose gradient arrived
    owner: Any = None  # the output's owner (:class:`~multiscale_jac.rows.RowTracker`)
    shape: tuple[int, ...] = ()  # the output's shape
    groups: RowGroups | None = None  # which sample each unit of the output belongs to


@dataclass
class LayerwisePlan:
    """Which rule each selected tensor takes, and why the others take ``vmap``.

    Attributes:
        rules: selected tensor name -> :class:`LayerRule` value (``gram``/``per_sample`` are
            final after the first batch, when positions and calls per sample are known).
        reasons: name -> why it takes ``vmap``.
        costs: name -> ``{"gram": ..., "per_sample": ...}`` flop-equivalents per sample (convs
            and Linear layers, once known).
    """

    rules: dict[str, str]
    reasons: dict[str, str]
    costs: dict[str, dict[str, float]] = field(default_factory=dict)
    sites: dict[str, _Site] = field(default_factory=dict, repr=False)

    def require_all(self) -> None:
        """Raise :class:`NotLayerwiseError` naming every tensor without a closed form."""
        if self.reasons:
            listed = "; ".join(f"{n!r} ({why})" for n, why in self.reasons.items())
            raise NotLayerwiseError(f"no closed form for {listed}")

    @property
    def layerwise_names(self) -> tuple[str, ...]:
        return tuple(n for n, r in self.rules.items() if r != LayerRule.VMAP)


def plan_layers(model: nn.Module, subset: ParamSubset, *, eval_batch_norm: bool) -> LayerwisePlan:
    """Assign every selected tensor a rule from the module types that own it.

    Raises:
        NotLayerwiseError: the batched run would mix samples (a BatchNorm layer normalising with
            batch statistics).
    """
    for name, m in model.named_modules():
        if isinstance(m, _BatchNorm) and (
            m.running_mean is None or (m.training and not eval_batch_norm)
        ):
            raise NotLayerwiseError(
                f"module {name or '<model>'!r} ({type(m).__name__}) normalises with batch "
                "statistics, so a batched run mixes samples"
            )
    params = dict(model.named_parameters())
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for role in ("weight", "bias"):
            t = m._parameters.get(role)
            if t is not None:
                owners.setdefault(id(t), []).append((m, role))
    plan = LayerwisePlan({}, {})
    for name in subset.names:
        found = owners.get(id(params[name]), [])
        why = _unsupported(found)
        if why:
            plan.rules[name], plan.reasons[name] = LayerRule.VMAP.value, why
            continue
        role = found[0][1]
        norm = isinstance(found[0][0], _NORMS)
        plan.rules[name] = (LayerRule.NORM_AFFINE if norm else LayerRule.PER_SAMPLE).value
        plan.sites[name] = _Site(name, role, tuple(m for m, _ in found))
    return plan


def _unsupported(found: list[tuple[nn.Module, str]]) -> str:
    if not found:
        return "not the weight or bias of a module"
    if len({r for _, r in found}) > 1:
        return "used as weight of one module and bias of another"
    kinds = set()
    for m, _ in found:
        base = next((b for b in _SUPPORTED if isinstance(m, b)), None)
        if base is None:
            return f"owned by a {type(m).__name__} (no closed form)"
        if type(m).forward is not base.forward:
            return f"owned by {type(m).__name__}, which overrides forward"
        if isinstance(m, _CONV):
            if m.padding_mode != "zeros":
                return f"{type(m).__name__} with padding_mode={m.padding_mode!r}"
            if numeric_padding(m.padding, m.dilation, m.kernel_size) is None:
                return f"{type(m).__name__} with asymmetric 'same' padding"
        kinds.add(base)
    if len(kinds) > 1:
        return "shared by modules of different types"
    return ""


# ---------------------------------------------------------------------- running
class LayerwiseRun:
    """Hooks for one batched forward and its backward passes; removed on exit.

    Use::

        with LayerwiseRun(plan, temp_bytes=..., create_graph=False) as run:
            out = model(batch)            # inside the block: hooks capture layer inputs
        sums = run.backward(objectives, anchors)

    ``sums`` maps each layer-wise tensor to ``sum_k w_k sum_i G_ik^2`` (full tensor shape).
    """

    def __init__(
        self,
        plan: LayerwisePlan,
        *,
        temp_bytes: int = DEFAULT_TEMP_BYTES,
        create_graph: bool = False,
        tune: Tune = Tune.AUTO,
    ) -> None:
        self.plan = plan
        self.temp_bytes = temp_bytes
        self.create_graph = create_graph
        self.tune = tune
        self.sites = [plan.sites[n] for n in plan.layerwise_names]
        self._by_module: dict[int, list[_Site]] = {}
        self._modules: dict[int, nn.Module] = {}
        for s in self.sites:
            s.calls = []
            for m in s.modules:
                self._by_module.setdefault(id(m), []).append(s)
                self._modules[id(m)] = m
        self._handles: list[Any] = []
        # the gradient hooks on the layers' outputs: removed after the backward passes (a
        # hook kept this run alive from the autograd graph, beyond the reach of the garbage
        # collector: under create_graph each call leaked its tensors, and the caller's second
        # backward through that graph ran the hooks' products again for nothing)
        self._grad_hooks: list[Any] = []
        self._watch = _UseWatch({id(s.modules[0]._parameters[s.role]): s.name for s in self.sites})
        # outputs of the layers that read a model input directly, per input: the backward
        # stops there (no gradient of the input itself) unless something else reads it
        self._entries: dict[int, list[Tensor]] = {}
        self._stack = contextlib.ExitStack()
        self._sums: dict[str, Tensor] = {}
        self._buffers: dict[str, Tensor] = {}
        self._weight = 1.0
        self._objective = 0
        self._error: BaseException | None = None
        # follows which sample each row belongs to (set by batched_run); every layer call
        self.tracker: RowTracker | None = None
        self.calls: list[_Call] = []
        # reusable flat buffers for the per-layer temporaries (no-graph runs only): the same
        # memory serves every layer and chunk instead of a fresh allocation each time
        self._work: dict[str, Tensor] = {}
        # gram over several objectives: the weighted pair products summed so far, per tensor
        self._pair_sums: dict[str, Tensor] = {}

    def _scratch(self, key: str, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        """A ``shape`` view of the run's reusable buffer ``key``; ``None`` with ``create_graph``
        (the temporaries are then part of the graph)."""
        if self.create_graph:
            return None
        numel = math.prod(shape)
        buf = self._work.get(key)
        if (
            buf is None
            or buf.numel() < numel
            or (buf.dtype, buf.device) != (like.dtype, like.device)
        ):
            buf = self._work[key] = like.new_empty(numel)
        return buf[:numel].view(shape)

    def __enter__(self) -> LayerwiseRun:
        try:
            for module in self._modules.values():
                self._handles.append(module.register_forward_pre_hook(self._pre_hook))
                self._handles.append(module.register_forward_hook(self._hook))
            self._stack.enter_context(self._watch)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def watch_signature(self) -> list[tuple] | None:
        """The run's torch calls, described (``None``: one could not be)."""
        return self._watch.signature

    def record_signature(self) -> None:
        """Describe the run's torch calls from here on (:attr:`watch_signature`)."""
        self._watch.signature = []

    def watch_inputs(self, inputs: Sequence[Tensor]) -> None:
        """Call before the forward with the model's inputs (the backward's anchors)."""
        self._watch.inputs = {id(t) for t in inputs}

    def close(self) -> None:
        self._stack.close()
        self._work.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def discard(self) -> None:
        """Drop a run that will not go backward: its gradient hooks too."""
        self.close()
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()

    # forward
    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        self._watch.inside += 1

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._watch.quiet += 1
        try:
            self._record(module, args, output)
        finally:
            self._watch.quiet -= 1
            self._watch.inside -= 1  # after the record's own reads (the input's detach)

    def _record(self, module: nn.Module, args: tuple, output: Any) -> None:
        kind = type(module).__name__
        if len(args) != 1 or not isinstance(args[0], Tensor) or not isinstance(output, Tensor):
            self._error = NotLayerwiseError(f"{kind} was called with other than one tensor")
            return
        if not output.requires_grad:
            self._error = NotLayerwiseError(f"the output of a {kind} does not require grad")
            return
        if id(args[0]) in self._watch.inputs:
            self._entries.setdefault(id(args[0]), []).append(output)
        call = _Call(module, args[0] if self.create_graph else args[0].detach())
        call.shape = tuple(output.shape)
        if self.tracker is not None:
            call.owner = self.tracker.owner(output)
        self.calls.append(call)
        sites = self._by_module[id(module)]
        for s in sites:
            s.calls.append(call)
        self._grad_hooks.append(
            output.register_hook(lambda g, call=call, sites=sites: self._on_grad(call, sites, g))
        )

    # backward
    def backward(
        self, objectives: Sequence[tuple[Tensor, float]], anchors: Sequence[Tensor]
    ) -> dict[str, Tensor]:
        """Run one backward pass per ``(scalar, weight)``; returns the weighted sums.

        Raises:
            NotLayerwiseError: a parameter was read outside its layers, a layer was called in
                an unsupported way, or a layer's gradient never arrived.
        """
        if self._error is not None:
            raise self._error
        if self._watch.misused:
            names = ", ".join(sorted(self._watch.misused))
            raise NotLayerwiseError(f"parameter(s) {names} are also read outside their layers")
        for s in self.sites:
            if not s.calls:
                raise NotLayerwiseError(f"parameter {s.name!r}: its layer was never called")
        anchors = [a for a in anchors if a.requires_grad]
        if not anchors:
            raise NotLayerwiseError("no input of the model is a floating-point tensor")
        anchors, self._entries = self._stops(anchors), {}
        self._last = len(objectives) - 1
        try:
            self._backward(objectives, anchors)
        finally:
            for h in self._grad_hooks:
                h.remove()
            self._grad_hooks.clear()
        return self._sums

    def _backward(self, objectives: Sequence[tuple[Tensor, float]], anchors: list[Tensor]) -> None:
        for k, (scalar, weight) in enumerate(objectives):
            self._objective, self._weight = k, weight
            torch.autograd.grad(
                scalar,
                anchors,
                retain_graph=k < self._last or self.create_graph,
                create_graph=self.create_graph,
                allow_unused=True,
            )
            for s in self.sites:
                if any(c.received != k + 1 for c in s.calls):
                    raise NotLayerwiseError(
                        f"parameter {s.name!r}: a call's output gradient did not arrive (its "
                        "output does not reach the model's inputs in the graph)"
                    )

    def _stops(self, anchors: list[Tensor]) -> list[Tensor]:
        """Where the backward passes stop: an input read only by layers is replaced by those
        layers' outputs (their gradients are all the rules need; the input's would cost a
        backward through the first layer for nothing)."""
        stops = []
        for a in anchors:
            entries = self._entries.get(id(a))
            read_outside = id(a) in self._watch.inputs_outside
            stops.extend([a] if read_outside or not entries else entries)
        return stops

    def _on_grad(self, call: _Call, sites: list[_Site], g: Tensor) -> None:
        call.received += 1
        if call.input is None:
            return
        for s in sites:
            self._site_grad(s, call, g)
        if self._objective == self._last and not self.create_graph:
            call.input = None  # free the layer input early

    def _site_grad(self, s: _Site, call: _Call, g: Tensor) -> None:
        m, a = call.module, call.input
        rule = self.plan.rules[s.name]
        multi = len(s.calls) > 1
        rows = call.groups if call.groups is not None and not call.groups.plain else None
        if rows is not None and isinstance(m, (nn.Linear, nn.LayerNorm)):
            # units are positions: each sample's positions gathered into a row of its own
            dims = a.dim() - (1 if isinstance(m, nn.Linear) else len(m.normalized_shape))
            a, g, rows = rows.by_sample(a, dims), rows.by_sample(g, dims), None
        if rule == LayerRule.NORM_AFFINE:
            per = _norm_grads(m, a, g, s.role)  # (rows, *param)
            self._add_per_sample(s, per if rows is None else rows.sum_rows(per), multi)
            return
        d, u, groups = _columns(m, a, g, self._scratch, rows)  # (N, Co, L), columns, groups
        if s.role == "bias":
            self._add_per_sample(s, d.sum(-1), multi)
            return
        n, co, positions = d.shape
        ck = m.weight[0].numel() * groups  # rows of U: C_in * prod(kernel)
        if s.name not in self.plan.costs:
            valid = _valid_columns(m, a, positions)
            self.plan.costs[s.name] = _costs(self, s, d, ck, groups, valid)
        if not multi and self.plan.rules[s.name] == LayerRule.GRAM:
            products, weight = None, self._weight
            if self.plan.costs[s.name]["summed"]:
                # several objectives (a class each): their D pair products summed first, one
                # matmul per kernel offset at the last (the class sum does not multiply it)
                acc = self._pair_sums.get(s.name)
                self._pair_sums[s.name] = _add_pair_products(acc, d, self._weight)
                if self._objective < self._last:
                    return
                products, weight = self._pair_sums.pop(s.name), 1.0
            pairs = _pairs(_valid_columns(m, a, positions))
            most = max(len(f) for _, f, _ in pairs)
            step = self._chunk(n, 2 * most * (co + ck), d)
            self._add(s, _gram(d, u, groups, pairs, step, products).reshape(m.weight.shape), weight)
            return
        kernel = 0 if multi or rows is not None else self._kernel(s, m, a, g, ck)
        if kernel:
            self._per_sample(s, m, a, g, kernel)
            return
        self._by_columns(s, m, d, u, groups, multi)

    def _by_columns(
        self,
        s: _Site,
        m: nn.Module,
        d: Tensor,
        u: Callable[[slice], Tensor],
        groups: int,
        multi: bool,
    ) -> None:
        """``per_sample`` by columns: ``G_i = D_i U_i^T`` by ``bmm``."""
        n, co, positions = d.shape
        ck = m.weight[0].numel() * groups
        # columns unfolded in large chunks (few im2col calls); per-sample gradients formed in
        # small ones (squared while still in cache)
        outer = self._chunk(n, ck * positions, d)
        inner = self._chunk(n, co * ck // groups, d, CACHE_BYTES)
        for start in range(0, n, outer):
            cols = u(slice(start, min(n, start + outer)))
            for sub in range(0, cols.shape[0], inner):
                rows = slice(start + sub, start + min(cols.shape[0], sub + inner))
                c = rows.stop - rows.start
                out = self._scratch("per", (c, co, ck // groups), d)
                per = _per_sample_weight(d[rows], cols[sub : sub + inner], groups, out)
                per = per.reshape(per.shape[0], *m.weight.shape)  # (c, *weight)
                self._add_per_sample(s, per, multi, rows, n)
                del per  # before the next chunk's bmm allocates its own
            del cols

    def _kernel(self, s: _Site, m: nn.Module, a: Tensor, g: Tensor, ck: int) -> int:
        """How a convolution's ``per_sample`` rule forms ``G_i`` (no graph): ``0`` by columns,
        ``c > 0`` by grouped convolutions over ``c`` samples a call (0.35x the columns' time
        at 16 input channels a sample on 2 CPU cores, 3-10x past about 2,000 channels a call):
        timed per layer shape and size class under ``tune=True``, that choice run by ``auto``
        after; columns for small layers, with a graph and where nothing was timed."""
        if self.create_graph or not isinstance(m, _CONV) or self.tune is Tune.ESTIMATE:
            return 0
        n, co = g.shape[:2]
        if 2.0 * n * co * ck * g[0, 0].numel() < PROBE_MIN_FLOPS:
            return 0
        # one decision per power-of-two class of samples and of input positions: ragged
        # batches (a new map size per shape bucket) must not pay a probe per bucket
        sizes = (n.bit_length(), a[0, 0].numel().bit_length())
        conv = (m.stride, m.padding, m.dilation, m.groups)
        key = (type(m), sizes, tuple(m.weight.shape), conv, a.dtype, a.device)
        if (chosen := decided("layerwise_kernel", key)) is not None:
            return chosen[1] or 0
        if self.tune is not Tune.MEASURE:
            return 0
        most = min(self._chunk(n, co * ck, g), max(1, GROUPED_CHANNELS // max(co, a.shape[1])))
        before = self._sums.pop(s.name, None)
        trial = functools.partial(self._trial, s, m, a, g)
        kernels = sorted({0, most, max(1, most // 4)})  # columns first: ties keep the sure one
        routes = [
            Route(f"grouped/{k}" if k else "columns", functools.partial(trial, k), k)
            for k in kernels
        ]
        best = tune("layerwise_kernel", key, routes, devices=[a.device], notes=[])
        self._sums.pop(s.name, None)
        if before is not None:
            self._sums[s.name] = before
        return 0 if best is None else best.chunk or 0

    def _trial(self, s: _Site, m: nn.Module, a: Tensor, g: Tensor, kernel: int) -> float | None:
        """One run of ``kernel`` for :meth:`_kernel` (the sums it leaves are dropped)."""
        self._sums.pop(s.name, None)
        try:
            self._per_sample(s, m, a, g, kernel)
        except RuntimeError:  # a backend without that grouped convolution: not a candidate
            if not kernel:
                raise
            return None
        return 1.0

    def _per_sample(self, s: _Site, m: nn.Module, a: Tensor, g: Tensor, kernel: int) -> None:
        """The ``per_sample`` rule of a layer called once: ``kernel`` as in :meth:`_kernel`."""
        n = g.shape[0]
        if kernel:  # grouped convolutions
            for start in range(0, n, kernel):
                rows = slice(start, min(n, start + kernel))
                self._add_per_sample(s, _conv_weight_grads(m, a[rows], g[rows]), False)
            return
        d, u, groups = _columns(m, a, g, self._scratch)
        self._by_columns(s, m, d, u, groups, False)

    def _chunk(self, n: int, elems_per_sample: int, like: Tensor, cap: int | None = None) -> int:
        budget = self.temp_bytes if cap is None else min(cap, self.temp_bytes)
        return chunk_in(budget, elems_per_sample, like.element_size(), n)

    def _add_per_sample(
        self,
        s: _Site,
        per: Tensor,
        multi: bool,
        rows: slice | None = None,
        n: int | None = None,
    ) -> None:
        """``per`` ``(c, *param)``: per-sample gradients of ``rows`` (all samples if None)."""
        if not multi:
            if self.create_graph:
                self._add(s, (per * per).sum(0))
            else:
                acc = self._sums.get(s.name)
                if acc is None:
                    acc = self._sums[s.name] = torch.zeros_like(per[0])
                _accumulate_squares(acc, per, self._weight)
            return
        n = per.shape[0] if n is None else n
        buf = self._buffers.get(s.name)
        if buf is None:
            buf = self._buffers[s.name] = per.new_zeros((n, *per.shape[1:]))
        rows = rows or slice(0, n)
        if self.create_graph:
            buf = self._buffers[s.name] = buf.index_add(
                0, torch.arange(rows.start, rows.stop, device=buf.device), per
            )
        else:
            buf[rows] += per
        if rows.stop == n and all(c.received == self._objective + 1 for c in s.calls):
            del self._buffers[s.name]
            self._add(s, (buf * buf).sum(0))

    def _add(self, s: _Site, sq: Tensor, weight: float | None = None) -> None:
        """``sums[s] += weight * sq`` (``weight``: the current objective's by default)."""
        weight = self._weight if weight is None else weight
        sq = sq if weight == 1.0 else sq * weight
        prev = self._sums.get(s.name)
        self._sums[s.name] = sq if prev is None else prev + sq


def _costs(
    run: LayerwiseRun, s: _Site, d: Tensor, ck: int, groups: int, valid: Tensor
) -> dict[str, float]:
    """Flop-equivalents per sample over ``run``'s objectives of ``gram`` and ``per_sample``
    for a weight (``valid`` ``(K, L)``, :func:`_valid_columns`), and whether ``gram`` sums the
    objectives' pair products before its matmul (``summed``: several objectives, no graph,
    the sums within four times the temporaries' bytes); sets the rule to ``gram`` where it is
    cheaper."""
    n, co, positions = d.shape
    objectives = run._last + 1
    per_offset = valid.sum(1)
    pairs = int((per_offset * (per_offset + 1) // 2).sum())
    matmul = 2.0 * pairs * co * ck / groups / len(per_offset)
    ps = objectives * (2.0 * positions + COST_PER_ENTRY) * co * ck / groups
    all_pairs = positions * (positions + 1) // 2
    summed = (
        objectives > 1
        and not run.create_graph
        and tensor_bytes(n * co * all_pairs, d.element_size()) <= 4 * run.temp_bytes
    )
    formed = objectives * COST_PER_ENTRY * all_pairs * co  # the pair products, summed
    gram = matmul + formed if summed else objectives * matmul
    if len(s.calls) == 1 and gram <= ps:
        run.plan.rules[s.name] = LayerRule.GRAM.value
    return {"gram": gram, "per_sample": ps, "summed": float(summed)}


#: reads of a tensor's metadata, not of its values (``next(model.parameters()).device``):
#: not a use of a parameter
_METADATA = frozenset(
    [
        *(
            getattr(torch.Tensor, name).__get__
            for name in ("device", "dtype", "shape", "ndim", "is_cuda", "layout", "requires_grad")
        ),
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.element_size,
        torch.Tensor.get_device,
    ]
)


class _UseWatch(TorchFunctionMode):
    """Records parameters read by an op outside the layers that own them (metadata reads such
    as ``.device`` are not uses), and the model's inputs (``inputs``, by id) read by one."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched = watched
        #: every torch call of the run, described (:func:`~multiscale_jac._row_replay.describe`;
        #: recorded once set to a list, by :func:`batched_run`; ``None`` again once one cannot be)
        self.signature: list[tuple] | None = None
        self.quiet = 0  # the run's own bookkeeping (its hooks), not the model's calls
        self.inside = 0
        self.misused: set[str] = set()
        self.inputs: set[int] = set()
        self.inputs_outside: set[int] = set()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.signature is not None and not self.quiet:
            call = describe(func, args, kwargs)
            if call is None:
                self.signature = None
            else:
                self.signature.append(call)
        if self.inside == 0 and (self.watched or self.inputs) and func not in _METADATA:
            for t in tree_leaves((args, kwargs)):
                if not isinstance(t, Tensor):
                    continue
                if id(t) in self.watched:
                    self.misused.add(self.watched[id(t)])
                if id(t) in self.inputs:
                    self.inputs_outside.add(id(t))
        return func(*args, **kwargs)


def batched_run(
    fn: PerSampleFunction,
    levels: list[Tensor],
    plan: LayerwisePlan,
    *,
    temp_bytes: int = DEFAULT_TEMP_BYTES,
    create_graph: bool = False,
    check: bool = True,
    random: bool = False,
    tune: Tune = Tune.AUTO,
) -> tuple[list[Tensor], Tensor, LayerwiseRun]:
    """The model on stacked samples ``levels`` (``(n, C_l, *spatial_l)``) with the layer-wise
    hooks. Returns the inputs (made to require grad: the backward passes stop there), the
    output after ``output_fn`` ``(n, ...)`` and the run to call :meth:`LayerwiseRun.backward` on.
    ``random``: the model draws random masks (dropout in train mode), one per sample here.
    ``tune``: whether the convolutions' kernels may be timed (:meth:`LayerwiseRun._probe`).

    Raises:
        NotLayerwiseError: the output's rows are not the samples in order, or a layer's rows
            cannot be given to samples (:mod:`~multiscale_jac.rows`; the message names the
            layer and why); with ``check``, sample 0 run alone differs from its batched result
            (the model mixes samples in a batch).
    """
    lv = [t.detach().requires_grad_(t.is_floating_point()) for t in levels]
    options = {"temp_bytes": temp_bytes, "create_graph": create_graph, "tune": tune}
    key = (
        tuple((tuple(t.shape), t.dtype, t.device) for t in lv),
        tuple(sorted(id(m) for s in plan.sites.values() for m in s.modules)),
        create_graph,
    )
    kept = ROW_PLANS.get(fn.model, key)
    out, run = _forward(fn, lv, plan, options, tracked=kept is None)
    if kept is not None:  # the rows as a pure run with the same calls gave them
        calls = [(id(c.module), c.shape) for c in run.calls]
        if kept.matches(run.watch_signature, calls, out):
            for call, groups in zip(run.calls, kept.groups):
                call.groups = groups
        else:  # something else ran: follow the rows again, from now on
            run.discard()
            ROW_PLANS.put(fn.model, key, None)
            out, run = _forward(fn, lv, plan, options, tracked=True)
            kept = None
    if kept is None:
        try:
            settle_rows(run, out)
        except BaseException:
            run.discard()
            raise
        signature = run.watch_signature
        if run.tracker is not None and run.tracker.pure and signature is not None:
            ROW_PLANS.put(
                fn.model,
                key,
                RowPlan(
                    tuple(signature),
                    tuple((id(c.module), c.shape) for c in run.calls),
                    tuple(c.groups for c in run.calls),
                    tuple(out.shape),
                ),
            )
    run.tracker = None  # the owners are no longer needed
    if check:
        check_separable(fn, levels, out, random=random)
    return lv, out, run


def _forward(
    fn: PerSampleFunction,
    lv: list[Tensor],
    plan: LayerwisePlan,
    options: dict[str, Any],
    *,
    tracked: bool,
) -> tuple[Tensor, LayerwiseRun]:
    """The batched forward pass with the layer-wise hooks, the rows followed if ``tracked``."""
    run = LayerwiseRun(plan, **options)
    run.watch_inputs(lv)
    run.record_signature()
    if tracked:
        run.tracker = RowTracker(lv[0].shape[0])
        run.tracker.mark_inputs(lv)
    try:
        with torch.enable_grad(), run, run.tracker or contextlib.nullcontext():
            out = fn.call_batch(lv)
        if not isinstance(out, Tensor):
            raise NotLayerwiseError(f"the model returned a {type(out).__name__}, not a tensor")
    except BaseException:
        run.discard()
        raise
    return out, run


def settle_rows(run: LayerwiseRun, out: Tensor) -> None:
    """Give every layer call of ``run`` the sample of each unit of its output.

    Raises:
        NotLayerwiseError: ``out``'s row ``i`` is not sample ``i``'s, or a call's units cannot
            be given to samples (the message names the layer).
    """
    tracker = run.tracker
    if tracker is None:
        raise NotLayerwiseError("no row tracker ran")
    why = output_rows(tracker, out)
    if why is not None:
        raise NotLayerwiseError(f"the model's output rows are not its samples in order: {why}")
    for s in run.sites:
        for call in s.calls:
            if call.groups is not None:
                continue
            m = call.module
            if isinstance(m, nn.Linear):
                dims = len(call.shape) - 1
            elif isinstance(m, nn.LayerNorm):
                dims = len(call.shape) - len(m.normalized_shape)
            else:  # convolutions and BatchNorm/GroupNorm: the rows of dim 0
                dims = 1
            found = groups_of(call.owner, call.shape, dims, tracker.n)
            if isinstance(found, str):
                names = ", ".join(repr(t.name) for t in run.sites if m in t.modules)
                raise NotLayerwiseError(
                    f"the {type(m).__name__} layer of {names}: {found}; its rows cannot be "
                    "given to samples"
                )
            call.groups = found


class _NoDropout(TorchFunctionMode):
    """Dropout as the identity (the separability check of a random model)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        return func(*args, **kwargs)


_DROPOUTS = {
    *named(F, "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout"),
    torch.dropout,
}


def check_separable(
    fn: PerSampleFunction, levels: list[Tensor], out: Tensor, *, random: bool = False
) -> None:
    """Sample 0 run alone (batch of one) must give what it gave in the batch; for a
    ``random`` model both runs are repeated with dropout off (two samples batched)."""
    if random:
        with torch.no_grad(), _NoDropout():
            out = fn.call_batch([t[:2] for t in levels])
        with _NoDropout():
            check_separable(fn, [t[:2] for t in levels], out)
        return
    with torch.no_grad():
        alone = fn.call(fn.params, tuple(t[0] for t in levels)).reshape(-1)
    batched = out[0].detach().reshape(-1)
    if alone.shape != batched.shape:
        raise NotLayerwiseError(
            f"sample 0 gives an output of {alone.numel()} entries alone and {batched.numel()} in "
            "a batch"
        )
    tol = 1e-9 if out.dtype == torch.float64 else 1e-4
    scale = max(1.0, float(batched.abs().max())) if batched.numel() else 1.0
    err = float((alone - batched).abs().max()) if batched.numel() else 0.0
    if err > tol * scale:
        raise NotLayerwiseError(
            f"sample 0's output differs by {err:.3g} between a batch and a batch of one: the "
            "model mixes samples in a batch"
        )


# ---------------------------------------------------------------------- closed forms
_Scratch = Callable[[str, tuple[int, ...], Tensor], "Tensor | None"]


def _columns(
    m: nn.Module,
    a: Tensor,
    g: Tensor,
    scratch: _Scratch | None = None,
    rows: RowGroups | None = None,
) -> tuple[Tensor, Callable[[slice], Tensor], int]:
    """Column form: ``D`` ``(N, Co, L)``, a function giving ``U`` ``(c, Ck, L)`` for a slice of
    samples (unfolded lazily, chunk by chunk, into ``scratch`` buffers when given), and the
    number of groups. A convolution whose rows are not one per sample in order (``rows``)
    gets each sample's rows side by side: ``L`` = rows per sample x positions of a row."""
    n = g.shape[0]
    if isinstance(m, nn.Linear):
        d = g.reshape(n, -1, g.shape[-1]).transpose(1, 2)
        x = a.reshape(n, -1, a.shape[-1]).transpose(1, 2)
        return d, lambda rows: x[rows], 1
    kernel = tuple(m.kernel_size)
    padding = numeric_padding(m.padding, tuple(m.dilation), kernel)
    stride, dilation = tuple(m.stride), tuple(m.dilation)
    if isinstance(m, nn.Conv1d):
        a, kernel = a.unsqueeze(2), (1, *kernel)
        stride, padding, dilation = (1, *stride), (0, *padding), (1, *dilation)
    d = g.reshape(n, g.shape[1], -1)
    if rows is not None:
        d, unfold_rows = _sample_columns(rows, a, d, (kernel, stride, padding, dilation), scratch)
        return d, unfold_rows, m.groups

    def unfold(samples: slice) -> Tensor:
        return unfold_columns(a[samples], kernel, stride, padding, dilation, scratch=scratch)

    return d, unfold, m.groups


def _sample_columns(
    rows: RowGroups, a: Tensor, d: Tensor, geometry: tuple, scratch: _Scratch | None
) -> tuple[Tensor, Callable[[slice], Tensor]]:
    """A convolution's column form by sample from its rows ``a`` ``(R, C, H, W)`` and ``d``
    ``(R, Co, L)``: ``D`` ``(N, Co, k L)`` and ``U`` for a slice of samples ``(c, Ck, k L)``
    (a sample's ``k`` rows side by side, zero rows where it has fewer)."""
    n = rows.n
    per = rows.by_sample(d, 1)  # (N, k, Co, L)
    k = per.shape[1]
    d_by_sample = per.transpose(1, 2).reshape(n, d.shape[1], -1)

    def unfold(samples: slice) -> Tensor:
        x = rows.by_sample(a, 1, samples)  # (c, k, C, H, W)
        c = x.shape[0]
        cols = unfold_columns(x.reshape(c * k, *x.shape[2:]), *geometry, scratch=scratch)
        return cols.view(c, k, *cols.shape[1:]).transpose(1, 2).reshape(c, cols.shape[1], -1)

    return d_by_sample, unfold


def unfold_columns(
    x: Tensor,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    *,
    scratch: _Scratch | None = None,
) -> Tensor:
    """``F.unfold`` as one strided copy (several times faster on CPU for small kernels):
    ``(n, C, H, W)`` -> ``(n, C * kh * kw, L)``. With ``scratch`` (see
    :meth:`LayerwiseRun._scratch`) the padded input and the columns go into reused buffers."""
    if x.requires_grad:
        # in a graph: im2col, whose backward (col2im) is far cheaper than that of a strided
        # view with overlapping windows
        return F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    scratch = scratch or (lambda key, shape, like: None)
    if any(padding):
        n, c, h, w = x.shape
        shape = (n, c, h + 2 * padding[0], w + 2 * padding[1])
        padded = scratch("pad", shape, x)
        if padded is None:
            x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
        else:
            padded.zero_()
            padded[:, :, padding[0] : padding[0] + h, padding[1] : padding[1] + w] = x
            x = padded
    n, c, h, w = x.shape
    ho = (h - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    wo = (w - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    sn, sc, sh, sw = x.stride()
    view = x.as_strided(
        (n, c, kernel[0], kernel[1], ho, wo),
        (sn, sc, sh * dilation[0], sw * dilation[1], sh * stride[0], sw * stride[1]),
        x.storage_offset(),
    )
    out = scratch("cols", (n, c, kernel[0], kernel[1], ho, wo), x)
    if out is None:
        return view.reshape(n, c * kernel[0] * kernel[1], ho * wo)
    return out.copy_(view).view(n, c * kernel[0] * kernel[1], ho * wo)


def _conv_weight_grads(m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradients ``(N, *weight)`` of a convolution as one weight gradient of
    a grouped convolution: the ``N`` samples stacked along channels, ``N * groups`` groups."""
    n, w = a.shape[0], m.weight
    dims = a.dim() - 2
    padding = numeric_padding(m.padding, tuple(m.dilation), tuple(m.kernel_size))
    shape = (n * w.shape[0], *w.shape[1:])  # only the weight's shape is read
    _, grads, _ = torch.ops.aten.convolution_backward(
        g.reshape(1, -1, *g.shape[2:]),
        a.reshape(1, -1, *a.shape[2:]),
        w.detach().new_empty(()).expand(shape),
        None,
        m.stride,
        padding,
        m.dilation,
        False,
        (0,) * dims,
        n * m.groups,
        (False, True, False),
    )
    return grads.view(n, *w.shape)


def _accumulate_squares(acc: Tensor, per: Tensor, weight: float) -> None:
    """``acc += weight * (per ** 2).sum(0)``, squaring ``per`` (a scratch tensor) in place:
    measured faster on CPU than row-by-row ``addcmul_`` or a batched dot product, by 1.5-2x
    on VGG-11 and ResNet-8 diagonal Fishers."""
    acc.add_(per.square_().sum(0), alpha=weight)


def _per_sample_weight(d: Tensor, u: Tensor, groups: int, out: Tensor | None = None) -> Tensor:
    """``G_i = D_i U_i^T`` per group: ``(c, Co, Ck / groups)`` (written into ``out`` if given)."""
    c, co, positions = d.shape
    if groups == 1:
        return torch.bmm(d, u.transpose(1, 2), out=out)
    dg = d.view(c, groups, co // groups, positions)
    ug = u.view(c, groups, u.shape[1] // groups, positions)
    if out is None:
        return torch.matmul(dg, ug.transpose(-1, -2)).reshape(c, co, -1)
    grouped = out.view(c, groups, co // groups, -1)
    torch.matmul(dg, ug.transpose(-1, -2), out=grouped)
    return out


def _valid_columns(m: nn.Module, a: Tensor, positions: int) -> Tensor:
    """``(K, L)``: where ``U``'s columns can be non-zero, per kernel offset (``K = 1`` for
    Linear) and output position; zero padding gives structural zeros."""
    if isinstance(m, nn.Linear):
        return torch.ones(1, positions, dtype=torch.bool, device=a.device)
    kernel = tuple(m.kernel_size)
    padding = numeric_padding(m.padding, tuple(m.dilation), kernel)
    stride, dilation = tuple(m.stride), tuple(m.dilation)
    ones = a.new_ones(1, 1, *a.shape[2:])
    if isinstance(m, nn.Conv1d):
        ones, kernel = ones.unsqueeze(2), (1, *kernel)
        stride, padding, dilation = (1, *stride), (0, *padding), (1, *dilation)
    valid = unfold_columns(ones, kernel, stride, padding, dilation)[0] != 0
    # a sample's rows side by side (:func:`_sample_columns`): the same pattern per row
    return valid.repeat(1, positions // valid.shape[1]) if positions > valid.shape[1] else valid


def _pairs(valid: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per kernel offset, the pairs ``l <= l'`` of output positions where both columns can be
    non-zero (``valid`` ``(K, L)``): their indices among all pairs (``torch.triu_indices``
    order, :func:`_add_pair_products`), ``l`` and ``l'``."""
    positions = valid.shape[1]
    first, second = torch.triu_indices(positions, positions, device=valid.device)
    out = []
    for row in valid:
        keep = row[first] & row[second]
        out.append((keep.nonzero().view(-1), first[keep], second[keep]))
    return out


def _add_pair_products(acc: Tensor | None, d: Tensor, weight: float) -> Tensor:
    """``acc + weight * w_ll' D_il D_il'`` ``(L (L + 1) / 2, N, Co)`` over all pairs
    ``l <= l'`` (``torch.triu_indices`` order, pairs first: each a contiguous block; ``w`` 1
    on the diagonal, 2 off it), in place into ``acc`` (zeros when ``None``) by one
    broadcast multiply-add per position (no gathers)."""
    positions = d.shape[-1]
    dt = d.permute(2, 0, 1).contiguous()  # (L, N, Co)
    if acc is None:
        acc = dt.new_zeros(positions * (positions + 1) // 2, *dt.shape[1:])
    start = 0
    for lo in range(positions):
        acc[start].addcmul_(dt[lo], dt[lo], value=weight)
        if lo + 1 < positions:
            rest = acc[start + 1 : start + positions - lo]
            rest.addcmul_(dt[lo].unsqueeze(0), dt[lo + 1 :], value=2.0 * weight)
        start += positions - lo
    return acc


def _gram(
    d: Tensor,
    u: Callable[[slice], Tensor],
    groups: int,
    pairs: list[tuple[Tensor, Tensor, Tensor]],
    step: int,
    products: Tensor | None = None,
) -> Tensor:
    """``sum_i G_i^2`` ``(Co, Ck / groups)`` without forming ``G_i``: per kernel offset ``k``,
    ``sum_{i, l <= l'} w D_il D_il' U_ikl U_ikl'`` as one matmul with inner size ``c`` times
    the offset's pairs (:func:`_pairs`), per chunk of ``c`` samples. The weighted ``D`` pair
    products are :func:`_add_pair_products` of ``d``, or ``products`` ``(pairs, N, Co)`` where
    the caller summed them over several objectives."""
    n, co = d.shape[:2]
    cog, offsets = co // groups, len(pairs)
    parts: list[Tensor | None] = [None] * offsets
    cin = 0
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        uc = u(rows)
        c, cin = uc.shape[0], uc.shape[1] // groups // offsets
        # positions first, then groups, samples, channels: a pair's rows are contiguous
        ut = uc.reshape(c, groups, cin, offsets, -1).permute(3, 4, 1, 0, 2).contiguous()
        pc = _add_pair_products(None, d[rows], 1.0) if products is None else products[:, rows]
        pc = pc.reshape(-1, c, groups, cog).transpose(1, 2)  # (pairs, groups, c, Co/g)
        for k, (idx, f, g) in enumerate(pairs):
            if not len(idx):
                continue
            dd = pc[idx].transpose(0, 1).reshape(groups, -1, cog)  # (groups, pairs c, Co/g)
            uu = (ut[k][f] * ut[k][g]).transpose(0, 1).reshape(groups, -1, cin)
            part = torch.bmm(dd.transpose(1, 2), uu)  # (groups, Co/g, C_in/g)
            parts[k] = part if parts[k] is None else parts[k] + part
    zero = d.new_zeros(groups, cog, cin)
    cols = [zero if p is None else p for p in parts]
    return torch.stack(cols, dim=-1).reshape(co, -1)  # (Co, C_in/g * K): U's row order


def _norm_grads(m: nn.Module, a: Tensor, g: Tensor, role: str) -> Tensor:
    """Per-sample gradients of a normalisation layer's affine weight or bias ``(N, *param)``,
    a new tensor: the caller squares it in place, and ``g`` is the gradient the backward pass
    goes on with (a bias of a norm on ``(N, C)`` rows once handed ``g`` itself over, and its
    squares flowed on into the layers before: every tensor below it was off)."""
    if isinstance(m, nn.LayerNorm):
        dims = tuple(range(1, g.dim() - len(m.normalized_shape)))
        if role == "bias":
            return g.sum(dims) if dims else g.clone()
        xhat = F.layer_norm(a, m.normalized_shape, None, None, m.eps)
        return (g * xhat).sum(dims) if dims else g * xhat
    dims = tuple(range(2, g.dim()))
    if role == "bias":
        return g.sum(dims) if dims else g.clone()
    if isinstance(m, nn.GroupNorm):
        xhat = F.group_norm(a, m.num_groups, None, None, m.eps)
        return (g * xhat).sum(dims) if dims else g * xhat
    # BatchNorm with running statistics: sum_p g (a - mu) r = r (sum_p g a - mu sum_p g), the
    # inner products as one batched matmul (no activation-sized temporaries)
    rstd = torch.rsqrt(m.running_var + m.eps)
    if not dims:
        return g * (a - m.running_mean) * rstd
    n, c = g.shape[:2]
    ga = torch.bmm(g.reshape(n * c, 1, -1), a.reshape(n * c, -1, 1)).view(n, c)
    return (ga - m.running_mean * g.sum(dims)) * rstd
