"""Diagonal Fisher / GGN of a subset of parameters, streamed over data (EWC, Laplace).

Shapes and likelihoods as in :mod:`~multiscale_jac._likelihood`: a sample's output after
``output_fn`` keeps its batch dim of one; classification logits ``(1, C)`` or dense logits
``(1, C, *spatial)`` (one categorical per position; positions labelled ``ignore_index`` are left
out), regression outputs of any shape with targets of as many entries.

* ``kind="empirical"``: ``F = 1/N sum_i g_i^2`` with ``g_i = grad log p(y_i | x_i)``: the mean
  of squares, not the square of the mean gradient.
* ``kind="mc"``: the same with ``y`` drawn from the model's predictive (``mc_samples`` draws per
  input, averaged), seeded by ``generator``; a label is drawn from the same forward pass its
  gradient is taken in.
* ``kind="exact"``: ``F = 1/N sum_i diag(J_i^T Lambda_i J_i)`` with ``Lambda`` the Hessian of the
  negative log-likelihood w.r.t. the outputs (``diag(p) - p p^T`` per position; ``1/sigma^2``).

``return_loss=True`` also sums the negative log-likelihood of the data's targets, from the
outputs of the same batched passes where the batch ran layer-wise (one more forward pass per
batch otherwise): a Laplace fit needs the loss at the MAP beside the curvature.

Memory: per-sample gradients (``empirical``, ``mc``) are formed ``chunk`` samples at a time and
squared into a ``(P,)`` accumulator; ``exact`` takes per-sample Jacobians of a chunk from the
engine and reduces them at once. Nothing of size ``N x P`` is held. With dropout in train mode
and ``randomness="different"`` every sample draws its own masks (every entry of the diagonal is
an unbiased estimate over the masks).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from ._checks import (
    Prepared,
    check_bool,
    check_chunk_size,
    check_generator,
    check_int,
    check_memory_budget,
    check_positive_int,
    check_positive_number,
    prepare,
    warn_fallback,
)
from ._distributed import Reducer
from ._likelihood import (
    check_targets,
    draw_noise,
    ggn_factors,
    labels_from_noise,
    nll_sum,
    output_dim,
)
from ._memory import (
    DEFAULT_TEMP_BYTES,
    cpu_chunk_cap,
    fisher_chunks,
    fisher_kept,
    fisher_sample,
    fit_budget,
)
from ._planning import EngineOptions, measure, plan_key
from ._stream import Capture, pair, raw_output, split_targets, with_progress
from ._tuning import GROWTH, Route, decided, tune
from .adapter import PerSampleFunction
from .engine import run_engine
from .enums import (
    BatchNormPolicy,
    FisherKind,
    FisherMethod,
    InputKind,
    LayerRule,
    Likelihood,
    Randomness,
    Tune,
    parse_enum,
    parse_tune,
)
from .layerwise import (
    LayerwisePlan,
    LayerwiseRun,
    NotLayerwiseError,
    batched_run,
    plan_layers,
)
from .packing import PackedBatch
from .subset import ParamSubset

__all__ = ["DiagFisherResult", "diag_fisher"]

#: samples per vectorised call of the ``vmap`` route when neither ``chunk_size`` nor
#: ``memory_budget`` says otherwise (on CPU fewer where one tensor's per-sample gradients
#: would take 32 MiB: :func:`~multiscale_jac._memory.cpu_chunk_cap`; on the strided tanh CNN,
#: 15 samples a call took 0.35-0.5x the time of 32)
_VMAP_CHUNK = 32
#: ``method="auto", tune=True``: the larger layer-wise chunk it times (and runs, when chosen), the
#: one growth rule (:data:`~multiscale_jac._tuning.GROWTH`) over the planned chunk: 128 samples
_LAYERWISE_CHUNK = GROWTH * _VMAP_CHUNK


@dataclass(frozen=True)
class DiagFisherResult:
    """The diagonal and how it was computed.

    Attributes:
        flat: ``(P,)`` in the subset's flat order.
        subset: The :class:`ParamSubset` that defines the order.
        num_samples: The number of inputs averaged over.
        kind: ``empirical``, ``mc`` or ``exact``.
        likelihood: ``classification`` or ``regression``.
        method: How the per-sample terms were computed, in words.
        plan: Per selected tensor, the rule used (``gram``, ``per_sample``, ``norm_affine``
            from :class:`~multiscale_jac.LayerRule`, ``vmap`` or ``jacobian``).
        notes: Why tensors took ``vmap`` and any fallback.
        loss: With ``return_loss=True``, the negative log-likelihood of the targets summed
            over the data at the parameters' values, without constants: the cross-entropy
            summed over the labelled positions (classification) or ``0.5 * sum (f - y)^2 /
            sigma_noise^2`` (regression); ``None`` otherwise.
        num_outputs: Output entries (after ``output_fn``) summed over the samples.
        output_dim: The size of dim 1 of the output after ``output_fn`` (batch dim first:
            classes, channels or regression outputs; 1 for one value per sample).
    """

    flat: Tensor
    subset: ParamSubset
    num_samples: int
    kind: FisherKind
    likelihood: Likelihood
    method: str = ""
    plan: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = field(default=())
    loss: float | None = None
    num_outputs: int = 0
    output_dim: int = 0

    def as_dict(self) -> dict[str, Tensor]:
        """Per-tensor diagonals shaped like the selected entries."""
        return self.subset.split(self.flat)


def diag_fisher(
    model: nn.Module,
    data: Iterable[tuple[Any, Any]],
    *,
    params: ParamSubset | str | list[str] | None = None,
    likelihood: str | Likelihood = "classification",
    kind: str | FisherKind = "empirical",
    mc_samples: int = 1,
    output_fn: Any = None,
    sigma_noise: float = 1.0,
    ignore_index: int = -100,
    method: str | FisherMethod = "auto",
    input_kind: str | InputKind | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    randomness: str | Randomness = "error",
    batch_norm: str | BatchNormPolicy = "error",
    strict: bool = False,
    progress: bool = False,
    generator: torch.Generator | None = None,
    process_group: Any = None,
    return_loss: bool = False,
    tune: str | bool | Tune = "auto",
) -> DiagFisherResult:
    """Diagonal Fisher / GGN of the selected parameters, averaged over ``data``.

    Options shared with the other entry points mean the same everywhere: see the options
    table in ``docs/design.md``.

    Args:
        model: Any ``nn.Module`` (never changed).
        data: A DataLoader or any iterable of ``(inputs, targets)``; ``inputs`` in any form
            :func:`~multiscale_jac.pack` accepts, ``targets`` a tensor with a leading batch dim
            or a list of per-sample tensors (ragged label maps).
        params: Which entries (see :func:`~multiscale_jac.per_sample_jacobian`).
        likelihood: ``classification`` or ``regression``.
        kind: ``empirical``, ``mc`` or ``exact``.
        mc_samples: Draws per input for ``kind="mc"``.
        output_fn: Applied to the model's output (batch dim kept).
        sigma_noise: Gaussian noise scale for ``regression``.
        ignore_index: Label of positions left out (classification).
        method: ``auto``, ``layerwise`` or ``vmap`` (see :class:`~multiscale_jac.FisherMethod`).
        input_kind: How to read ambiguous ``inputs`` (:func:`~multiscale_jac.pack`).
        chunk_size: Samples per batched run (``layerwise``; default: a shape bucket, or what
            ``memory_budget`` allows; ``tune=True`` times 32 and up to 128) or per vectorised call
            (``vmap``; default 32, on CPU fewer where a tensor's gradients would take 32 MiB).
        memory_budget: Bytes of the call's working set, the accumulators included.
        randomness: ``error``, ``different`` or ``same`` for random ops, as ``torch.func.vmap``.
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.
        strict: Raise instead of falling back (layer-wise to ``vmap``, or an engine fallback).
        progress: A tqdm bar over the batches when a terminal is attached.
        generator: Seeds the labels drawn for ``kind="mc"``.
        process_group: ``torch.distributed``: each rank takes its shard, sums all-reduced once.
        return_loss: Also sum the negative log-likelihood of the data's own targets at
            ``sigma_noise`` (:attr:`DiagFisherResult.loss`; from the same batched passes where
            a batch ran layer-wise, else one more forward pass of it without gradients).
        tune: ``method="auto"``'s choice (:class:`~multiscale_jac.Tune`): ``True`` times the
            routes on the first batch; ``auto``: layer-wise where the model has a plan, or a
            choice ``tune=True`` kept for these shapes; ``False``: nothing recalled.

    Returns:
        A :class:`DiagFisherResult`.

    Raises:
        TypeError, ValueError: bad arguments or data (the message names the value).
    """
    prep = prepare(
        model,
        params=params,
        output_fn=output_fn,
        batch_norm=batch_norm,
        randomness=randomness,
        input_kind=input_kind,
    )
    opts = _Options(
        likelihood=parse_enum(Likelihood, likelihood, "likelihood"),
        kind=parse_enum(FisherKind, kind, "kind"),
        method=parse_enum(FisherMethod, method, "method"),
        mc_samples=check_positive_int(mc_samples, "mc_samples"),
        sigma=check_positive_number(sigma_noise, "sigma_noise"),
        ignore=check_int(ignore_index, "ignore_index"),
        chunk=check_chunk_size(chunk_size),
        memory_budget=check_memory_budget(memory_budget),
        generator=check_generator(generator),
        strict=check_bool(strict, "strict"),
        loss=check_bool(return_loss, "return_loss"),
        tune=parse_tune(tune),
    )
    run = _FisherRun(prep, opts)
    return _stream(run, data, check_bool(progress, "progress"), Reducer(process_group))


def _stream(run: _FisherRun, data: Iterable[Any], show: bool, reducer: Reducer) -> DiagFisherResult:
    """This rank's batches of ``data`` into ``run``; the result summed over the ranks."""
    for batch in with_progress(reducer.shard(data), show, "diag_fisher"):
        inputs, targets = pair(batch)
        run.add(run.prep.pack(inputs, finite=True), targets)
    return run.result(reducer)


@dataclass(frozen=True)
class _Options:
    likelihood: Likelihood
    kind: FisherKind
    method: FisherMethod
    mc_samples: int
    sigma: float
    ignore: int
    chunk: int | None
    memory_budget: int | None
    generator: torch.Generator | None
    strict: bool
    loss: bool = False
    tune: Tune = Tune.AUTO


@dataclass
class _LossSum:
    """``return_loss=True``: the negative log-likelihood of the data summed so far (``total``),
    added from the outputs of the batched passes as they run. ``samples`` counts the current
    batch's samples whose loss was added and ``before`` is the total before that batch: a batch
    not all of whose samples ran batched is summed again by one more forward pass."""

    opts: _Options
    total: float = 0.0
    before: float = 0.0
    samples: int = 0
    paused: bool = False  # the dropped timing runs add nothing

    def start(self) -> None:
        self.before, self.samples = self.total, 0

    def add(self, out: Tensor, y: Tensor) -> None:
        """A batched pass's loss: outputs ``out`` ``(n, ...)``, targets ``y``."""
        opts = self.opts
        if opts.loss and not self.paused:
            self.total += float(nll_sum(out.detach(), y, opts.likelihood, opts.sigma, opts.ignore))
            self.samples += out.shape[0]

    def finish(self, fn: PerSampleFunction, packed: PackedBatch, targets: list[Tensor]) -> None:
        """The batch's loss by one more forward pass where not all its samples ran batched."""
        if self.opts.loss and self.samples != len(packed):
            self.total = self.before + _batch_loss(fn, packed, targets, self.opts)


def _batch_loss(
    fn: PerSampleFunction, packed: PackedBatch, targets: list[Tensor], opts: _Options
) -> float:
    """The negative log-likelihood sum of a batch by one batched forward pass per shape bucket
    (in runs of ``chunk_size`` samples), without gradients."""
    loss = 0.0
    with torch.no_grad():
        for bucket in packed.buckets():
            step = opts.chunk or len(bucket.indices)
            for a in range(0, len(bucket.indices), step):
                idx = list(bucket.indices[a : a + step])
                out = fn.call_batch(packed.stack(idx))
                y = torch.stack([targets[i] for i in idx])
                loss += float(nll_sum(out, y, opts.likelihood, opts.sigma, opts.ignore))
    return loss


class _FisherTuning:
    """``method="auto"``'s choice between the layer-wise run (the default) and ``vmap`` that
    ``tune=True`` makes on the first batch and recalls after (a part of :class:`_FisherRun`)."""

    opts: _Options
    prep: Prepared
    plan: LayerwisePlan | None
    tuned: bool
    _trial: tuple[PackedBatch, list[int], PerSampleFunction, list[Tensor], LayerwisePlan]

    def _choosing(self) -> bool:
        o = self.opts
        auto = o.method is FisherMethod.AUTO and o.tune is not Tune.ESTIMATE
        return auto and self.plan is not None and not self.tuned

    def _recall(self, packed: PackedBatch) -> None:
        """On the first batch: the route ``tune=True`` chose for these shapes, if any."""
        if not self._choosing():
            return
        o = self.opts
        options = (o.likelihood, o.kind, o.chunk, o.memory_budget, o.mc_samples)
        self.key = (options, plan_key(self.prep.function(packed), packed, EngineOptions()))
        if (chosen := decided("diag_fisher", self.key)) is not None:
            self.tuned = True
            self._take(chosen[0], chosen[1], self.plan)
            self.notes.append(f"plan: {chosen[0]}, chosen by tune=True before for these shapes")

    def _take(self, name: str, chunk: int | None, plan: LayerwisePlan | None) -> None:
        layerwise = name.startswith(FisherMethod.LAYERWISE.value)
        self.plan = plan if layerwise else None
        self.lw_chunk = chunk if layerwise and not self.opts.chunk else None

    def _tune(self, fn: PerSampleFunction, packed: PackedBatch, targets: list[Tensor]) -> bool:
        """Under ``tune=True`` on the first batch: it runs layer-wise (counted), then layer-wise
        at :data:`_LAYERWISE_CHUNK` and :data:`_VMAP_CHUNK` (or the chunk asked for) and
        ``vmap`` on the largest bucket's first chunk, dropped. Whether it ran the batch."""
        if not self._choosing():
            return False
        self.tuned = True
        if self.opts.tune is not Tune.MEASURE:
            return False
        idx = max(packed.buckets(), key=lambda b: len(b.indices)).indices
        n, plan, (asked, vmap_chunk) = len(idx), self.plan, self.chunks
        sizes = [asked] if asked else [min(n, _LAYERWISE_CHUNK), min(n, _VMAP_CHUNK)]
        self.chunks = (sizes[0], vmap_chunk)
        self._add_terms(fn, packed, targets)  # the batch, counted; warms the first size
        if self.plan is None:  # layer-wise fell back: vmap
            return True
        self._trial = (packed, idx, fn, targets, plan)
        pairs = [(FisherMethod.LAYERWISE, c) for c in dict.fromkeys(sizes)]
        pairs.append((FisherMethod.VMAP, min(n, vmap_chunk)))
        routes = [Route(f"{m.value}/{c}", partial(self._dropped, m, c), c) for m, c in pairs]
        routes[0].warm_up = int  # the batch ran it
        chosen = tune("diag_fisher", self.key, routes, self.devices, self.notes, samples=n)
        if chosen is not None:
            self._take(chosen.name, chosen.chunk, plan)
        return True

    def _dropped(self, method: FisherMethod, chunk: int) -> float | None:
        """``method`` on the bucket's first ``chunk`` samples, the result dropped (the random
        state, the generator and the loss sum as before): the samples (``None``: failed)."""
        packed, idx, fn, targets, plan = self._trial
        idx, saved = idx[:chunk], (self.plan, self.chunks)
        sub, layerwise = packed.select(idx), method is FisherMethod.LAYERWISE
        self.plan, self.chunks = (plan, (chunk, chunk)) if layerwise else (None, (None, chunk))
        generator, self.loss.paused = self.opts.generator, True
        state = None if generator is None else generator.get_state()
        try:
            with torch.random.fork_rng(devices=self.devices):
                sub_fn = self.prep.function(sub, output_fn=fn.output_fn)
                self._terms(sub_fn, sub, [targets[i] for i in idx])
        except NotLayerwiseError:  # not a candidate after all
            return None
        finally:
            self.loss.paused = False
            if generator is not None:
                generator.set_state(state)
            self.plan, self.chunks = saved
        return len(idx)


class _FisherRun(_FisherTuning):
    """The state across batches: the layer-wise plan, chunk sizes, sums, notes, fallbacks."""

    def __init__(self, prep: Prepared, opts: _Options) -> None:
        self.prep, self.opts, self.subset = prep, opts, prep.subset
        self.plan = _initial_plan(prep, opts)
        self.notes: list[str] = []
        if isinstance(self.plan, str):
            self.notes += [self.plan] if self.plan else []
            self.plan = None
        else:
            self.notes += [f"{n}: {why} -> vmap" for n, why in self.plan.reasons.items()]
        self.fallbacks: list[str] = []
        self.exact_dense = False  # exact GGN of dense logits: no layer-wise factorisation
        self.separable_checked = False
        self.temp_bytes = DEFAULT_TEMP_BYTES
        self.chunks: tuple[int | None, int] = (opts.chunk, opts.chunk or _VMAP_CHUNK)
        self.shapes: dict[Any, torch.Size] = {}  # output shape per shape signature
        self.totals: dict[str, Tensor] = {}
        self.count = 0
        self.tuned = False
        self.key: Any = None  # the plan-cache key of the first batch (method="auto")
        self.lw_chunk: int | None = None  # the layer-wise chunk ``auto`` chose
        self.devices = [prep.device] if prep.device.type == "cuda" else []
        self.loss = _LossSum(opts)
        self.num_outputs = 0

    # ------------------------------------------------------------------ per batch
    def add(self, packed: PackedBatch, targets: Any) -> None:
        device = self.prep.device
        per_sample = [t.to(device) for t in split_targets(targets, len(packed))]
        self.loss.start()
        fn = self.prep.function(packed, output_fn=Capture(self.prep.output_fn, "diag_fisher"))
        self._recall(packed)
        per_sample = self._check_targets(fn, packed, per_sample)
        self.num_outputs += sum(self.shapes[s].numel() for s in packed.signatures)
        self.chunks = self._chunk_sizes(fn, packed)
        if self.lw_chunk:
            self.chunks = (self.lw_chunk, self.chunks[1])
        if not self._tune(fn, packed, per_sample):
            self._add_terms(fn, packed, per_sample)
        self.loss.finish(fn, packed, per_sample)

    def _add_terms(
        self, fn: PerSampleFunction, packed: PackedBatch, per_sample: list[Tensor]
    ) -> None:
        generator = self.opts.generator
        state = None if generator is None else generator.get_state()
        try:
            part = self._terms(fn, packed, per_sample)
        except NotLayerwiseError as err:
            if generator is not None:  # the fallback draws the labels the batch drew
                generator.set_state(state)
            if self.opts.strict or self.opts.method is FisherMethod.LAYERWISE:
                raise ValueError(f"diag_fisher(method={self.opts.method.value!r}): {err}") from err
            msg = f"layer-wise closed forms failed ({err}); ran vmap"
            self.fallbacks.append(msg)
            self.notes.append(msg)
            self.plan = None
            part = self._terms(fn, packed, per_sample)
        for name, t in part.items():
            self.totals[name] = t if name not in self.totals else self.totals[name] + t
        self.count += len(packed)

    def _check_targets(
        self, fn: PerSampleFunction, packed: PackedBatch, targets: list[Tensor]
    ) -> list[Tensor]:
        """Every target checked against its sample's output shape (one forward of one sample
        per new shape signature); returns them reshaped like the outputs' positions."""
        values = fn.values()
        out: list[Tensor] = list(targets)
        classes = self.opts.likelihood is Likelihood.CLASSIFICATION
        for bucket in packed.buckets():
            i = bucket.indices[0]
            if bucket.signature not in self.shapes:
                with torch.no_grad():
                    self.shapes[bucket.signature] = raw_output(
                        fn, values, tuple(packed.sample(i))
                    ).shape[1:]
            shape = self.shapes[bucket.signature]
            flats = check_targets(
                [targets[j] for j in bucket.indices],
                shape,
                self.opts.likelihood,
                self.opts.ignore,
                [self.count + j for j in bucket.indices],
            )
            for j, flat in zip(bucket.indices, flats):
                out[j] = flat.view(shape[1:]) if classes else targets[j]
        return out

    def _chunk_sizes(self, fn: PerSampleFunction, packed: PackedBatch) -> tuple[int | None, int]:
        """Samples per layer-wise run and per vectorised call, from ``chunk_size`` or
        ``memory_budget`` (checked against one sample's measured working set)."""
        opts = self.opts
        if opts.memory_budget is None:  # on CPU, a chunk's gradients of one tensor < 32 MiB
            itemsize = fn.params[fn.subset.names[0]].element_size()
            largest = max(hi - lo for lo, hi in fn.subset.offsets.values())
            cap = cpu_chunk_cap(fn.device, largest, itemsize) or _VMAP_CHUNK
            return opts.chunk, opts.chunk or min(_VMAP_CHUNK, cap)
        values = fn.values()
        itemsize = values[0].element_size()
        numel = self.subset.numel
        kept = fisher_kept(numel, itemsize)
        fp = measure(fn, values, tuple(packed.sample(packed.largest_sample)), count=False)
        one = fisher_sample(fp.activations, numel, itemsize)
        fit = fit_budget(
            opts.memory_budget,
            kept,
            one,
            f"the sums over P={self.subset.numel} entries take {kept} bytes and one sample's "
            f"forward and backward about {one} with its temporaries",
            temp=True,
        )
        self.temp_bytes = fit.temp
        layerwise, vmapped = fisher_chunks(fit.left, fp.activations, numel, itemsize)
        return opts.chunk or layerwise, opts.chunk or vmapped

    def _terms(
        self, fn: PerSampleFunction, packed: PackedBatch, targets: list[Tensor]
    ) -> dict[str, Tensor]:
        """Sums over the batch's samples, per selected tensor (selected shape)."""
        lw = self._layerwise_names()
        if self.opts.kind is FisherKind.EXACT:
            part = self._exact_layerwise(fn, packed, targets) if lw else None
            if part is None:
                return fn.subset.split(self._exact(fn, packed, targets))
            rest = tuple(n for n in fn.subset.names if n not in lw)
            if rest:
                sub = self._restrict(fn, packed, rest)
                part.update(sub.subset.split(self._exact(sub, packed, targets)))
            return part
        return self._gradient_terms(fn, packed, targets, lw)

    def _layerwise_names(self) -> tuple[str, ...]:
        if self.plan is None or (self.opts.kind is FisherKind.EXACT and self.exact_dense):
            return ()
        return self.plan.layerwise_names

    def _restrict(
        self, fn: PerSampleFunction, packed: PackedBatch, names: tuple[str, ...]
    ) -> PerSampleFunction:
        """The same function over the selected entries of ``names`` only."""
        subset = ParamSubset(fn.subset.layout, {n: fn.subset.indices[n] for n in names})
        return self.prep.function(packed, output_fn=fn.output_fn, subset=subset)

    # ------------------------------------------------------------------ empirical / mc
    def _gradient_terms(
        self,
        fn: PerSampleFunction,
        packed: PackedBatch,
        targets: list[Tensor],
        lw: tuple[str, ...],
    ) -> dict[str, Tensor]:
        """Sums of squared per-sample gradients; the tensors in ``lw`` by their layer-wise
        closed forms, the rest by ``vmap(grad)``, with the same label noise."""
        rest = tuple(n for n in fn.subset.names if n not in lw)
        sub = self._restrict(fn, packed, rest) if rest and lw else fn
        totals: dict[str, Tensor] = {}
        layerwise_chunk, vmap_chunk = self.chunks
        for b in packed.buckets():
            step = (layerwise_chunk or len(b.indices)) if lw else vmap_chunk
            for s in range(0, len(b.indices), step):
                idx = b.indices[s : s + step]
                levels = packed.stack(idx)
                y = torch.stack([targets[i] for i in idx])
                out_shape = (len(idx), *self.shapes[b.signature])
                noise = self._noise(out_shape)
                if lw:
                    _add(totals, self._layerwise_chunk(fn, levels, y, noise))
                if rest:
                    _add(totals, self._vmap_chunk(sub, levels, y, noise, vmap_chunk))
        return totals

    def _noise(self, out_shape: tuple[int, ...]) -> list[Tensor | None]:
        if self.opts.kind is FisherKind.EMPIRICAL:
            return [None]
        return list(
            draw_noise(
                torch.Size(out_shape),
                self.opts.likelihood,
                self.opts.mc_samples,
                self.opts.generator,
            )
        )

    def _labels(self, out: Tensor, y: Tensor, noise: Tensor | None) -> Tensor:
        if noise is None:
            return y
        return labels_from_noise(
            out, noise, y, self.opts.likelihood, self.opts.sigma, self.opts.ignore
        )

    def _vmap_chunk(
        self,
        fn: PerSampleFunction,
        levels: list[Tensor],
        y: Tensor,
        noise: list[Tensor | None],
        step: int,
    ) -> dict[str, Tensor]:
        """``sum_i g_i^2`` per selected tensor by ``vmap(grad)`` in calls of ``step`` samples."""
        opts = self.opts

        def loss(vals: tuple[Tensor, ...], yi: Tensor, ui: Any, *lv: Tensor) -> Tensor:
            out = raw_output(fn, vals, lv)
            target = self._labels(out, yi.unsqueeze(0), None if ui is None else ui.unsqueeze(0))
            return nll_sum(out, target, opts.likelihood, opts.sigma, opts.ignore)

        values = fn.values()
        total: dict[str, Tensor] = {}
        for u in noise:
            in_dims = (None, 0, None if u is None else 0) + (0,) * len(levels)
            per_grad = vmap(grad(loss), in_dims=in_dims, randomness=self.prep.randomness.value)
            for r in range(0, y.shape[0], step):
                lv = [t[r : r + step] for t in levels]
                ur = None if u is None else u[r : r + step]
                g = per_grad(values, y[r : r + step], ur, *lv)  # per tensor (n, *selected)
                _add(total, {n: (t**2).sum(0) / len(noise) for n, t in zip(fn.subset.names, g)})
        return total

    def _layerwise_chunk(
        self, fn: PerSampleFunction, levels: list[Tensor], y: Tensor, noise: list[Tensor | None]
    ) -> dict[str, Tensor]:
        """One batched run of a chunk: the layer-wise sums (selected entries)."""
        lv, out, run = self._batched_run(fn, levels)
        self.loss.add(out, y)
        objectives = [
            (
                nll_sum(
                    out,
                    self._labels(out, y, u),
                    self.opts.likelihood,
                    self.opts.sigma,
                    self.opts.ignore,
                ),
                1.0 / len(noise),
            )
            for u in noise
        ]
        return _selected(fn.subset, run.backward(objectives, lv))

    def _batched_run(
        self, fn: PerSampleFunction, levels: list[Tensor]
    ) -> tuple[list[Tensor], Tensor, LayerwiseRun]:
        if self.plan is None:  # not reachable: callers check the layer-wise names first
            raise NotLayerwiseError("no layer-wise plan")
        lv, out, run = batched_run(
            fn,
            levels,
            self.plan,
            temp_bytes=self.temp_bytes,
            check=not self.separable_checked,
            random=self.prep.randomness is not Randomness.ERROR,
            tune=self.opts.tune,
        )
        self.separable_checked = True
        return lv, out, run

    # ------------------------------------------------------------------ exact
    def _exact_layerwise(
        self, fn: PerSampleFunction, packed: PackedBatch, targets: list[Tensor]
    ) -> dict | None:
        """``sum_i diag(J_i^T Lambda_i J_i)`` of the layer-wise tensors, ``Lambda = S S^T``: one
        backward pass per column of ``S`` (per class, or per regression output); ``None`` for
        dense logits (their per-position blocks do not factor over a batched pass; recorded)."""
        totals: dict[str, Tensor] = {}
        layerwise_chunk = self.chunks[0]
        for b in packed.buckets():
            step = layerwise_chunk or len(b.indices)
            for s in range(0, len(b.indices), step):
                idx = b.indices[s : s + step]
                lv, out, run = self._batched_run(fn, packed.stack(idx))
                if self.opts.likelihood is Likelihood.CLASSIFICATION and out.dim() != 2:
                    self.exact_dense = True
                    self.notes.append(
                        "exact GGN of dense logits: per-position blocks, by per-sample Jacobians"
                    )
                    return None
                self.loss.add(out, torch.stack([targets[i] for i in idx]))
                _add(totals, _selected(fn.subset, run.backward(self._root_objectives(out), lv)))
        return totals

    def _root_objectives(self, out: Tensor) -> list[tuple[Tensor, float]]:
        """Scalars whose gradients are the columns of ``J^T S`` (``Lambda = S S^T``)."""
        n = out.shape[0]
        if self.opts.likelihood is Likelihood.REGRESSION:
            flat = out.reshape(n, -1)
            return [(flat[:, o].sum() / self.opts.sigma, 1.0) for o in range(flat.shape[1])]
        p = torch.softmax(out.detach(), dim=1)  # (n, C)
        root = p.sqrt()
        eye = torch.eye(p.shape[1], dtype=p.dtype, device=p.device)
        return [((out * (root[:, c : c + 1] * (eye[c] - p))).sum(), 1.0) for c in range(p.shape[1])]

    def _exact(self, fn: PerSampleFunction, packed: PackedBatch, targets: list[Tensor]) -> Tensor:
        """``sum_i diag(J_i^T Lambda_i J_i)`` ``(P,)`` for one batch, from the engine's per-sample
        Jacobians and outputs (one pass) in chunks of samples."""
        opts = self.opts
        total = fn.values()[0].new_zeros(fn.subset.numel)
        n = len(packed)
        step = min(opts.chunk or 8, 8)
        engine_options = EngineOptions(
            chunk_size=opts.chunk,
            memory_budget=opts.memory_budget,
            randomness=self.prep.randomness,
            strict=opts.strict,
        )
        for s in range(0, n, step):
            idx = list(range(s, min(n, s + step)))
            res = run_engine(fn, packed.select(idx), engine_options)
            self.fallbacks.append(res.fallback or "")
            for k, i in enumerate(idx):
                rows = res.output_sizes[k]
                jac, out = res.jacobian[k, :rows], res.outputs[k, :rows]
                if opts.likelihood is Likelihood.REGRESSION:
                    total += (jac**2).sum(0) / opts.sigma**2
                    continue
                shape = self.shapes[packed.signatures[i]]
                valid = targets[i].reshape(-1) != opts.ignore
                root, mixed = ggn_factors(out.view(shape[0], -1), jac, opts.likelihood, valid)
                total += (root**2).sum(0) - (mixed**2).sum(0)  # type: ignore[operator]
        return total

    # ------------------------------------------------------------------ result
    def result(self, reducer: Reducer) -> DiagFisherResult:
        like = self.subset.values(self.prep.model)[self.subset.names[0]]
        grouped = [
            self.totals[n].reshape(-1)
            if n in self.totals
            else like.new_zeros(self.subset.selected_shape(n).numel())
            for n in self.subset.names
        ]
        flat = self.subset.to_flat_order(torch.cat(grouped))
        reducer.sum_([flat])
        count, loss, outputs = reducer.sum_numbers(
            [float(self.count), self.loss.total, float(self.num_outputs)], flat
        )
        if count == 0:
            raise ValueError("data yielded no samples")
        warn_fallback(self.fallbacks)
        plan = self._final_plan()
        counts = collections.Counter(plan.values())
        method = "per tensor: " + ", ".join(f"{r} x{k}" for r, k in sorted(counts.items()))
        return DiagFisherResult(
            flat / count,
            self.subset,
            int(count),
            self.opts.kind,
            self.opts.likelihood,
            method,
            plan,
            tuple(self.notes),
            loss if self.opts.loss else None,
            int(outputs),
            output_dim(next(iter(self.shapes.values()), ())),
        )

    def _final_plan(self) -> dict[str, str]:
        exact = self.opts.kind is FisherKind.EXACT
        rules = (
            self.plan.rules if self.plan is not None and not (exact and self.exact_dense) else {}
        )
        other = "jacobian" if exact else LayerRule.VMAP.value
        return {
            n: rules.get(n, other).replace(LayerRule.VMAP.value, other) for n in self.subset.names
        }


def _initial_plan(prep: Prepared, opts: _Options) -> LayerwisePlan | str:
    """The layer-wise plan, or why there is none (a note; ``""`` when ``vmap`` was asked for)."""
    if opts.method is FisherMethod.VMAP:
        return ""
    try:
        if prep.randomness is Randomness.SAME:
            raise NotLayerwiseError(
                "randomness='same' draws one mask per vectorised call, a batched run one per sample"
            )
        plan = plan_layers(prep.model, prep.subset, eval_batch_norm=prep.eval_batch_norm)
        if opts.method is FisherMethod.LAYERWISE:
            plan.require_all()
    except NotLayerwiseError as err:
        if opts.method is FisherMethod.LAYERWISE:
            raise ValueError(f"diag_fisher(method='layerwise'): {err}") from err
        return f"no layer-wise closed forms: {err}"
    return plan


def _selected(subset: ParamSubset, sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """The selected entries of full-shaped per-tensor sums."""
    out = {}
    for name, full in sums.items():
        idx = subset.indices[name]
        out[name] = full if idx is None else full.reshape(-1).index_select(0, idx.to(full.device))
    return out


def _add(totals: dict[str, Tensor], part: dict[str, Tensor]) -> None:
    for name, t in part.items():
        totals[name] = t if name not in totals else totals[name] + t
