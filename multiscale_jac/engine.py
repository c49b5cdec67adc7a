"""Per-sample Jacobians w.r.t. a parameter subset: the vectorised engine.

Strategies (:class:`~multiscale_jac.enums.Strategy`):

=========  ===========================================  ====================================
strategy   runs                                         when it cannot run
=========  ===========================================  ====================================
vmap       one ``vmap`` over all samples                >1 shape signature -> bucketed
bucketed   ``vmap`` within each shape-signature bucket  vmap error -> loop
padded     one ``vmap`` over the padded batch, masked   unsupported op or error -> bucketed
           after every op (``masked.MaskedMode``)
loop       the reference loop                           (always runs)
auto       vmap if one signature, else bucketed or      padded impossible -> bucketed (a note)
           padded by the cost model (``_planning``)
=========  ===========================================  ====================================

A fallback warns (:class:`~multiscale_jac.enums.FallbackWarning`) and is recorded on the result
(``result.strategy``, ``result.fallback``); with ``strict=True`` it raises instead.

Modes: ``rev`` vmaps ``jacrev`` (one backward per output row, batched); ``fwd`` vmaps JVPs with
one-hot tangents, one parameter tensor at a time (a tangent on a deep tensor does not travel
through the layers before it); ``auto`` picks ``fwd`` when P is smaller than the (mean) number
of outputs per sample, else ``rev``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jacrev, jvp, vmap

from ._checks import (
    check_bool,
    check_chunk_size,
    check_memory_budget,
    check_model,
    check_output_fn,
    check_train_mode_layers,
)
from ._planning import (
    EntryCost,
    Footprint,
    Plan,
    choose_mode,
    estimate_seconds,
    measure,
    minimum_bytes,
    plan_chunks,
    rev_structured,
    survey,
)
from .adapter import PerSampleFunction
from .entries import NotStructuredError
from .enums import (
    BatchNormPolicy,
    Entries,
    FallbackWarning,
    Layout,
    Mode,
    Randomness,
    Strategy,
    parse_enum,
)
from .masked import PaddedFunction, UnsupportedOpError
from .packing import PackedBatch, pack
from .reference import loop_jacobian
from .result import JacobianResult, output_mask_from_sizes
from .subset import ParamSubset, resolve_subset

__all__ = ["per_sample_jacobian"]


def per_sample_jacobian(
    model: nn.Module,
    inputs: Any,
    *,
    params: ParamSubset | str | list[str] | None = None,
    output_fn: Callable[[Any], Any] | None = None,
    mode: str | Mode = "auto",
    strategy: str | Strategy = "auto",
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    randomness: str | Randomness = "error",
    batch_norm: str | BatchNormPolicy = "error",
    entries: str | Entries = "auto",
    strict: bool = False,
) -> JacobianResult:
    """Per-sample Jacobians of ``model``'s outputs w.r.t. a subset of its parameters.

    Args:
        model: Any ``nn.Module``; called unmodified on each sample as a batch of one.
        inputs: Anything :func:`~multiscale_jac.pack` accepts, or a ``PackedBatch``.
        params: A :class:`ParamSubset`, a parameter name/glob or a list of them; default all.
        output_fn: Applied to the model's output (batch dim of one kept) before flattening,
            e.g. to reduce it.
        mode: ``"auto"``, ``"rev"`` or ``"fwd"``.
        strategy: ``"auto"``, ``"vmap"``, ``"bucketed"``, ``"padded"`` or ``"loop"``.
        chunk_size: Samples per vectorised call (``1`` runs the samples one by one through
            the same code path). Default: from ``memory_budget`` or a working-set target.
        memory_budget: Bytes the computation may use, including the returned Jacobian; picks
            samples per call and output rows/tangents per step (estimate in ``docs/design.md``).
        randomness: ``"error"``, ``"different"`` or ``"same"``, for random ops such as dropout in
            train mode, as in ``torch.func.vmap``.
        batch_norm: ``"error"`` or ``"eval"``: what to do with BatchNorm layers in train mode.
        entries: ``"auto"``, ``"structured"`` or ``"generic"``: how columns of conv/linear
            weights and biases are computed (:class:`~multiscale_jac.enums.Entries`); ``auto``
            picks per tensor by the cost model. The result's ``structured`` lists what ran
            structured.
        strict: Raise instead of falling back to another strategy.

    Returns:
        A :class:`JacobianResult`; ``.jacobian`` is ``(N, O, P)``, outputs padded to the largest
        ``O`` with ``.output_mask`` when samples have different output sizes.

    Raises:
        TypeError, ValueError: bad arguments (the message names the offending value).
    """
    model = check_model(model)
    output_fn = check_output_fn(output_fn)
    mode = parse_enum(Mode, mode, "mode")
    strategy = parse_enum(Strategy, strategy, "strategy")
    randomness = parse_enum(Randomness, randomness, "randomness")
    batch_norm = parse_enum(BatchNormPolicy, batch_norm, "batch_norm")
    entries = parse_enum(Entries, entries, "entries")
    chunk_size = check_chunk_size(chunk_size)
    memory_budget = check_memory_budget(memory_budget)
    strict = check_bool(strict, "strict")
    packed = inputs if isinstance(inputs, PackedBatch) else pack(inputs)
    subset = resolve_subset(params, model)
    eval_bn = check_train_mode_layers(model, batch_norm, randomness)
    fn = PerSampleFunction(
        model,
        subset,
        packed.kind,
        output_fn,
        eval_batch_norm=eval_bn,
        tokens=packed.layout is Layout.NESTED,
    )
    for name, v in zip(subset.names, fn.values()):
        if not v.is_floating_point():
            raise TypeError(
                f"parameter {name!r} has dtype {v.dtype}; only floating-point parameters can be differentiated"
            )
    return _jacobian_impl(
        fn,
        packed.to(fn.device),
        mode=mode,
        strategy=strategy,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
        randomness=randomness,
        entries=entries,
        strict=strict,
    )


def _jacobian_impl(
    fn: PerSampleFunction,
    packed: PackedBatch,
    *,
    mode: Mode,
    strategy: Strategy,
    chunk_size: int | None,
    memory_budget: int | None,
    randomness: Randomness,
    entries: Entries,
    strict: bool,
) -> JacobianResult:
    record = {"requested_strategy": strategy, "requested_mode": mode, "subset": fn.subset}
    fallbacks: list[str] = []

    def fall_back(why: str, to: Strategy | Mode, err: Exception | None = None) -> Any:
        instead = f"{to.value!r}" if isinstance(to, Strategy) else f"mode {to.value!r}"
        if strict:
            if isinstance(err, UnsupportedOpError):
                raise err
            if err is not None:
                raise RuntimeError(f"{why}; strict=True forbids running {instead} instead") from err
            raise ValueError(f"{why}; strict=True forbids running {instead} instead")
        msg = f"{why}; ran {instead}"
        _warn(msg)
        fallbacks.append(msg)
        return to

    num_buckets = len(packed.buckets())
    ran = strategy
    plan: _VectorPlan | None = None
    notes: list[str] = []
    if strategy is Strategy.AUTO:
        if num_buckets == 1:
            ran = Strategy.VMAP
        else:
            ran, plan = _choose(
                fn, packed, mode, chunk_size, memory_budget, randomness, entries, notes
            )
    elif strategy is Strategy.VMAP and num_buckets > 1:
        ran = fall_back(
            f"strategy='vmap' needs one shape signature but the batch has {num_buckets}",
            Strategy.BUCKETED,
        )

    while ran is not Strategy.LOOP:
        # planning runs plain forward passes: a model that fails there fails in the loop too,
        # except for ops the padded strategy has no rule for
        try:
            if plan is None or plan.strategy is not ran:
                plan = _plan(
                    fn, packed, ran, mode, chunk_size, memory_budget, randomness, entries, notes
                )
        except UnsupportedOpError as err:
            ran = fall_back(
                f"strategy 'padded' cannot run this model ({err})", Strategy.BUCKETED, err
            )
            continue
        except RuntimeError as err:
            if ran is not Strategy.PADDED:
                raise  # a plain forward pass failed: the model fails in the loop too
            ran = fall_back(
                f"strategy 'padded' failed in its planning pass "
                f"({type(err).__name__}: {_first_line(err)})",
                Strategy.BUCKETED,
                err,
            )
            continue
        try:
            with torch.no_grad():
                jac, structured = _run(plan, fn, randomness, notes)
        except (RuntimeError, NotImplementedError) as err:
            if randomness is Randomness.ERROR and "randomness" in str(err):
                raise ValueError(
                    "the model calls a random operation (e.g. functional dropout in train mode) "
                    "while randomness='error'; put the model in eval mode or pass "
                    "randomness='different' or 'same'"
                ) from err
            if plan.mode is Mode.FWD and "forward AD" in str(err):
                # an op without a forward-mode derivative (e.g. SDPA's fused CPU kernel)
                why = f"mode 'fwd' failed ({_first_line(err)})"
                if record["requested_mode"] is Mode.AUTO:
                    notes.append(f"auto: {why}; chose mode 'rev'")
                    mode = Mode.REV
                else:
                    mode = fall_back(why, Mode.REV, err)
                plan = None
                continue
            ran = fall_back(
                f"strategy {ran.value!r} failed ({type(err).__name__}: {_first_line(err)})",
                Strategy.BUCKETED if ran is Strategy.PADDED else Strategy.LOOP,
                err,
            )
            continue
        return JacobianResult(
            jacobian=jac,
            output_mask=output_mask_from_sizes(plan.sizes, jac.device),
            output_sizes=plan.sizes,
            strategy=ran,
            mode=plan.mode,
            chunk_size=max(c.samples for g in plan.groups for c in g.chunks),
            inner_chunk_size=_min_or_none(c.inner for g in plan.groups for c in g.chunks),
            fallback="; then ".join(fallbacks) or None,
            notes=tuple(notes),
            structured=structured,
            **record,
        )
    jac, mask, sizes = loop_jacobian(fn, packed)
    return JacobianResult(
        jacobian=jac,
        output_mask=mask,
        output_sizes=sizes,
        strategy=Strategy.LOOP,
        mode=Mode.REV,
        fallback="; then ".join(fallbacks) or None,
        notes=tuple(notes),
        **record,
    )


def _choose(
    fn: PerSampleFunction,
    packed: PackedBatch,
    mode: Mode,
    chunk_size: int | None,
    memory_budget: int | None,
    randomness: Randomness,
    entries: Entries,
    notes: list[str],
) -> tuple[Strategy, _VectorPlan]:
    """``auto`` on a batch with several shape signatures: plan ``bucketed`` and ``padded`` and
    keep the one the cost model (``_planning.estimate_seconds``) expects to be faster. A model
    that padded execution cannot run is a choice, not a fallback: it is noted, not warned.
    The strategy note comes first, then the chosen plan's mode notes."""
    plan_notes: dict[Strategy, list[str]] = {Strategy.BUCKETED: [], Strategy.PADDED: []}

    def plan(strategy: Strategy) -> _VectorPlan:
        return _plan(
            fn,
            packed,
            strategy,
            mode,
            chunk_size,
            memory_budget,
            randomness,
            entries,
            plan_notes[strategy],
        )

    def chose(best: Strategy, note: str, chosen: _VectorPlan) -> tuple[Strategy, _VectorPlan]:
        notes.append(note)
        notes.extend(plan_notes[best])
        return best, chosen

    bucketed = plan(Strategy.BUCKETED)
    bucketed_s = _cost(bucketed)
    bound = _padded_lower_bound(bucketed)
    if bound >= bucketed_s:
        # planning padded costs a masked forward pass: skip it when it cannot win
        return chose(
            Strategy.BUCKETED,
            f"auto: estimated bucketed {bucketed_s * 1e3:.1f} ms, padded at least "
            f"{bound * 1e3:.1f} ms; chose 'bucketed'",
            bucketed,
        )
    try:
        padded = plan(Strategy.PADDED)
    except UnsupportedOpError as err:
        return chose(
            Strategy.BUCKETED, f"auto: 'padded' not possible ({err}); chose 'bucketed'", bucketed
        )
    except RuntimeError as err:
        return chose(
            Strategy.BUCKETED,
            f"auto: 'padded' not possible ({type(err).__name__} in its planning pass: "
            f"{_first_line(err)}); chose 'bucketed'",
            bucketed,
        )
    costs = {Strategy.BUCKETED: bucketed_s, Strategy.PADDED: _cost(padded)}
    best = min(costs, key=costs.__getitem__)
    return chose(
        best,
        "auto: estimated "
        + ", ".join(f"{k.value} {v * 1e3:.1f} ms" for k, v in costs.items())
        + f"; chose {best.value!r}",
        bucketed if best is Strategy.BUCKETED else padded,
    )


def _padded_lower_bound(bucketed: _VectorPlan) -> float:
    """A lower bound of the padded plan's estimate, from the bucketed plan's measurements: the
    padded sample is at least as large as the largest bucket's (activations and outputs), and
    all samples run in at least one call."""
    largest = Footprint(
        activations=max(g.footprint.activations for g in bucketed.groups),
        largest=max(g.footprint.largest for g in bucketed.groups),
        outputs=max(g.outputs for g in bucketed.groups),
    )
    passes = len(bucketed.spans) if bucketed.mode is Mode.FWD else 1
    return estimate_seconds(
        [(bucketed.num_samples, bucketed.num_samples, largest, passes)],
        mode=bucketed.mode,
        numel=bucketed.numel,
        padded=True,
        device=bucketed.device,
    )


def _cost(plan: _VectorPlan) -> float:
    return estimate_seconds(
        [
            (
                len(g.indices),
                min(c.samples for c in g.chunks),
                g.footprint,
                len(plan.spans) if plan.mode is Mode.FWD else 1,
            )
            for g in plan.groups
        ],
        mode=plan.mode,
        numel=plan.numel,
        padded=plan.strategy is Strategy.PADDED,
        device=plan.device,
    )


@dataclass(frozen=True)
class _Group:
    """Samples that run through one vectorised function (a bucket, or the whole padded batch).

    ``levels(idx)`` gives the vmapped level tensors of samples ``idx``; ``table`` (padded only)
    ``(N, O_pad)`` marks the real output rows of every sample, which are compacted to the top.
    """

    indices: list[int]
    fn: Callable[..., Tensor]
    levels: Callable[[list[int]], list[Tensor]]
    outputs: int
    chunks: tuple[Plan, ...]  # rev: one; fwd: one per tangent span
    footprint: Footprint
    table: Tensor | None = None


@dataclass(frozen=True)
class _VectorPlan:
    strategy: Strategy
    mode: Mode
    groups: list[_Group]
    spans: list[tuple[int, int]]  # column spans with their own forward pass (fwd)
    sizes: tuple[int, ...]  # O of every sample
    num_samples: int
    numel: int
    device: torch.device
    structured: tuple[str, ...] = ()  # tensors run by the structured path


def _plan(
    fn: PerSampleFunction,
    packed: PackedBatch,
    strategy: Strategy,
    mode: Mode,
    chunk_size: int | None,
    memory_budget: int | None,
    randomness: Randomness,
    entries: Entries,
    notes: list[str],
) -> _VectorPlan:
    """Measure one sample per group, pick the mode, the structured tensors and the chunks
    (see ``_planning``)."""
    values = fn.values()
    numel = fn.subset.numel
    itemsize = values[0].element_size()
    n = packed.num_samples
    sizes = [0] * n
    raw: list[
        tuple[
            list[int],
            Callable[..., Tensor],
            Callable[[list[int]], list[Tensor]],
            Footprint,
            Tensor | None,
        ]
    ] = []
    if strategy is Strategy.PADDED:
        pfn = PaddedFunction(fn, packed)
        device = packed.device
        fp = measure(pfn, values, (*(t[0] for t in packed.levels), torch.tensor(0, device=device)))
        table = pfn.output_table
        for i, o in enumerate(table.sum(dim=1).tolist()):
            sizes[i] = int(o)

        def padded_levels(idx: list[int]) -> list[Tensor]:
            it = torch.tensor(idx, device=device)
            return [t.index_select(0, it) for t in packed.levels] + [it]

        raw.append((list(range(n)), pfn, padded_levels, fp, table))
    else:
        for b in packed.buckets():
            fp = measure(fn, values, tuple(lv[0] for lv in packed.stack(b.indices[:1])))
            for i in b.indices:
                sizes[i] = fp.outputs
            raw.append((b.indices, fn, packed.stack, fp, None))
    structured: tuple[str, ...] = ()
    costs: dict[str, EntryCost] = {}
    base = fn.params
    tensor_numel = {name: base[name].numel() for name in fn.subset.names}
    per_tensor = randomness is Randomness.ERROR  # fwd spans are single tensors
    if strategy is Strategy.PADDED or (mode is Mode.FWD and not per_tensor):
        if mode is Mode.AUTO:
            mode = Mode.FWD if numel < sum(sizes) / n else Mode.REV
        if entries is Entries.STRUCTURED:
            notes.append(
                "mode: structured entries need a bucketed/vmap strategy and per-tensor "
                "tangents (randomness='error'); ran generic"
            )
    elif mode is Mode.REV:  # no survey needed: the rev rule only looks at tensor sizes
        structured = fn.with_structured(
            rev_structured(fn.subset.names, tensor_numel, entries, values[0].device)
        ).structured_names
        if structured:
            notes.append(f"mode: structured entries for {', '.join(structured)}")
    elif entries is Entries.GENERIC and mode is not Mode.AUTO:
        pass
    else:
        first = raw[0][2](raw[0][0][:1])
        costs = survey(fn, values, tuple(t[0] for t in first))
        counts = {name: fn.subset.offsets[name][1] - fn.subset.offsets[name][0] for name in costs}
        requested = mode
        mode, structured, est = choose_mode(
            costs,
            numel=counts,
            outputs=sum(sizes) / n,
            samples=n,
            mode=mode,
            entries=entries if per_tensor else Entries.GENERIC,
            device=values[0].device,
            tensor_numel=tensor_numel,
        )
        if mode is Mode.REV:
            structured = fn.with_structured(structured).structured_names
        if requested is Mode.AUTO:
            notes.append(
                f"mode: estimated fwd {est['fwd'] * 1e3:.1f} ms, rev {est['rev'] * 1e3:.1f} ms; "
                f"chose {mode.value!r}"
            )
        if structured:
            notes.append(f"mode: structured entries for {', '.join(structured)}")
        if entries is Entries.STRUCTURED and mode is Mode.FWD:
            notes.extend(
                f"mode: {name} runs generic ({cost.reason})"
                for name, cost in costs.items()
                if name not in structured and name in fn.entry_names
            )
    spans = _tangent_groups(fn.subset, mode, randomness)

    # what one vectorised step holds: rev, one output row of all P columns; fwd, one tangent
    # of one span (measured by the survey where it ran, else the footprint estimate)
    steps = []
    if mode is Mode.REV:
        # each row's backward also holds the full gradient of every generic selected tensor
        dense = sum(
            tensor_numel[name]
            for name in fn.subset.names
            if name not in structured and fn.subset.indices[name] is not None
        )
        largest = max(fp.largest for _, _, _, fp, _ in raw)
        steps.append((numel, 2 * largest + (numel + dense) * itemsize))
    else:
        for lo, hi in spans:
            name = _span_tensor(fn.subset, (lo, hi))
            cost = costs.get(name) if name is not None else None
            elems = None
            if cost is not None:
                elems = cost.structured_elems if name in structured else cost.generic_elems
            steps.append((hi - lo, None if elems is None else elems * itemsize))
    available = None
    if memory_budget is not None:
        result_bytes = n * max(sizes) * numel * itemsize
        need = max(
            minimum_bytes(
                fp,
                mode=mode,
                numel=width,
                itemsize=itemsize,
                samples=min(chunk_size or 1, len(idx)),
                per_step=per_step,
            )
            for idx, _, _, fp, _ in raw
            for width, per_step in steps
        )
        if result_bytes + need > memory_budget:
            unit = "output row" if mode is Mode.REV else "tangent"
            per_call = f"{chunk_size} samples" if chunk_size not in (None, 1) else "one sample"
            raise ValueError(
                f"memory_budget={memory_budget} bytes is below the estimated minimum of "
                f"{result_bytes + need} bytes: the result {(n, max(sizes), numel)} ({values[0].dtype}) "
                f"takes {result_bytes} and {per_call} with one {unit} at a time needs {need}"
            )
        available = memory_budget - result_bytes
    rev_fn = fn.with_structured(structured) if mode is Mode.REV and structured else fn
    groups = [
        _Group(
            indices=idx,
            fn=rev_fn if gfn is fn else gfn,
            levels=levels,
            outputs=fp.outputs,
            footprint=fp,
            table=table,
            chunks=tuple(
                plan_chunks(
                    fp,
                    mode=mode,
                    numel=width,
                    full_inner=fp.outputs if mode is Mode.REV else width,
                    itemsize=itemsize,
                    bucket_size=len(idx),
                    chunk_size=chunk_size,
                    available=available,
                    device=values[0].device,
                    per_step=per_step,
                )
                for width, per_step in steps
            ),
        )
        for idx, gfn, levels, fp, table in raw
    ]
    return _VectorPlan(
        strategy, mode, groups, spans, tuple(sizes), n, numel, values[0].device, structured
    )


def _run(
    plan: _VectorPlan, fn: PerSampleFunction, randomness: Randomness, notes: list[str]
) -> tuple[Tensor, tuple[str, ...]]:
    """Fill the ``(N, O, P)`` result group by group, chunk by chunk; also returns the tensors
    that ran structured (a structured pass that meets an op it cannot run exactly is redone
    generically, with a note)."""
    subset, values = fn.subset, fn.values()
    structured = list(plan.structured) if plan.mode is Mode.FWD else []
    shape = (plan.num_samples, max(plan.sizes), subset.numel)
    # every entry is written unless output rows are padded
    ragged = len(set(plan.sizes)) > 1 or any(g.table is not None for g in plan.groups)
    jac = values[0].new_zeros(shape) if ragged else values[0].new_empty(shape)
    for g in plan.groups:
        if plan.mode is Mode.REV:
            for idx in _sample_chunks(g.indices, g.chunks[0].samples):
                blocks = _rev_block(g.fn, values, g.levels(idx), g.chunks[0].inner, randomness)
                for name, blk in zip(subset.names, blocks):
                    lo, hi = subset.offsets[name]
                    _write(jac, idx, blk.reshape(len(idx), g.outputs, -1), lo, hi, g.table)
            continue
        for span, chunks in zip(plan.spans, g.chunks):
            name = _span_tensor(subset, span)
            for idx in _sample_chunks(g.indices, chunks.samples):
                levels = g.levels(idx)
                blk = None
                if name in structured:
                    try:
                        blk = _entry_block(fn, name, values, levels, chunks.inner, randomness)
                    except NotStructuredError as err:
                        structured.remove(name)
                        notes.append(f"{name}: structured pass stopped ({err}); ran generic")
                if blk is None:
                    blk = _fwd_block(g.fn, subset, values, levels, span, chunks.inner, randomness)
                _write(jac, idx, blk, *span, g.table)
    return jac, tuple(structured) if plan.mode is Mode.FWD else plan.structured


def _sample_chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[s : s + size] for s in range(0, len(indices), size)]


def _span_tensor(subset: ParamSubset, span: tuple[int, int]) -> str | None:
    """The tensor whose columns are exactly ``span``, if any."""
    for name in subset.names:
        if subset.offsets[name] == span:
            return name
    return None


def _write(
    jac: Tensor, idx: list[int], block: Tensor, lo: int, hi: int, table: Tensor | None
) -> None:
    """Put ``block`` ``(n, O_g, hi - lo)`` of samples ``idx`` into ``jac``; with a ``table``,
    only each sample's real rows, moved to the top in order."""
    if table is None:
        o = block.shape[1]
        contiguous = idx == list(range(idx[0], idx[-1] + 1))
        target = slice(idx[0], idx[-1] + 1) if contiguous else idx
        jac[target, :o, lo:hi] = block
        return
    for k, i in enumerate(idx):
        rows = table[i].nonzero().squeeze(1).to(block.device)
        jac[i, : rows.numel(), lo:hi] = block[k].index_select(0, rows)


def _rev_block(
    fn: Callable[..., Tensor],
    values: tuple[Tensor, ...],
    levels: list[Tensor],
    inner: int | None,
    randomness: Randomness,
) -> tuple[Tensor, ...]:
    """``(n, O, *selected_shape)`` per selected tensor, by vmap over jacrev."""
    in_dims = (None,) + (0,) * len(levels)
    jf = jacrev(fn, argnums=0, chunk_size=inner)
    return vmap(jf, in_dims=in_dims, randomness=randomness.value)(values, *levels)


def _fwd_block(
    fn: Callable[..., Tensor],
    subset: ParamSubset,
    values: tuple[Tensor, ...],
    levels: list[Tensor],
    span: tuple[int, int],
    inner: int | None,
    randomness: Randomness,
) -> Tensor:
    """``(n, O, hi - lo)``: columns ``[lo, hi)`` of the flat order by vmapped one-hot JVPs.

    Only the tensors overlapping ``span`` carry tangents (``span`` covers whole tensors).
    """
    lo, hi = span
    names = subset.names
    offsets = subset.offsets
    active = [k for k, n in enumerate(names) if lo <= offsets[n][0] and offsets[n][1] <= hi]
    width = hi - lo
    step = inner or width
    inner_rand = "error" if randomness is Randomness.ERROR else "same"

    def per_sample(vals: tuple[Tensor, ...], *lv: Tensor) -> Tensor:
        def f_active(*act: Tensor) -> Tensor:
            full = list(vals)
            for k, a in zip(active, act):
                full[k] = a
            return fn(tuple(full), *lv)

        primals = tuple(vals[k] for k in active)

        def one(tangent: Tensor) -> Tensor:
            tangents = []
            for k in active:
                a, b = offsets[names[k]]
                tangents.append(tangent[a - lo : b - lo].reshape(vals[k].shape))
            return jvp(f_active, primals, tuple(tangents))[1]

        cols = [
            vmap(one, randomness=inner_rand)(basis)
            for _, basis in _one_hot_chunks(width, step, vals[0])
        ]
        return (cols[0] if len(cols) == 1 else torch.cat(cols)).transpose(0, 1)

    in_dims = (None,) + (0,) * len(levels)
    return vmap(per_sample, in_dims=in_dims, randomness=randomness.value)(values, *levels)


def _entry_block(
    fn: PerSampleFunction,
    name: str,
    values: tuple[Tensor, ...],
    levels: list[Tensor],
    inner: int | None,
    randomness: Randomness,
    stats: dict[str, int] | None = None,
) -> Tensor:
    """``(n, O, k)``: the columns of tensor ``name`` by the structured forward pass
    (:mod:`~multiscale_jac.entries`): tangent ``e_j`` on its values and ``j`` on a dummy
    scalar, one entry per tangent, vmapped over entries and samples."""
    pos = fn.subset.names.index(name)
    v0 = values[pos]
    k = v0.numel()
    step = inner or k
    inner_rand = "error" if randomness is Randomness.ERROR else "same"

    def per_sample(vals: tuple[Tensor, ...], *lv: Tensor) -> Tensor:
        c0 = v0.new_zeros(())

        def f(v: Tensor, c: Tensor) -> Tensor:
            return fn.entry_call(name, vals, lv, v, c, stats=stats)

        def one(hot: Tensor, j: Tensor) -> Tensor:
            return jvp(f, (vals[pos], c0), (hot.view_as(v0), j))[1]

        cols = [vmap(one, randomness=inner_rand)(hot, j) for j, hot in _one_hot_chunks(k, step, v0)]
        return (cols[0] if len(cols) == 1 else torch.cat(cols)).transpose(0, 1)

    in_dims = (None,) + (0,) * len(levels)
    return vmap(per_sample, in_dims=in_dims, randomness=randomness.value)(values, *levels)


def _one_hot_chunks(width: int, step: int, like: Tensor) -> list[tuple[Tensor, Tensor]]:
    """One-hot tangents ``(c, width)`` in chunks of ``step``, each with its column indices
    ``(c,)`` (in ``like``'s dtype: the entry index ``j`` the structured pass reads)."""
    out = []
    for s in range(0, width, step):
        c = min(step, width - s)
        hot = like.new_zeros((c, width))
        hot[torch.arange(c), torch.arange(s, s + c)] = 1
        out.append((torch.arange(s, s + c, dtype=like.dtype, device=like.device), hot))
    return out


def _tangent_groups(
    subset: ParamSubset, mode: Mode, randomness: Randomness
) -> list[tuple[int, int]]:
    """Column spans that get their own forward pass in fwd mode.

    One span per tensor, so that a tangent on a deep tensor starts there; all at once when the
    forward pass is random (every column must see the same dropout mask).
    """
    if mode is Mode.REV or randomness is not Randomness.ERROR:
        return [(0, subset.numel)]
    return [subset.offsets[n] for n in subset.names]


def _warn(msg: str) -> None:
    warnings.warn(msg, FallbackWarning, stacklevel=5)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""


def _min_or_none(xs: Any) -> int | None:
    vals = [x for x in xs if x is not None]
    return min(vals) if vals else None
