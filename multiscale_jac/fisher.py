"""Diagonal Fisher / GGN of a subset of parameters, streamed over data (EWC, Laplace).

Shapes (stated once): a batch of ``N`` samples; ``P`` selected entries (subset flat order); a
sample's output after ``output_fn`` keeps the batch dim of one: classification logits ``(1, C)``
or dense logits ``(1, C, *spatial)`` (one categorical per position), regression outputs of any
shape. Targets per sample: a class index ``()`` or a label map ``(*spatial)`` (positions equal to
``ignore_index`` are left out), or a regression target shaped like the output.

* ``kind="empirical"``: ``F = 1/N sum_i g_i^2`` with ``g_i = grad log p(y_i | x_i)``: the mean
  of squares, not the square of the mean gradient.
* ``kind="mc"``: the same with ``y`` drawn from the model's predictive (``mc_samples`` draws per
  input, averaged), seeded by ``generator``.
* ``kind="exact"``: ``F = 1/N sum_i diag(J_i^T Lambda_i J_i)`` with ``Lambda`` the Hessian of the
  negative log-likelihood w.r.t. the outputs (``diag(p) - p p^T`` per position; ``1/sigma^2``).

Memory: per-sample gradients (``empirical``, ``mc``) are formed ``chunk`` samples at a time and
squared into a ``(P,)`` accumulator; ``exact`` takes per-sample Jacobians of a chunk from the
engine and reduces them at once. Nothing of size ``N x P`` is held.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from ._checks import (
    check_bool,
    check_chunk_size,
    check_generator,
    check_memory_budget,
    check_model,
    check_output_fn,
    check_positive_int,
    check_train_mode_layers,
)
from ._distributed import Reducer
from .adapter import PerSampleFunction
from .engine import per_sample_jacobian
from .enums import (
    BatchNormPolicy,
    FallbackWarning,
    FisherKind,
    FisherMethod,
    InputKind,
    Likelihood,
    Randomness,
    parse_enum,
)
from .layerwise import (
    DEFAULT_TEMP_BYTES,
    LayerRule,
    LayerwisePlan,
    LayerwiseRun,
    NotLayerwiseError,
    batched_run,
    plan_layers,
)
from .packing import PackedBatch, pack
from .subset import ParamSubset, resolve_subset

__all__ = ["DiagFisherResult", "diag_fisher"]


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
            from :class:`~multiscale_jac.layerwise.LayerRule`, ``vmap`` or ``jacobian``).
        notes: Why tensors took ``vmap`` and any fallback.
    """

    flat: Tensor
    subset: ParamSubset
    num_samples: int
    kind: FisherKind
    likelihood: Likelihood
    method: str = ""
    plan: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = field(default=())

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
    output_fn: Callable[[Any], Any] | None = None,
    sigma_noise: float = 1.0,
    ignore_index: int = -100,
    method: str | FisherMethod = "auto",
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    progress: bool = True,
    generator: torch.Generator | None = None,
    batch_norm: str | BatchNormPolicy = "error",
    strict: bool = False,
    process_group: Any = None,
) -> DiagFisherResult:
    """Diagonal Fisher / GGN of the selected parameters, averaged over ``data``.

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
        method: ``auto``, ``layerwise`` or ``vmap`` (see :class:`FisherMethod`).
        chunk_size: Samples per batched run (``layerwise``; default: a whole shape bucket, as a
            training step would run it) or per vectorised call (``vmap``; default 32).
        memory_budget: Bytes for per-layer temporaries (``layerwise``; default 8 MiB) and for
            the engine's per-sample Jacobians (``exact`` by ``vmap``).
        progress: A tqdm bar over the batches when a terminal is attached (never in logs).
        generator: Seeds the labels drawn for ``kind="mc"``.
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.
        strict: Raise instead of falling back from ``layerwise`` to ``vmap`` at run time.
        process_group: With ``torch.distributed`` initialised, every rank processes its shard
            of ``data`` (a ``DistributedSampler``'s, or every ``world_size``-th batch) and the
            sums are all-reduced once at the end, so every rank gets the result over all of
            the data; ``None`` uses the default group (see :mod:`~multiscale_jac._distributed`).

    Returns:
        A :class:`DiagFisherResult`.

    Raises:
        TypeError, ValueError: bad arguments or data (the message names the value).
    """
    model = check_model(model)
    output_fn = check_output_fn(output_fn)
    likelihood = parse_enum(Likelihood, likelihood, "likelihood")
    kind = parse_enum(FisherKind, kind, "kind")
    method = parse_enum(FisherMethod, method, "method")
    batch_norm_policy = parse_enum(BatchNormPolicy, batch_norm, "batch_norm")
    progress = check_bool(progress, "progress")
    strict = check_bool(strict, "strict")
    mc_samples = check_positive_int(mc_samples, "mc_samples")
    if isinstance(sigma_noise, bool) or not isinstance(sigma_noise, (int, float)):
        raise TypeError(f"sigma_noise must be a positive number; got {sigma_noise!r}")
    if not sigma_noise > 0:
        raise ValueError(f"sigma_noise must be a positive number; got {sigma_noise!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int; got {ignore_index!r}")
    chunk_size = check_chunk_size(chunk_size)
    memory_budget = check_memory_budget(memory_budget)
    generator = check_generator(generator)
    subset = resolve_subset(params, model)
    eval_bn = check_train_mode_layers(model, batch_norm_policy, Randomness.ERROR)
    opts = _Options(
        likelihood,
        kind,
        mc_samples,
        float(sigma_noise),
        ignore_index,
        chunk_size,
        memory_budget,
        generator,
        batch_norm_policy,
    )
    state = _State(subset, _initial_plan(model, subset, method, eval_bn))
    state.temp_bytes = memory_budget or DEFAULT_TEMP_BYTES
    reducer = Reducer(process_group)
    total: dict[str, Tensor] = {}
    count = 0
    for batch in _progress(reducer.shard(data), progress):
        inputs, targets = _pair(batch)
        packed = inputs if isinstance(inputs, PackedBatch) else pack(inputs)
        per_sample = _split_targets(targets, packed.num_samples)
        fn = PerSampleFunction(
            model, subset, packed.kind, _Capture(output_fn), eval_batch_norm=eval_bn
        )
        packed = packed.to(fn.device)
        per_sample = [t.to(fn.device) for t in per_sample]
        try:
            part = _batch_terms(fn, packed, per_sample, opts, state)
        except NotLayerwiseError as err:
            if strict or method is FisherMethod.LAYERWISE:
                raise ValueError(f"diag_fisher(method={method.value!r}): {err}") from err
            msg = f"layer-wise closed forms failed ({err}); falling back to vmap"
            warnings.warn(msg, FallbackWarning, stacklevel=2)
            state.fall_back(msg)
            part = _batch_terms(fn, packed, per_sample, opts, state)
        for name, t in part.items():
            total[name] = t if name not in total else total[name] + t
        count += packed.num_samples
    like = subset.values(model)[subset.names[0]]
    flat = torch.cat(
        [
            total[n].reshape(-1) if n in total else like.new_zeros(subset.selected_shape(n).numel())
            for n in subset.names
        ]
    )
    reducer.sum_([flat])
    (count_f,) = reducer.sum_numbers([float(count)], flat)
    count = int(count_f)
    if count == 0:
        raise ValueError("data yielded no samples")
    flat = flat / count
    return DiagFisherResult(
        flat,
        subset,
        count,
        kind,
        likelihood,
        state.describe(kind),
        state.final_plan(kind),
        state.notes,
    )


@dataclass(frozen=True)
class _Options:
    likelihood: Likelihood
    kind: FisherKind
    mc_samples: int
    sigma: float
    ignore: int
    chunk: int | None
    memory_budget: int | None
    generator: torch.Generator | None
    batch_norm: BatchNormPolicy


class _State:
    """The plan across batches: which tensors go layer-wise, fallbacks, notes."""

    def __init__(self, subset: ParamSubset, plan: LayerwisePlan | str) -> None:
        self.subset = subset
        self.notes: tuple[str, ...] = ()
        self.exact_dense = False  # exact GGN of dense logits: no layer-wise factorisation
        self.separable_checked = False
        self.temp_bytes = DEFAULT_TEMP_BYTES
        if isinstance(plan, str):
            self.plan = None
            if plan:
                self.notes += (plan,)
        else:
            self.plan = plan
            self.notes += tuple(f"{n}: {why} -> vmap" for n, why in plan.reasons.items())

    def layerwise_names(self, kind: FisherKind) -> tuple[str, ...]:
        if self.plan is None or (kind is FisherKind.EXACT and self.exact_dense):
            return ()
        return self.plan.layerwise_names

    def fall_back(self, msg: str) -> None:
        self.plan = None
        self.notes += (msg,)

    def final_plan(self, kind: FisherKind) -> dict[str, str]:
        lw = self.plan.rules if self.plan is not None else {}
        if kind is FisherKind.EXACT and self.exact_dense:
            lw = {}
        other = "jacobian" if kind is FisherKind.EXACT else LayerRule.VMAP.value
        return {n: lw.get(n, other).replace(LayerRule.VMAP.value, other) for n in self.subset.names}

    def describe(self, kind: FisherKind) -> str:
        counts: dict[str, int] = {}
        for rule in self.final_plan(kind).values():
            counts[rule] = counts.get(rule, 0) + 1
        return "per tensor: " + ", ".join(f"{r} x{k}" for r, k in sorted(counts.items()))


def _initial_plan(
    model: nn.Module, subset: ParamSubset, method: FisherMethod, eval_bn: bool
) -> LayerwisePlan | str:
    if method is FisherMethod.VMAP:
        return ""
    try:
        plan = plan_layers(model, subset, eval_batch_norm=eval_bn)
    except NotLayerwiseError as err:
        if method is FisherMethod.LAYERWISE:
            raise ValueError(f"diag_fisher(method='layerwise'): {err}") from err
        return f"no layer-wise closed forms: {err}"
    if method is FisherMethod.LAYERWISE:
        try:
            plan.require_all()
        except NotLayerwiseError as err:
            raise ValueError(f"diag_fisher(method='layerwise'): {err}") from err
    return plan


# ---------------------------------------------------------------------- helpers
def _progress(data: Iterable, enabled: bool) -> Iterable:
    if not enabled or not sys.stderr.isatty():
        return data
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return data
    return tqdm(data, desc="diag_fisher", leave=False)


def _pair(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of one batch of a data iterable."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(
            f"data must yield (inputs, targets) pairs; got a {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        )
    return batch[0], batch[1]


def _split_targets(targets: Any, n: int) -> list[Tensor]:
    if isinstance(targets, Tensor):
        if targets.dim() == 0 or targets.shape[0] != n:
            raise ValueError(
                f"targets must have a leading batch dim of {n} (the number of samples); got "
                f"shape {tuple(targets.shape)}"
            )
        return list(targets.unbind(0))
    if isinstance(targets, (list, tuple)) and all(isinstance(t, Tensor) for t in targets):
        if len(targets) != n:
            raise ValueError(f"got {len(targets)} targets for {n} samples")
        return list(targets)
    raise TypeError(
        f"targets must be a tensor or a list of per-sample tensors; got {type(targets).__name__}"
    )


def _nll_sum(
    out: Tensor, target: Tensor, likelihood: Likelihood, sigma: float, ignore: int
) -> Tensor:
    """Negative log-likelihood summed over samples: ``out`` ``(n, ...)``, ``target`` ``(n, ...)``
    (class indices ``(n,)`` or label maps ``(n, *spatial)``; regression: like ``out``)."""
    n = out.shape[0]
    if likelihood is Likelihood.REGRESSION:
        if target.numel() != out.numel():
            raise ValueError(
                f"regression target has {target.numel() // max(1, n)} entries per sample, the "
                f"output {out.numel() // max(1, n)}"
            )
        diff = out.reshape(n, -1) - target.reshape(n, -1).to(out.dtype)
        return 0.5 * (diff**2).sum() / sigma**2
    logits = out.reshape(n, out.shape[1], -1)  # (n, C, positions)
    y = target.reshape(n, -1).long()
    if y.shape[1] != logits.shape[2]:
        raise ValueError(
            f"classification targets have {y.shape[1]} positions per sample, the logits "
            f"{logits.shape[2]} (output shape {tuple(out.shape[1:])})"
        )
    valid = y != ignore
    logp = torch.log_softmax(logits, dim=1)
    picked = logp.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
    return -(picked * valid.to(picked.dtype)).sum()


class _Capture:
    """An ``output_fn`` that applies the user's and keeps the (unflattened) result."""

    def __init__(self, user: Callable[[Any], Any] | None) -> None:
        self.user = user
        self.last: Tensor | None = None

    def __call__(self, out: Any) -> Any:
        out = self.user(out) if self.user is not None else out
        if not isinstance(out, Tensor):
            raise TypeError(
                f"diag_fisher needs the model (after output_fn) to return one tensor; got "
                f"{type(out).__name__}"
            )
        self.last = out
        return out


def _raw_output(
    fn: PerSampleFunction, values: tuple[Tensor, ...], levels: tuple[Tensor, ...]
) -> Tensor:
    """The sample's output after ``output_fn``, batch dim of one kept (not flattened);
    ``fn.output_fn`` must be a :class:`_Capture`."""
    fn.call(fn.full_params(values), levels)
    return fn.output_fn.last  # type: ignore[union-attr]


def _batch_terms(
    fn: PerSampleFunction,
    packed: PackedBatch,
    targets: list[Tensor],
    opts: _Options,
    state: _State,
) -> dict[str, Tensor]:
    """Sums over the batch's samples, per selected tensor (selected shape)."""
    lw = state.layerwise_names(opts.kind)
    if opts.kind is FisherKind.EXACT and lw:
        part = _exact_layerwise(fn, packed, opts, state)
        if part is not None:
            rest = tuple(n for n in fn.subset.names if n not in lw)
            if rest:
                sub = _restrict(fn, rest)
                part.update(sub.subset.split(_exact(sub, packed, targets, opts)))
            return part
        lw = ()
    if opts.kind is FisherKind.EXACT:
        return fn.subset.split(_exact(fn, packed, targets, opts))
    return _gradient_terms(fn, packed, targets, opts, state, lw)


def _restrict(fn: PerSampleFunction, names: tuple[str, ...]) -> PerSampleFunction:
    """The same function over the selected entries of ``names`` only."""
    subset = ParamSubset(fn.subset.layout, {n: fn.subset.indices[n] for n in names})
    return PerSampleFunction(
        fn.model, subset, fn.kind, fn.output_fn, eval_batch_norm=fn.eval_batch_norm
    )


def _selected(subset: ParamSubset, sums: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for name, full in sums.items():
        idx = subset.indices[name]
        out[name] = full if idx is None else full.reshape(-1).index_select(0, idx.to(full.device))
    return out


def _gradient_terms(
    fn: PerSampleFunction,
    packed: PackedBatch,
    targets: list[Tensor],
    opts: _Options,
    state: _State,
    lw: tuple[str, ...],
) -> dict[str, Tensor]:
    """``empirical`` / ``mc``: sums of squared per-sample gradients; the tensors in ``lw`` by
    their layer-wise closed forms, the rest by ``vmap(grad)``, with the same drawn labels."""
    rest = tuple(n for n in fn.subset.names if n not in lw)
    sub = _restrict(fn, rest) if rest and lw else fn
    values = sub.values()

    def loss(vals: tuple[Tensor, ...], target: Tensor, *levels: Tensor) -> Tensor:
        out = _raw_output(sub, vals, levels)
        return _nll_sum(out, target.unsqueeze(0), opts.likelihood, opts.sigma, opts.ignore)

    def logits(vals: tuple[Tensor, ...], *levels: Tensor) -> Tensor:
        return _raw_output(sub, vals, levels)[0]

    per_grad = vmap(grad(loss), in_dims=(None, 0) + (0,) * len(packed.levels))
    vmap_chunk = opts.chunk or 32
    totals: dict[str, Tensor] = {}
    flat_total = values[0].new_zeros(sub.subset.numel) if rest else None
    for b in packed.buckets():
        step = opts.chunk or (len(b.indices) if lw else 32)
        for s in range(0, len(b.indices), step):
            idx = b.indices[s : s + step]
            levels = packed.stack(idx)
            y = torch.stack([targets[i] for i in idx])
            if lw:
                draws, sums = _layerwise_chunk(fn, levels, y, opts, state)
                for name, t in _selected(fn.subset, sums).items():
                    totals[name] = t if name not in totals else totals[name] + t
            elif opts.kind is FisherKind.EMPIRICAL:
                draws = [y]
            else:
                out = vmap(logits, in_dims=(None,) + (0,) * len(levels))(values, *levels)
                draws = _draw(out, y, opts)
            if flat_total is None:
                continue
            for r in range(0, len(idx), vmap_chunk):
                lv = [t[r : r + vmap_chunk] for t in levels]
                for yd in draws:
                    g = per_grad(values, yd[r : r + vmap_chunk], *lv)  # per tensor (n, *sel)
                    sq = torch.cat([t.reshape(t.shape[0], -1) for t in g], dim=1) ** 2
                    flat_total += sq.sum(0) / len(draws)
    if flat_total is not None:
        totals.update(sub.subset.split(flat_total))
    return totals


def _layerwise_chunk(
    fn: PerSampleFunction,
    levels: list[Tensor],
    y: Tensor,
    opts: _Options,
    state: _State,
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One batched run of a chunk: the labels used and the layer-wise sums (full shapes)."""
    lv, out, run = _batched_run(fn, levels, state)
    draws = [y] if opts.kind is FisherKind.EMPIRICAL else _draw(out.detach(), y, opts)
    objectives = [
        (_nll_sum(out, yd, opts.likelihood, opts.sigma, opts.ignore), 1.0 / len(draws))
        for yd in draws
    ]
    return draws, run.backward(objectives, lv)


def _batched_run(
    fn: PerSampleFunction, levels: list[Tensor], state: _State
) -> tuple[list[Tensor], Tensor, LayerwiseRun]:
    plan = state.plan
    if plan is None:  # not reachable: callers check layerwise_names first
        raise NotLayerwiseError("no layer-wise plan")
    lv, out, run = batched_run(
        fn, levels, plan, temp_bytes=state.temp_bytes, check=not state.separable_checked
    )
    state.separable_checked = True
    return lv, out, run


def _exact_layerwise(
    fn: PerSampleFunction, packed: PackedBatch, opts: _Options, state: _State
) -> dict[str, Tensor] | None:
    """``sum_i diag(J_i^T Lambda_i J_i)`` of the layer-wise tensors, ``Lambda = S S^T``: one
    backward pass per column of ``S`` (per class, or per regression output); ``None`` for dense
    logits (their per-position blocks do not factor over a batched pass; recorded)."""
    totals: dict[str, Tensor] = {}
    for b in packed.buckets():
        step = opts.chunk or len(b.indices)
        for s in range(0, len(b.indices), step):
            idx = b.indices[s : s + step]
            lv, out, run = _batched_run(fn, packed.stack(idx), state)
            n = out.shape[0]
            if opts.likelihood is Likelihood.REGRESSION:
                flat = out.reshape(n, -1)
                objectives = [(flat[:, o].sum() / opts.sigma, 1.0) for o in range(flat.shape[1])]
            elif out.dim() != 2:
                state.exact_dense = True
                state.notes += (
                    "exact GGN of dense logits: per-position blocks, by per-sample Jacobians",
                )
                return None
            else:
                p = torch.softmax(out.detach(), dim=1)  # (n, C)
                root = p.sqrt()
                eye = torch.eye(p.shape[1], dtype=p.dtype, device=p.device)
                objectives = [
                    ((out * (root[:, c : c + 1] * (eye[c] - p))).sum(), 1.0)
                    for c in range(p.shape[1])
                ]
            for name, t in _selected(fn.subset, run.backward(objectives, lv)).items():
                totals[name] = t if name not in totals else totals[name] + t
    return totals


def _draw(out: Tensor, y: Tensor, opts: _Options) -> list[Tensor]:
    """``mc_samples`` label draws from the predictive for a chunk ``out`` ``(n, ...)``;
    ignored positions stay ignored."""
    draws = []
    generator = opts.generator
    with torch.no_grad():
        for _ in range(opts.mc_samples):
            if opts.likelihood is Likelihood.REGRESSION:
                noise = torch.randn(out.shape, generator=generator, dtype=out.dtype, device="cpu")
                draws.append((out + opts.sigma * noise.to(out.device)).reshape(y.shape))
                continue
            logits = out.reshape(out.shape[0], out.shape[1], -1)  # (n, C, positions)
            probs = torch.softmax(logits, dim=1).transpose(1, 2).reshape(-1, out.shape[1])
            picked = torch.multinomial(probs.cpu(), 1, generator=generator).view(y.shape)
            picked = picked.to(y.device)
            draws.append(torch.where(y == opts.ignore, y, picked) if y.dim() > 1 else picked)
    return draws


def _exact(
    fn: PerSampleFunction, packed: PackedBatch, targets: list[Tensor], opts: _Options
) -> Tensor:
    """``sum_i diag(J_i^T Lambda_i J_i)`` for one batch, from the engine's per-sample Jacobians
    in chunks of samples (``fn``'s output function is a :class:`_Capture`; classification reads
    each sample's logits from it)."""
    total = None
    n = packed.num_samples
    step = min(opts.chunk or 8, 8)
    values = fn.values()
    for s in range(0, n, step):
        idx = list(range(s, min(n, s + step)))
        part = _subbatch(packed, idx)
        res = per_sample_jacobian(
            fn.model,
            part,
            params=fn.subset,
            output_fn=fn.output_fn.user,  # type: ignore[union-attr]
            memory_budget=opts.memory_budget,
            batch_norm=opts.batch_norm,
        )
        for k, i in enumerate(idx):
            jac = res.jacobian[k, : res.output_sizes[k]]  # (O, P)
            if opts.likelihood is Likelihood.REGRESSION:
                d = (jac**2).sum(0) / opts.sigma**2
            else:
                out = _raw_output(fn, values, tuple(part.sample(k)))
                c = out.shape[1]
                j = jac.view(c, -1, jac.shape[-1])  # (C, positions, P)
                p = torch.softmax(out.reshape(c, -1), dim=0).unsqueeze(-1)  # (C, positions, 1)
                valid = (
                    (targets[i].reshape(-1) != opts.ignore).to(jac.dtype)
                    if targets[i].dim()
                    else None
                )
                per_pos = (p * j**2).sum(0) - ((p * j).sum(0)) ** 2  # (positions, P)
                if valid is not None:
                    per_pos = per_pos * valid.unsqueeze(-1)
                d = per_pos.sum(0)
            total = d if total is None else total + d
    return total


def _subbatch(packed: PackedBatch, idx: list[int]) -> PackedBatch:
    return (
        pack([list(packed.sample(i)) for i in idx])
        if packed.kind is not InputKind.TENSOR
        else pack(torch.stack([packed.sample(i)[0] for i in idx]))
    )
