"""Planning the vectorised engine: the strategy, the mode, the structured tensors, the memory
estimate and the chunks (:func:`plan_strategy`, :func:`choose_strategy`); the engine runs the
plans (:mod:`~multiscale_jac.engine`).

The estimate (documented in ``docs/design.md``) uses three numbers measured on one forward pass
of one sample of each bucket: ``A``, the bytes autograd saves for the backward pass (the
activations); ``M``, the bytes of the largest single saved tensor; and ``O``, the number of
outputs. With ``P`` selected entries, itemsize ``s`` and ``c`` output rows (rev) or tangents
(fwd) processed at once, one sample needs about

* rev: ``A + c * (2 M + P s) + 2 O P s`` (one forward, ``c`` cotangents per layer and ``c``
  parameter-gradient rows alive, the per-sample Jacobian and its chunk pieces);
* fwd: ``A + c * (2 M + O s) + 2 O P s`` (``c`` tangents per layer, ``c`` output tangents).

A vectorised call over ``n`` samples needs ``n`` times that; the returned ``(N, O, P)`` result
is counted once on top.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .adapter import PerSampleFunction
from .entries import NotStructuredError, entry_call, entry_names
from .enums import Entries, MemoryBudgetError, Mode, Randomness, Strategy
from .masked import PaddedFunction, UnsupportedOpError
from .packing import PackedBatch
from .structured import StructuredFunction
from .subset import ParamSubset

__all__ = [
    "EngineOptions",
    "EntryCost",
    "Footprint",
    "Group",
    "Plan",
    "VectorPlan",
    "choose_mode",
    "choose_strategy",
    "estimate_seconds",
    "first_line",
    "measure",
    "minimum_bytes",
    "per_sample_bytes",
    "plan_chunks",
    "plan_seconds",
    "plan_strategy",
    "rev_structured",
    "span_tensor",
    "survey",
    "tangent_groups",
]


@dataclass(frozen=True)
class EngineOptions:
    """The engine's options, checked (see the options table in ``docs/design.md``)."""

    mode: Mode = Mode.AUTO
    strategy: Strategy = Strategy.AUTO
    entries: Entries = Entries.AUTO
    chunk_size: int | None = None
    memory_budget: int | None = None
    randomness: Randomness = Randomness.ERROR
    strict: bool = False


#: Working-set target per vectorised call when neither ``chunk_size`` nor ``memory_budget`` is
#: given: small on CPU (cache-friendly; measured fastest on the ConvBlock
#: subset workload), larger on GPUs.
DEFAULT_WORKSET_BYTES = {"cpu": 64 * 2**20, "cuda": 2 * 2**30}


@dataclass(frozen=True)
class Footprint:
    """Per-sample facts of one bucket, measured on its first sample."""

    activations: int
    largest: int
    outputs: int


@dataclass(frozen=True)
class Plan:
    """How one bucket is run: ``samples`` per vectorised call and ``inner`` rows/tangents
    per step (``None``: all at once)."""

    samples: int
    inner: int | None


def measure(
    fn: PerSampleFunction, values: tuple[Tensor, ...], levels: tuple[Tensor, ...]
) -> Footprint:
    """Run one sample forward with autograd on and record saved-tensor sizes and ``O``."""
    seen: dict[int, int] = {}

    def pack_hook(t: Tensor) -> Tensor:
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without plain storage
            seen[id(t)] = t.numel() * t.element_size()
        return t

    leaves = tuple(v.detach().requires_grad_(True) for v in values)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        out = fn(leaves, *levels)
    return Footprint(
        activations=sum(seen.values()),
        largest=max(seen.values(), default=0),
        outputs=int(out.numel()),
    )


def per_sample_bytes(
    fp: Footprint, mode: Mode, numel: int, itemsize: int, inner: int, per_step: int | None = None
) -> int:
    """The estimate above for one sample with ``inner`` rows (rev) or tangents (fwd) at once;
    ``per_step`` replaces ``2 M + O s`` (fwd) where the tangents' size was measured (the
    structured pass counts them, :class:`EntryCost`)."""
    if per_step is None:
        per_step = 2 * fp.largest + (numel if mode is Mode.REV else fp.outputs) * itemsize
    return fp.activations + inner * per_step + 2 * fp.outputs * numel * itemsize


def plan_chunks(
    fp: Footprint,
    *,
    mode: Mode,
    numel: int,
    full_inner: int,
    itemsize: int,
    bucket_size: int,
    chunk_size: int | None,
    available: int | None,
    device: torch.device,
    per_step: int | None = None,
) -> Plan:
    """Choose samples per call and rows/tangents per step for one bucket (and, in fwd, one
    tensor's tangents).

    Args:
        fp: The bucket's footprint.
        mode: ``rev`` or ``fwd``.
        numel: P.
        full_inner: Rows (rev: O) or tangents (fwd: the largest tangent group) of one sample.
        itemsize: Bytes per element of the Jacobian.
        bucket_size: Samples in the bucket.
        chunk_size: Samples per call fixed by the caller, or ``None``.
        available: Bytes left under the caller's ``memory_budget`` after the result, or
            ``None`` for no budget (then a default working-set target is used).
        device: Where it runs (picks the default target).
        per_step: Measured bytes per row/tangent (see :func:`per_sample_bytes`).

    Raises:
        ValueError: ``available`` is below :func:`minimum_bytes` (callers check that first, to
            report the minimum over all buckets).
    """
    full = per_sample_bytes(fp, mode, numel, itemsize, full_inner, per_step)
    if available is None:
        target = DEFAULT_WORKSET_BYTES.get(device.type, DEFAULT_WORKSET_BYTES["cuda"])
        n = chunk_size or max(1, target // max(full, 1))
        return Plan(min(n, bucket_size), None)
    n = chunk_size or max(1, available // max(full, 1))
    n = min(n, bucket_size)
    if n * full <= available:
        return Plan(n, None)
    one = per_sample_bytes(fp, mode, numel, itemsize, 1, per_step)
    step = one - per_sample_bytes(fp, mode, numel, itemsize, 0, per_step)
    inner = (available // n - (one - step)) // max(step, 1)
    if inner < 1:  # the caller checks minimum_bytes first
        raise ValueError(f"memory_budget too small for {n} sample(s) with one row/tangent each")
    return Plan(n, int(min(inner, full_inner)))


def minimum_bytes(
    fp: Footprint,
    *,
    mode: Mode,
    numel: int,
    itemsize: int,
    samples: int,
    per_step: int | None = None,
) -> int:
    """Working memory of ``samples`` samples with one output row (rev) or tangent (fwd) each."""
    return samples * per_sample_bytes(fp, mode, numel, itemsize, 1, per_step)


#: Cost-model constants per device type: seconds per vectorised forward pass (Python tracing of
#: the model under vmap/jacrev: the same order for every small model), seconds per unit of work
#: (activation byte of one sample's forward x output rows or tangents), and the extra factor
#: masked execution costs (a where() and an index_select per op). CPU numbers were measured with
#: TinyFPN on 2 cores (torch 2.13, float32); CUDA numbers are estimates until measured.
COST_CONSTANTS = {
    "cpu": {
        "call_s": 3e-3,
        "unit_s": 1.2e-9,
        "masked": 1.3,
        "work_s": 2e-10,
        "structured_factor": 3.0,
        "rev_structured_min_numel": 4096,
    },
    "cuda": {
        "call_s": 4e-3,
        "unit_s": 2e-12,
        "masked": 1.3,
        "work_s": 2e-13,
        "structured_factor": 3.0,
        "rev_structured_min_numel": 4096,
    },
}


def estimate_seconds(
    groups: list[tuple[int, int, Footprint, int]],
    *,
    mode: Mode,
    numel: int,
    padded: bool,
    device: torch.device,
) -> float:
    """Expected time of a vectorised plan: for every group ``(samples, samples per call,
    footprint, forward passes per call)``,

    ``calls * passes * call_s * f + samples * activations * width * unit_s * f``

    with ``width`` = O (rev) or P (fwd) and ``f`` = ``masked`` for the padded strategy, else 1.
    Only the comparison between strategies matters (``auto``), not the absolute value.
    """
    c = COST_CONSTANTS.get(device.type, COST_CONSTANTS["cuda"])
    factor = c["masked"] if padded else 1.0
    total = 0.0
    for samples, per_call, fp, passes in groups:
        calls = -(-samples // per_call)
        width = fp.outputs if mode is Mode.REV else numel
        total += calls * passes * c["call_s"] + samples * fp.activations * width * c["unit_s"]
    return total * factor


# ---------------------------------------------------------------------- mode and entries
@dataclass(frozen=True)
class EntryCost:
    """Per-tangent work of one selected tensor, from one structured forward pass of one sample
    (:class:`~multiscale_jac.entries.EntryMode`, no tangents): ``structured`` for the structured
    pass (``None`` if it cannot run the model), ``generic`` for one-hot tangents through the
    same ops (multiply-adds of conv/linear layers, elements of other ops)."""

    structured: int | None
    generic: int
    structured_elems: int | None = None
    generic_elems: int | None = None
    #: why the structured pass cannot run (``structured is None``)
    reason: str = ""


def survey(
    fn: PerSampleFunction, values: tuple[Tensor, ...], levels: tuple[Tensor, ...]
) -> dict[str, EntryCost]:
    """:class:`EntryCost` of every selected tensor (one primal forward pass each)."""
    costs: dict[str, EntryCost] = {}
    names = entry_names(fn)
    with torch.no_grad():
        for pos, name in enumerate(fn.subset.names):
            rec: dict[str, int] = {}
            try:
                entry_call(
                    fn, name, values, levels, values[pos], values[pos].new_zeros(()), stats=rec
                )
            except NotStructuredError as err:
                costs[name] = EntryCost(None, rec.get("dense_work", 0), reason=str(err))
                continue
            structurable = name in names and rec["entry"] + rec["dense_entry"] > 0
            reason = ""
            if not structurable:
                reason = (
                    "not a weight/bias of a Conv1d/Conv2d/Linear module"
                    if name not in names
                    else "never reaches conv/linear as its weight/bias"
                )
            costs[name] = EntryCost(
                rec["work"] if structurable else None,
                rec["dense_work"],
                rec["elems"] if structurable else None,
                rec["dense_elems"],
                reason,
            )
    return costs


def choose_mode(
    costs: dict[str, EntryCost],
    *,
    numel: dict[str, int],
    outputs: float,
    samples: int,
    mode: Mode,
    entries: Entries,
    device: torch.device,
    tensor_numel: dict[str, int] | None = None,
) -> tuple[Mode, tuple[str, ...], dict[str, float]]:
    """Pick ``rev``/``fwd`` (when ``mode`` is ``auto``) and the tensors that run structured.

    Per sample, with ``O`` outputs, ``k_t`` entries of tensor ``t`` and per-tangent work
    ``w_t`` (structured) / ``d_t`` (generic) from :func:`survey`:

    * fwd: ``sum_t k_t (min(f w_t, d_t) + O)`` (``w_t`` only with ``entries`` auto/structured;
      ``f = structured_factor``: a structured multiply-add runs about 3x slower than one of a
      dense batched conv, measured on CPU: one-channel GEMMs, gathers, a Python mode per op);
    * rev: ``O (2 max_t d_t + P)``: one backward per output row through every op after the
      earliest selected tensor (input and weight gradients), then the row written.

    Times ``work_s`` and the sample count, plus ``call_s`` per vectorised call (one per tensor in
    fwd, one in rev). Returns the mode, the structured tensors (in fwd: those whose structured
    work is lower; in rev: with ``entries='auto'`` the tensors of at least
    ``rev_structured_min_numel`` entries (``tensor_numel``), every candidate with
    ``'structured'``; the caller keeps weight entries) and the estimates in seconds (keys
    ``fwd``, ``rev``).
    """
    c = COST_CONSTANTS.get(device.type, COST_CONSTANTS["cuda"])
    slow = c["structured_factor"]
    use = {
        n: ec.structured is not None
        and entries is not Entries.GENERIC
        and (entries is Entries.STRUCTURED or slow * ec.structured < ec.generic)
        for n, ec in costs.items()
    }
    fwd_work = sum(
        numel[n] * ((slow * ec.structured if use[n] else ec.generic) + outputs)  # type: ignore[operator]
        for n, ec in costs.items()
    )
    dense = max((ec.generic for ec in costs.values()), default=0)
    rev_work = outputs * (2 * dense + sum(numel.values()))
    est = {
        "fwd": samples * fwd_work * c["work_s"] + len(costs) * c["call_s"],
        "rev": samples * rev_work * c["work_s"] + c["call_s"],
    }
    if mode is Mode.AUTO:
        mode = Mode.FWD if est["fwd"] <= est["rev"] else Mode.REV
    if mode is Mode.FWD:
        return mode, tuple(n for n in costs if use[n]), est
    return mode, rev_structured(tuple(costs), tensor_numel or {}, entries, device), est


def rev_structured(
    names: tuple[str, ...], tensor_numel: dict[str, int], entries: Entries, device: torch.device
) -> tuple[str, ...]:
    """Candidates for the entry-only backward in rev mode (``structured.py``): it saves a full
    weight gradient per output row, so under ``auto`` it runs where that gradient is large (its
    fixed overhead loses on small tensors); all with ``structured``, none with ``generic``.
    The caller keeps weight entries (``structured.StructuredFunction``)."""
    if entries is Entries.GENERIC:
        return ()
    big = COST_CONSTANTS.get(device.type, COST_CONSTANTS["cuda"])["rev_structured_min_numel"]
    return tuple(n for n in names if entries is Entries.STRUCTURED or tensor_numel.get(n, 0) >= big)


# ---------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Group:
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
class VectorPlan:
    """How a vectorised strategy runs every group."""

    strategy: Strategy
    mode: Mode
    groups: list[Group]
    spans: list[tuple[int, int]]  # column spans with their own forward pass (fwd)
    sizes: tuple[int, ...]  # O of every sample
    num_samples: int
    numel: int
    device: torch.device
    structured: tuple[str, ...] = ()  # tensors run by the structured path


@dataclass(frozen=True)
class _Measured:
    """A group before its chunks are planned: its samples, function, level maker, the
    footprint of its first sample and (padded) the output table."""

    indices: list[int]
    fn: Callable[..., Tensor]
    levels: Callable[[list[int]], list[Tensor]]
    footprint: Footprint
    table: Tensor | None = None


def plan_strategy(
    fn: PerSampleFunction,
    packed: PackedBatch,
    strategy: Strategy,
    options: EngineOptions,
    notes: list[str],
) -> VectorPlan:
    """Measure one sample per group, pick the mode, the structured tensors and the chunks.

    Raises:
        MemoryBudgetError: ``options.memory_budget`` is below the estimated minimum.
        UnsupportedOpError, RuntimeError: the padded strategy cannot run the model.
    """
    measured, sizes = _measure_groups(fn, packed, strategy)
    mode, structured, costs = _pick_mode(fn, measured, sizes, strategy, options, notes)
    spans = tangent_groups(fn.subset, mode, options.randomness)
    steps = _steps(fn, measured, mode, spans, structured, costs)
    available = _available(fn, measured, sizes, mode, steps, options)
    values = fn.values()
    rev_fn = StructuredFunction(fn, structured) if mode is Mode.REV and structured else fn
    groups = [
        Group(
            indices=m.indices,
            fn=rev_fn if m.fn is fn else m.fn,
            levels=m.levels,
            outputs=m.footprint.outputs,
            footprint=m.footprint,
            table=m.table,
            chunks=tuple(
                plan_chunks(
                    m.footprint,
                    mode=mode,
                    numel=width,
                    full_inner=m.footprint.outputs if mode is Mode.REV else width,
                    itemsize=values[0].element_size(),
                    bucket_size=len(m.indices),
                    chunk_size=options.chunk_size,
                    available=available,
                    device=values[0].device,
                    per_step=per_step,
                )
                for width, per_step in steps
            ),
        )
        for m in measured
    ]
    n = len(packed)
    return VectorPlan(
        strategy, mode, groups, spans, tuple(sizes), n, fn.subset.numel, fn.device, structured
    )


def _measure_groups(
    fn: PerSampleFunction, packed: PackedBatch, strategy: Strategy
) -> tuple[list[_Measured], list[int]]:
    """The groups with the footprint of their first sample, and every sample's ``O``."""
    values = fn.values()
    sizes = [0] * len(packed)
    if strategy is Strategy.PADDED:
        pfn = PaddedFunction(fn, packed)
        device = packed.device
        fp = measure(pfn, values, (*(t[0] for t in packed.levels), torch.tensor(0, device=device)))
        table = pfn.output_table
        sizes = [int(o) for o in table.sum(dim=1).tolist()]

        def padded_levels(idx: list[int]) -> list[Tensor]:
            it = torch.tensor(idx, device=device)
            return [t.index_select(0, it) for t in packed.levels] + [it]

        return [_Measured(list(range(len(packed))), pfn, padded_levels, fp, table)], sizes
    measured = []
    for b in packed.buckets():
        fp = measure(fn, values, tuple(lv[0] for lv in packed.stack(b.indices[:1])))
        for i in b.indices:
            sizes[i] = fp.outputs
        measured.append(_Measured(b.indices, fn, packed.stack, fp))
    return measured, sizes


def _pick_mode(
    fn: PerSampleFunction,
    measured: list[_Measured],
    sizes: list[int],
    strategy: Strategy,
    options: EngineOptions,
    notes: list[str],
) -> tuple[Mode, tuple[str, ...], dict[str, EntryCost]]:
    """The mode, the tensors that run structured, and the survey's costs (where it ran)."""
    mode, entries, device = options.mode, options.entries, fn.device
    n, numel = len(sizes), fn.subset.numel
    tensor_numel = {name: fn.params[name].numel() for name in fn.subset.names}
    per_tensor = options.randomness is Randomness.ERROR  # fwd spans are single tensors
    if strategy is Strategy.PADDED or (mode is Mode.FWD and not per_tensor):
        if entries is Entries.STRUCTURED:
            notes.append(
                "mode: structured entries need a bucketed/vmap strategy and per-tensor "
                "tangents (randomness='error'); ran generic"
            )
        if mode is Mode.AUTO:
            mode = Mode.FWD if numel < sum(sizes) / n else Mode.REV
        return mode, (), {}
    if mode is Mode.REV:  # no survey needed: the rev rule only looks at tensor sizes
        names = rev_structured(fn.subset.names, tensor_numel, entries, device)
        structured = StructuredFunction(fn, names).names
        if structured:
            notes.append(f"mode: structured entries for {', '.join(structured)}")
        return mode, structured, {}
    if entries is Entries.GENERIC and mode is not Mode.AUTO:
        return mode, (), {}
    first = measured[0].levels(measured[0].indices[:1])
    costs = survey(fn, fn.values(), tuple(t[0] for t in first))
    chosen, structured, est = choose_mode(
        costs,
        numel={name: fn.subset.offsets[name][1] - fn.subset.offsets[name][0] for name in costs},
        outputs=sum(sizes) / n,
        samples=n,
        mode=mode,
        entries=entries if per_tensor else Entries.GENERIC,
        device=device,
        tensor_numel=tensor_numel,
    )
    if chosen is Mode.REV:
        structured = StructuredFunction(fn, structured).names
    if mode is Mode.AUTO:
        notes.append(
            f"mode: estimated fwd {est['fwd'] * 1e3:.1f} ms, rev {est['rev'] * 1e3:.1f} ms; "
            f"chose {chosen.value!r}"
        )
    if structured:
        notes.append(f"mode: structured entries for {', '.join(structured)}")
    if entries is Entries.STRUCTURED and chosen is Mode.FWD:
        notes.extend(
            f"mode: {name} runs generic ({cost.reason})"
            for name, cost in costs.items()
            if name not in structured and name in entry_names(fn)
        )
    return chosen, structured, costs


def _steps(
    fn: PerSampleFunction,
    measured: list[_Measured],
    mode: Mode,
    spans: list[tuple[int, int]],
    structured: tuple[str, ...],
    costs: dict[str, EntryCost],
) -> list[tuple[int, int | None]]:
    """``(columns, bytes)`` of what one vectorised step holds: rev, one output row of all P
    columns; fwd, one tangent of one span (measured by the survey where it ran, else ``None``:
    the footprint estimate)."""
    itemsize = fn.values()[0].element_size()
    if mode is Mode.REV:
        # each row's backward also holds the full gradient of every generic selected tensor
        dense = sum(
            fn.params[name].numel()
            for name in fn.subset.names
            if name not in structured and fn.subset.indices[name] is not None
        )
        largest = max(m.footprint.largest for m in measured)
        return [(fn.subset.numel, 2 * largest + (fn.subset.numel + dense) * itemsize)]
    steps: list[tuple[int, int | None]] = []
    for lo, hi in spans:
        name = span_tensor(fn.subset, (lo, hi))
        cost = costs.get(name) if name is not None else None
        elems = None
        if cost is not None:
            elems = cost.structured_elems if name in structured else cost.generic_elems
        steps.append((hi - lo, None if elems is None else elems * itemsize))
    return steps


def _available(
    fn: PerSampleFunction,
    measured: list[_Measured],
    sizes: list[int],
    mode: Mode,
    steps: list[tuple[int, int | None]],
    options: EngineOptions,
) -> int | None:
    """Bytes left under ``memory_budget`` after the result (``None`` without a budget).

    Raises:
        MemoryBudgetError: the budget is below the result plus one sample with one row/tangent.
    """
    budget, chunk_size = options.memory_budget, options.chunk_size
    if budget is None:
        return None
    values = fn.values()
    itemsize = values[0].element_size()
    n, numel = len(sizes), fn.subset.numel
    result_bytes = n * max(sizes) * (numel + 1) * itemsize  # the Jacobian and the outputs
    need = max(
        minimum_bytes(
            m.footprint,
            mode=mode,
            numel=width,
            itemsize=itemsize,
            samples=min(chunk_size or 1, len(m.indices)),
            per_step=per_step,
        )
        for m in measured
        for width, per_step in steps
    )
    if result_bytes + need > budget:
        unit = "output row" if mode is Mode.REV else "tangent"
        per_call = f"{chunk_size} samples" if chunk_size not in (None, 1) else "one sample"
        raise MemoryBudgetError(
            budget,
            result_bytes + need,
            f"the result {(n, max(sizes), numel)} ({values[0].dtype}) and its outputs take "
            f"{result_bytes} bytes and {per_call} with one {unit} at a time needs {need}",
        )
    return budget - result_bytes


def choose_strategy(
    fn: PerSampleFunction, packed: PackedBatch, options: EngineOptions, notes: list[str]
) -> tuple[Strategy, VectorPlan]:
    """``auto`` on a batch with several shape signatures: plan ``bucketed`` and ``padded`` and
    keep the one the cost model (:func:`estimate_seconds`) expects to be faster. A model that
    padded execution cannot run is a choice, not a fallback: it is noted, not warned. The
    strategy note comes first, then the chosen plan's mode notes."""
    plan_notes: dict[Strategy, list[str]] = {Strategy.BUCKETED: [], Strategy.PADDED: []}

    def chose(best: Strategy, note: str, chosen: VectorPlan) -> tuple[Strategy, VectorPlan]:
        notes.append(note)
        notes.extend(plan_notes[best])
        return best, chosen

    bucketed = plan_strategy(fn, packed, Strategy.BUCKETED, options, plan_notes[Strategy.BUCKETED])
    bucketed_s = plan_seconds(bucketed)
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
        padded = plan_strategy(fn, packed, Strategy.PADDED, options, plan_notes[Strategy.PADDED])
    except (UnsupportedOpError, MemoryBudgetError) as err:
        why = f"auto: 'padded' not possible ({err}); chose 'bucketed'"
        return chose(Strategy.BUCKETED, why, bucketed)
    except RuntimeError as err:
        why = (
            f"auto: 'padded' not possible ({type(err).__name__} in its planning pass: "
            f"{first_line(err)}); chose 'bucketed'"
        )
        return chose(Strategy.BUCKETED, why, bucketed)
    costs = {Strategy.BUCKETED: bucketed_s, Strategy.PADDED: plan_seconds(padded)}
    best = min(costs, key=costs.__getitem__)
    return chose(
        best,
        "auto: estimated "
        + ", ".join(f"{k.value} {v * 1e3:.1f} ms" for k, v in costs.items())
        + f"; chose {best.value!r}",
        bucketed if best is Strategy.BUCKETED else padded,
    )


def _padded_lower_bound(bucketed: VectorPlan) -> float:
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


def plan_seconds(plan: VectorPlan) -> float:
    """The cost model's estimate of a plan (:func:`estimate_seconds`)."""
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


def tangent_groups(
    subset: ParamSubset, mode: Mode, randomness: Randomness
) -> list[tuple[int, int]]:
    """Column spans that get their own forward pass in fwd mode.

    One span per tensor, so that a tangent on a deep tensor starts there; all at once when the
    forward pass is random (every column must see the same dropout mask).
    """
    if mode is Mode.REV or randomness is not Randomness.ERROR:
        return [(0, subset.numel)]
    return [subset.offsets[n] for n in subset.names]


def span_tensor(subset: ParamSubset, span: tuple[int, int]) -> str | None:
    """The tensor whose columns are exactly ``span``, if any."""
    for name in subset.names:
        if subset.offsets[name] == span:
            return name
    return None


def first_line(err: BaseException) -> str:
    """The first line of an error's message (at most 200 characters), for notes."""
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""
