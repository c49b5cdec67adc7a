"""Planning the vectorised engine: the strategy, the mode, the structured tensors, the memory
estimate and the chunks (:func:`plan_strategy`, :func:`choose_strategy`); the engine runs the
plans (:mod:`~multiscale_jac.engine`).

The memory estimate (documented in ``docs/design.md``, :mod:`~multiscale_jac._memory`) uses three
numbers measured on one forward pass of one sample of each bucket (:func:`measure`): ``A``, the
bytes autograd saves for the backward pass (the activations); ``M``, the bytes of the largest
single saved tensor; and ``O``, the number of outputs. A vectorised call over ``n`` samples
needs ``n`` times one sample's; the returned ``(N, O, P)`` result is counted once on top.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._calibration import machine
from ._memory import (
    DEFAULT_WORKSET_BYTES,
    engine_call,
    engine_result,
    engine_rev_step,
    engine_sample,
    engine_survey,
    engine_tangent,
    fit_budget,
    tensor_bytes,
)
from ._ops import AT
from ._plan_cache import COUNTS
from ._work import NO_WORK, Work, count_work
from .adapter import PerSampleFunction
from .entries import NotStructuredError, entry_call, entry_names
from .enums import Entries, MemoryBudgetError, Mode, Randomness, Strategy, Tune
from .masked import PaddedFunction, UnsupportedOpError
from .packing import PackedBatch
from .structured import StructuredFunction
from .subset import ParamSubset

__all__ = [
    "Decision",
    "EngineOptions",
    "EntryCost",
    "Footprint",
    "Group",
    "Plan",
    "Step",
    "VectorPlan",
    "choose_mode",
    "choose_strategy",
    "estimate_seconds",
    "first_line",
    "measure",
    "engine_minimum",
    "decision",
    "loop_decision",
    "default_workset",
    "plan_chunks",
    "plan_key",
    "plan_seconds",
    "plan_strategy",
    "replay",
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
    tune: Tune = Tune.AUTO


def default_workset(device: torch.device) -> int:
    """:data:`DEFAULT_WORKSET_BYTES` of ``device``'s type (CUDA's for other accelerators)."""
    return DEFAULT_WORKSET_BYTES.get(device.type, DEFAULT_WORKSET_BYTES["cuda"])


def even_chunk(k: int, bucket: int) -> int:
    """Samples per call for calls of at most ``k`` samples that split ``bucket`` samples
    evenly (16 samples in calls of at most 12: two calls of 8, not 12 and 4)."""
    k = min(k, bucket)
    return -(-bucket // -(-bucket // k))


@dataclass(frozen=True)
class Footprint:
    """Per-sample facts of one bucket, measured on its first sample; ``depth``: the most
    differentiable ops on one path from a selected tensor to the output (:func:`graph_depth`)."""

    activations: int
    largest: int
    outputs: int
    depth: int = 0
    #: the ops and flops of its forward pass (:func:`~multiscale_jac._work.count_work`)
    work: Work = NO_WORK


@dataclass(frozen=True)
class Plan:
    """How one bucket is run: ``samples`` per vectorised call and ``inner`` rows/tangents
    per step (``None``: all at once)."""

    samples: int
    inner: int | None


_UNMEASURED = Footprint(0, 0, 0)


def measure(
    fn: PerSampleFunction,
    values: tuple[Tensor, ...],
    levels: tuple[Tensor, ...],
    *,
    count: bool = True,
) -> Footprint:
    """Run one sample forward with autograd on and record saved-tensor sizes and ``O``: per
    sample, so not the model's parameters and buffers a layer saves (a linear layer its
    weight), which every sample of a vectorised call shares; ``count``: also the pass's
    :class:`~multiscale_jac._work.Work` (what the engine prices routes with; the
    memory model alone needs none, and counting's dispatch mode costs a first use's import)."""
    COUNTS["measure"] += 1
    seen: dict[int, int] = {}
    shared = {t.untyped_storage().data_ptr() for t in _model_tensors(fn)}

    def pack_hook(t: Tensor) -> Tensor:
        try:
            storage = t.untyped_storage()
            if storage.data_ptr() in shared:
                return t
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without plain storage
            seen[id(t)] = tensor_bytes(t.numel(), t.element_size())
        return t

    leaves = tuple(v.detach().requires_grad_(True) for v in values)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        if count:
            out, work = count_work(lambda: fn(leaves, *levels))
        else:
            out, work = fn(leaves, *levels), NO_WORK
    return Footprint(
        sum(seen.values()), max(seen.values(), default=0), int(out.numel()), graph_depth(out), work
    )


def _model_tensors(fn: Any) -> list[Tensor]:
    """The parameters and buffers of the model under ``fn`` (a per-sample function, or a
    wrapper of one: masked, structured)."""
    while not hasattr(fn, "model") and hasattr(fn, "fn"):
        fn = fn.fn
    model = getattr(fn, "model", None)
    if model is None:
        return []
    return [*model.parameters(), *model.buffers()]


def graph_depth(out: Tensor) -> int:
    """The most autograd nodes on one path from ``out`` back to a leaf: the differentiable ops
    between the selected tensors (the only leaves that require grad) and the output, along
    the longest chain (0 where ``out`` does not depend on them)."""
    root = out.grad_fn
    if root is None:
        return 0
    depth: dict[Any, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:  # iterative post-order: deep models overflow Python's recursion
        node, expanded = stack.pop()
        if node in depth:
            continue
        nexts = [n for n, _ in node.next_functions if n is not None]
        if expanded:
            depth[node] = 1 + max((depth[n] for n in nexts), default=0)
            continue
        stack.append((node, True))
        stack.extend((n, False) for n in nexts if n not in depth)
    return depth[root] - 1  # the leaves' AccumulateGrad nodes are no ops


class Step(NamedTuple):
    """What one vectorised step of a span holds: ``width`` columns; ``per_step``, the bytes a
    sample holds per row (rev) or tangent (fwd), measured, or ``None`` for the footprint's
    estimate; ``tangent``, what each forward tangent adds (``0`` in rev); ``held``, what a
    structured pass holds per sample whatever its tangents (all three:
    :func:`~multiscale_jac._memory.engine_sample`); ``survey``, what planning's structured
    pass of the span's tensors held (:func:`~multiscale_jac._memory.engine_survey`)."""

    width: int
    per_step: int | None
    tangent: int = 0
    held: int = 0
    survey: int = 0


def plan_chunks(
    group: Group,
    mode: Mode,
    step: Step,
    chunk_size: int | None,
    available: int | None,
    like: Tensor,
) -> Plan:
    """Choose samples per call and rows/tangents per step for one group (and, in fwd, one
    tensor's tangents).

    Args:
        group: The group (its samples and footprint).
        mode: ``rev`` or ``fwd``.
        step: The span's :class:`Step` (its ``width``: P in rev, the span's columns in fwd).
        chunk_size: Samples per call fixed by the caller, or ``None``.
        available: Bytes left under the caller's ``memory_budget`` after the result, or
            ``None`` for no budget (then a default working-set target is used).
        like: A selected value: the Jacobian's itemsize, and where it runs (the default target).

    Raises:
        ValueError: ``available`` is below one sample with one row/tangent (callers check that
            first, to report the minimum over all buckets).
    """
    fp, bucket_size = group.footprint, len(group.indices)
    itemsize, device = like.element_size(), like.device
    numel, per_step, tangent, held, _ = step
    rev = mode is Mode.REV
    full_inner = fp.outputs if rev else numel  # rows (O) or tangents of a sample
    bound = available is not None  # under a budget: the bound, not the estimate

    def sample(inner: int, bound: bool) -> int:
        return engine_sample(fp, rev, numel, itemsize, inner, per_step, bound, tangent, held)

    full = sample(full_inner, bound)
    if available is None:
        target = default_workset(device)
        n = chunk_size or max(1, target // max(full, 1))
        return Plan(min(n, bucket_size), None)
    n = chunk_size or max(1, available // max(full, 1))
    n = min(n, bucket_size)
    if engine_call(full, n) <= available:
        return Plan(n, None)
    one = sample(1, True)
    step_bytes = one - sample(0, True)
    inner = (available // n - (one - step_bytes)) // max(step_bytes, 1)
    if inner < 1:  # the caller checks the minimum first
        raise ValueError(f"memory_budget too small for {n} sample(s) with one row/tangent each")
    return Plan(n, int(min(inner, full_inner)))


def call_bytes(group: Group, mode: Mode, step: Step, plan: Plan, itemsize: int, bound: bool) -> int:
    """The working set of one vectorised call of ``group`` as ``plan`` runs it
    (:func:`~multiscale_jac._memory.engine_call`; ``bound``: under a ``memory_budget``)."""
    rev = mode is Mode.REV
    inner = plan.inner or (group.footprint.outputs if rev else step.width)
    fp = group.footprint
    sample = engine_sample(
        fp, rev, step.width, itemsize, inner, step.per_step, bound, step.tangent, step.held
    )
    return engine_call(sample, plan.samples)


#: Pricing constants every machine shares: a structured forward entry's work per unit against
#: a generic one's (:func:`choose_mode`), and the least elements of a tensor whose reverse
#: entries run structured under ``entries="auto"`` (:func:`rev_structured`)
PRICING = {"structured_factor": 3.0, "rev_structured_min_numel": 4096}


def estimate_seconds(groups: list[tuple[int, int, Footprint]], plan: VectorPlan) -> float:
    """Expected time of running every group ``(samples, samples per call, footprint)`` as
    ``plan`` does (its mode, P, device, dtype and forward passes per call), priced on this
    machine (:func:`~multiscale_jac._calibration.machine`) from the work one sample's forward
    pass dispatched (``W``: its ops, flops and elements written):

    - ``rev``: ``calls * (call_s(W, fwd) + call_s(W, vjp)) + samples * (1 + 2 O) * work_s(W)``
    - ``fwd``: ``calls * passes * call_s(W, jvp) + samples * (passes + P) * work_s(W)``

    where ``call_s(W, pass)`` is a vectorised call's set-up and its ops' dispatch and
    ``work_s(W)`` its flops and elements at the machine's rates (a row's backward pass about
    twice the forward's work, a tangent at most once); plus writing the ``(O, P)`` result of
    every sample.

    A padded group's work is its masked pass's (the masking ops counted): it needs no
    factor of its own."""
    m = machine(plan.device, plan.dtype)
    total = 0.0
    for samples, per_call, fp in groups:
        calls, w = -(-samples // per_call), fp.work
        total += samples * fp.outputs * plan.numel * m.elem_s  # the result's entries
        if plan.mode is Mode.REV:
            total += calls * (m.overhead(w, "fwd") + m.overhead(w, "vjp"))
            total += m.pass_seconds(w, samples * (1 + 2 * fp.outputs))
        else:
            passes = len(plan.spans)
            total += calls * passes * m.overhead(w, "jvp")
            total += m.pass_seconds(w, samples * (passes + plan.numel))
    return total


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
    #: elements the structured pass held whatever its tangents (entry layers' unfolded inputs)
    held: int = 0


def survey(
    fn: PerSampleFunction, values: tuple[Tensor, ...], levels: tuple[Tensor, ...]
) -> dict[str, EntryCost]:
    """:class:`EntryCost` of every selected tensor (one primal forward pass each)."""
    COUNTS["survey"] += 1
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
                held = rec.get("held", 0)
                costs[name] = EntryCost(None, rec.get("dense_work", 0), reason=str(err), held=held)
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
                rec["held"],
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
    work: Work = NO_WORK,
    calls: dict[str, int] | None = None,
    dtype: torch.dtype = torch.float32,
    fwd_calls: dict[str, tuple[int, int]] | None = None,
) -> tuple[Mode, tuple[str, ...], dict[str, float]]:
    """Pick ``rev``/``fwd`` (when ``mode`` is ``auto``) and the tensors that run structured,
    by the cost model of ``docs/entries.md`` on the :func:`survey`'s per-tangent work, the
    forward pass's ``work`` (ops, flops and elements of one sample) and each mode's
    vectorised ``calls`` (default: one a selected tensor in fwd, one in rev; ``fwd_calls``:
    per tensor, its span's fwd calls with generic and with structured entries), priced on this
    machine (:func:`~multiscale_jac._calibration.machine`).

    Returns the mode, the structured tensors (in fwd: those whose structured tangent, priced
    at ``structured_factor`` times its work and elements, is cheaper, and of which at most a
    quarter is selected: on tensors
    selected whole, structured forward entries ran 1.2-3.7x slower than generic ones; in rev:
    :func:`rev_structured`; the caller keeps weight entries) and the estimates in seconds
    (keys ``fwd``, ``rev``).
    """
    slow, sizes = PRICING["structured_factor"], tensor_numel or {}
    m, passes = machine(device, dtype), len(costs)

    def tangent(ec: EntryCost, structured: bool) -> float:
        """One tangent's work (multiply-adds, as flops) and the elements it writes."""
        if structured:
            return slow * m.work_seconds(2 * ec.structured, ec.structured_elems or 0)  # type: ignore[operator]
        return m.work_seconds(2 * ec.generic, ec.generic_elems or 0)

    use = {  # (a tensor selected whole or densely: its generic tangents run faster)
        n: ec.structured is not None
        and entries is not Entries.GENERIC
        and (
            entries is Entries.STRUCTURED
            or (tangent(ec, True) < tangent(ec, False) and numel[n] * 4 <= sizes.get(n, 0))
        )
        for n, ec in costs.items()
    }

    fwd_work = sum(numel[n] * (tangent(ec, use[n]) + outputs * m.elem_s) for n, ec in costs.items())
    # a row's backward: about twice the generic tangent's work of the earliest selected tensor
    dense = max((tangent(ec, False) for ec in costs.values()), default=0.0)
    rev_work = outputs * (2 * dense + sum(numel.values()) * m.elem_s)
    calls = calls or {"fwd": passes, "rev": 1}
    n_fwd = calls["fwd"]
    if fwd_calls is not None:
        n_fwd = sum(fwd_calls[n][1] if use[n] else fwd_calls[n][0] for n in costs)
    est = {  # every fwd pass (one a selected tensor) runs the primal forward pass again
        "fwd": n_fwd * m.overhead(work, "jvp")
        + samples * (m.pass_seconds(work, passes) + fwd_work),
        "rev": calls["rev"] * (m.overhead(work, "fwd") + m.overhead(work, "vjp"))
        + samples * (m.pass_seconds(work) + rev_work),
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
    del device  # (the rule is the same on every device)
    big = PRICING["rev_structured_min_numel"]
    return tuple(n for n in names if entries is Entries.STRUCTURED or tensor_numel.get(n, 0) >= big)


# ---------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Group:
    """Samples that run through one vectorised function (a bucket, or the whole padded batch).

    ``levels(idx)`` gives the vmapped level tensors of samples ``idx``; ``footprint`` is measured
    on the first sample; ``table`` (padded only) ``(N, O_pad)`` marks the real output rows of
    every sample, which are compacted to the top; ``chunks`` are planned last.
    """

    indices: list[int]
    fn: Callable[..., Tensor]
    levels: Callable[[list[int]], list[Tensor]]
    footprint: Footprint
    table: Tensor | None = None
    chunks: tuple[Plan, ...] = ()  # rev: one; fwd: one per tangent span


@dataclass(frozen=True)
class VectorPlan:
    """How a vectorised strategy runs every group."""

    strategy: Strategy
    mode: Mode
    groups: list[Group]
    spans: list[tuple[int, int]]  # column spans with their own forward pass (fwd)
    sizes: tuple[int, ...]  # O of every sample
    numel: int
    device: torch.device
    structured: tuple[str, ...] = ()  # tensors run by the structured path
    #: the working set of its largest vectorised call (:func:`call_bytes`); ``0`` where not
    #: planned (a replayed decision)
    workset: int = 0
    dtype: torch.dtype = torch.float32


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
    p = _planned(fn, packed, strategy, options, notes, options.memory_budget is not None)
    measured, sizes, mode, structured, rev_fn, spans, steps = p
    available = _available(fn, measured, sizes, mode, steps, options)
    like = fn.values()[0]
    groups = [
        dataclasses.replace(
            m,
            fn=rev_fn if m.fn is fn else m.fn,
            chunks=tuple(
                plan_chunks(m, mode, step, options.chunk_size, available, like) for step in steps
            ),
        )
        for m in measured
    ]
    itemsize, bound = like.element_size(), available is not None
    workset = max(
        call_bytes(g, mode, step, chunk, itemsize, bound)
        for g in groups
        for step, chunk in zip(steps, g.chunks)
    )
    return VectorPlan(
        strategy,
        mode,
        groups,
        spans,
        tuple(sizes),
        fn.subset.numel,
        fn.device,
        structured,
        workset,
        like.dtype,
    )


def _planned(
    fn: PerSampleFunction,
    packed: PackedBatch,
    strategy: Strategy,
    options: EngineOptions,
    notes: list[str],
    bound: bool,
) -> tuple[list[Group], list[int], Mode, tuple[str, ...], Any, list[tuple[int, int]], list[Step]]:
    """What :func:`plan_strategy` and :func:`engine_minimum` both plan: the measured groups,
    every sample's ``O``, the mode, the structured tensors, the reverse function, the tangent
    spans and each step's bytes (``bound``: under a budget, footprints of a structured route
    measured on its own forward and the reverse step's bound)."""
    measured, sizes = _measure_groups(fn, packed, strategy)
    mode, structured, costs = _pick_mode(fn, measured, sizes, strategy, options, notes)
    rev_fn = StructuredFunction(fn, structured) if mode is Mode.REV and structured else fn
    if bound:
        measured = _bounded_footprints(rev_fn, measured, packed)
    spans = tangent_groups(fn.subset, mode, options.randomness)
    steps = _steps(fn, measured, mode, spans, structured, costs, bound)
    return measured, sizes, mode, structured, rev_fn, spans, steps


def _measure_groups(
    fn: PerSampleFunction, packed: PackedBatch, strategy: Strategy
) -> tuple[list[Group], list[int]]:
    """The groups with the footprint of their first sample, and every sample's ``O``."""
    groups, values = _bare_groups(fn, packed, strategy), fn.values()
    if strategy is Strategy.PADDED:
        pfn = groups[0].fn
        index = torch.tensor(0, device=packed.device)
        fp = measure(pfn, values, (*(t[0] for t in packed.levels), index))
        table = pfn.output_table
        sizes = [int(o) for o in table.sum(dim=1).tolist()]
        return [dataclasses.replace(groups[0], footprint=fp, table=table)], sizes
    sizes = [0] * len(packed)
    measured = []
    for g in groups:
        fp = measure(fn, values, tuple(lv[0] for lv in packed.stack(g.indices[:1])))
        for i in g.indices:
            sizes[i] = fp.outputs
        measured.append(dataclasses.replace(g, footprint=fp))
    return measured, sizes


def _bounded_footprints(rev_fn: Any, measured: list[Group], packed: PackedBatch) -> list[Group]:
    """Under a ``memory_budget``: the footprints of a structured reverse route measured on the
    structured forward itself, which saves its layers' unfolded inputs besides the plain
    forward's tensors (a 3x3 conv's unfold: nine times its input). Padded groups, and routes
    with nothing structured, keep theirs."""
    if not isinstance(rev_fn, StructuredFunction):
        return measured
    values = rev_fn.fn.values()
    return [
        m
        if m.fn is not rev_fn.fn
        else dataclasses.replace(
            m,
            footprint=_largest(
                m.footprint,
                measure(rev_fn, values, tuple(lv[0] for lv in packed.stack(m.indices[:1]))),
            ),
        )
        for m in measured
    ]


def _largest(a: Footprint, b: Footprint) -> Footprint:
    return Footprint(
        max(a.activations, b.activations), max(a.largest, b.largest), a.outputs, a.depth, a.work
    )


def _bare_groups(fn: PerSampleFunction, packed: PackedBatch, strategy: Strategy) -> list[Group]:
    """The groups of a strategy before anything is measured (no footprint, no chunks)."""
    if strategy is not Strategy.PADDED:
        return [Group(b.indices, fn, packed.stack, _UNMEASURED) for b in packed.buckets()]
    device = packed.device

    def padded_levels(idx: list[int]) -> list[Tensor]:
        it = torch.tensor(idx, device=device)
        return [t.index_select(0, it) for t in packed.levels] + [it]

    return [Group(list(range(len(packed))), PaddedFunction(fn, packed), padded_levels, _UNMEASURED)]


def _pick_mode(
    fn: PerSampleFunction,
    measured: list[Group],
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
    structurable = tuple(n for n, ec in costs.items() if ec.structured is not None)
    fwd_generic = _calls(fn, measured, Mode.FWD, costs, options)
    fwd_structured = _calls(fn, measured, Mode.FWD, costs, options, structurable)
    chosen, structured, est = choose_mode(
        costs,
        numel={name: fn.subset.offsets[name][1] - fn.subset.offsets[name][0] for name in costs},
        outputs=sum(sizes) / n,
        samples=n,
        mode=mode,
        entries=entries if per_tensor else Entries.GENERIC,
        device=device,
        tensor_numel=tensor_numel,
        work=measured[0].footprint.work,
        calls={"fwd": sum(fwd_generic), "rev": sum(_calls(fn, measured, Mode.REV, costs, options))},
        fwd_calls=_per_tensor(fn.subset.names, fwd_generic, fwd_structured),
        dtype=fn.values()[0].dtype,
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


def _calls(
    fn: PerSampleFunction,
    measured: list[Group],
    mode: Mode,
    costs: dict[str, EntryCost],
    options: EngineOptions,
    structured: tuple[str, ...] = (),
) -> list[int]:
    """The vectorised calls a plan of ``mode`` makes without a budget, per step (generic
    entries but ``structured``; in fwd one step a tangent span): the memory model's samples
    per call, which a wide reverse step, or a generic forward tangent of a whole tensor, can
    bring down to one."""
    spans = tangent_groups(fn.subset, mode, options.randomness)
    like = fn.values()[0]
    return [
        sum(
            -(-len(g.indices) // plan_chunks(g, mode, step, options.chunk_size, None, like).samples)
            for g in measured
        )
        for step in _steps(fn, measured, mode, spans, structured, costs, False)
    ]


def _per_tensor(
    names: tuple[str, ...], generic: list[int], structured: list[int]
) -> dict[str, tuple[int, int]] | None:
    """Per selected tensor, the fwd calls of its tangent span with generic and with
    structured entries (``None`` where the spans are not one per tensor)."""
    if len(generic) != len(names) or len(structured) != len(names):
        return None
    return {n: (g, s) for n, g, s in zip(names, generic, structured, strict=True)}


def _steps(
    fn: PerSampleFunction,
    measured: list[Group],
    mode: Mode,
    spans: list[tuple[int, int]],
    structured: tuple[str, ...],
    costs: dict[str, EntryCost],
    bound: bool,
) -> list[Step]:
    """The :class:`Step` of each span: rev, one output row of all P columns (``bound``: under
    a ``memory_budget``, :func:`~multiscale_jac._memory.engine_rev_step`); fwd, one tangent of
    one span (measured by the survey where it ran, else ``None``: the footprint estimate),
    with its one-hot and, for generic entries of tensors selected by index, the tangents of
    the whole tensors (:func:`~multiscale_jac._memory.engine_tangent`)."""
    itemsize = fn.values()[0].element_size()
    if mode is Mode.REV:
        # each row's backward also holds the full gradient of every generic selected tensor
        dense = sum(
            fn.params[name].numel()
            for name in fn.subset.names
            if name not in structured and fn.subset.indices[name] is not None
        )
        fp = Footprint(
            max(m.footprint.activations for m in measured),
            max(m.footprint.largest for m in measured),
            max(m.footprint.outputs for m in measured),
        )
        step = engine_rev_step(fp, fn.subset.numel, dense, itemsize, bound)
        survey = tensor_bytes(max((c.held for c in costs.values()), default=0), itemsize)
        return [Step(fn.subset.numel, step, survey=survey)]
    steps: list[Step] = []
    offsets = fn.subset.offsets
    for lo, hi in spans:
        name = span_tensor(fn.subset, (lo, hi))
        cost = costs.get(name) if name is not None else None
        elems = None
        if cost is not None:
            elems = cost.structured_elems if name in structured else cost.generic_elems
        whole = sum(  # the generic tensors of the span selected by index
            fn.params[t].numel()
            for t in fn.subset.names
            if lo <= offsets[t][0] and offsets[t][1] <= hi
            and t not in structured
            and fn.subset.indices[t] is not None
        )  # fmt: skip
        per_step = None if elems is None else tensor_bytes(elems, itemsize)
        survey = tensor_bytes(cost.held if cost is not None else 0, itemsize)
        held = survey if name in structured else 0
        tangent = engine_tangent(hi - lo, whole, itemsize)
        steps.append(Step(hi - lo, per_step, tangent, held, survey))
    return steps


def _available(
    fn: PerSampleFunction,
    measured: list[Group],
    sizes: list[int],
    mode: Mode,
    steps: list[Step],
    options: EngineOptions,
) -> int | None:
    """Bytes left under ``memory_budget`` after the result (``None`` without a budget).

    Raises:
        MemoryBudgetError: the budget is below the result plus one sample with one row/tangent.
    """
    budget, chunk_size = options.memory_budget, options.chunk_size
    if budget is None:
        return None
    result_bytes, need = _least(fn, measured, sizes, mode, steps, chunk_size)
    dtype = fn.params[fn.subset.names[0]].dtype
    n, numel = len(sizes), fn.subset.numel
    unit = "output row" if mode is Mode.REV else "tangent"
    per_call = f"{chunk_size} samples" if chunk_size not in (None, 1) else "one sample"
    detail = (
        f"the result {(n, max(sizes), numel)} ({dtype}) and its outputs take "
        f"{result_bytes} bytes and {per_call} with one {unit} at a time needs {need}"
    )
    return fit_budget(budget, result_bytes, need, detail).left


def _least(
    fn: PerSampleFunction,
    measured: list[Group],
    sizes: list[int],
    mode: Mode,
    steps: list[Step],
    chunk_size: int | None,
) -> tuple[int, int]:
    """The result's bytes and the least working set: one call of the smallest allowed size,
    one row/tangent at a time (:mod:`~multiscale_jac._memory`)."""
    itemsize = fn.values()[0].element_size()
    numel = fn.subset.numel
    result_bytes = engine_result(len(sizes), max(sizes), numel, itemsize)
    rev = mode is Mode.REV
    need = max(
        max(
            engine_call(
                engine_sample(
                    m.footprint, rev, s.width, itemsize, 1, s.per_step, True, s.tangent, s.held
                ),
                min(chunk_size or 1, len(m.indices)),
            ),
            engine_survey(m.footprint, s.survey),
        )
        for m in measured
        for s in steps
    )
    return result_bytes, need


def engine_minimum(
    fn: PerSampleFunction, packed: PackedBatch, strategy: Strategy, options: EngineOptions
) -> int:
    """The least ``memory_budget`` the engine runs ``packed`` with under ``strategy`` (what a
    :class:`MemoryBudgetError` states): planned as :func:`plan_strategy` plans, without
    running it."""
    measured, sizes, mode, _, _, _, steps = _planned(fn, packed, strategy, options, [], True)
    return sum(_least(fn, measured, sizes, mode, steps, options.chunk_size))


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
    except (UnsupportedOpError, MemoryBudgetError, RuntimeError) as err:
        why = str(err)
        if isinstance(err, RuntimeError):  # the planning pass itself failed
            why = f"{type(err).__name__} in its planning pass: {first_line(err)}"
        return chose(
            Strategy.BUCKETED, f"auto: 'padded' not possible ({why}); chose 'bucketed'", bucketed
        )
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
        outputs=max(g.footprint.outputs for g in bucketed.groups),
        work=max((g.footprint.work for g in bucketed.groups), key=lambda w: w.flops),
    )
    n = len(bucketed.sizes)
    return estimate_seconds([(n, n, largest)], bucketed)


def plan_seconds(plan: VectorPlan) -> float:
    """The cost model's estimate of a plan (:func:`estimate_seconds`)."""
    groups = [(len(g.indices), min(c.samples for c in g.chunks), g.footprint) for g in plan.groups]
    return estimate_seconds(groups, plan)


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
    return next((name for name in subset.names if subset.offsets[name] == span), None)


def first_line(err: BaseException) -> str:
    """The first line of an error's message (at most 200 characters), for notes, and where it
    was raised if a rule mode recorded it (``at Tensor.view in module 'head'``)."""
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    line = line if len(line) <= 200 else line[:197].rstrip() + "..."
    at = getattr(err, AT, None)
    return f"{line} (at {at})" if at else line


# ---------------------------------------------------------------------- the plan cache
@dataclass(frozen=True)
class Decision:
    """A plan without its data: what :data:`PLAN_CACHE` keeps, replayed by :func:`replay` on
    inputs of the same shapes with no forward pass."""

    strategy: Strategy
    mode: Mode
    structured: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    groups: tuple[tuple[Footprint, Tensor | None, tuple[Plan, ...]], ...]
    notes: tuple[str, ...]


def decision(plan: VectorPlan, structured: tuple[str, ...], notes: list[str]) -> Decision:
    """What to keep of a plan that ran (``structured``: what ran structured in the end)."""
    groups = tuple((g.footprint, g.table, g.chunks) for g in plan.groups)
    spans = tuple(plan.spans)
    return Decision(plan.strategy, plan.mode, structured, spans, plan.sizes, groups, tuple(notes))


def loop_decision(sizes: tuple[int, ...], fallbacks: list[str]) -> Decision:
    """The loop, kept for shapes on which a vectorised route failed (``fallbacks``: why, kept
    as the decision's notes: a later call records them again)."""
    return Decision(Strategy.LOOP, Mode.REV, (), (), sizes, (), tuple(fallbacks))


def replay(fn: PerSampleFunction, packed: PackedBatch, d: Decision) -> VectorPlan:
    """The plan of ``d`` for ``packed`` (same shapes): no measurement, no survey."""
    rev_fn = StructuredFunction(fn, d.structured) if d.mode is Mode.REV and d.structured else fn
    groups = []
    for g, (fp, table, chunks) in zip(_bare_groups(fn, packed, d.strategy), d.groups):
        if table is not None:
            g.fn.output_table = table  # type: ignore[attr-defined]
        fn_g = rev_fn if g.fn is fn else g.fn
        groups.append(dataclasses.replace(g, fn=fn_g, footprint=fp, table=table, chunks=chunks))
    structured = d.structured if d.mode is Mode.FWD else StructuredFunction(fn, d.structured).names
    return VectorPlan(
        d.strategy,
        d.mode,
        groups,
        list(d.spans),
        d.sizes,
        fn.subset.numel,
        fn.device,
        structured,
        dtype=fn.values()[0].dtype,
    )


def plan_key(fn: PerSampleFunction, packed: PackedBatch, options: EngineOptions) -> Any:
    """What a plan depends on: the model's structure (modules, flags, parameter and buffer
    shapes, not their values), the inputs' shapes and dtypes, the subset, the options and the
    output function; ``None`` when it cannot be keyed (an output function without weak
    references)."""
    model = fn.model
    try:
        output_fn = None if fn.output_fn is None else weakref.ref(_user_fn(fn.output_fn))
    except TypeError:
        return None
    modules = tuple((n, type(m), m.training, module_config(m)) for n, m in model.named_modules())
    tensors = tuple(
        (n, tuple(t.shape), t.dtype, t.device)
        for n, t in (*model.named_parameters(), *model.named_buffers())
    )
    levels = tuple((t.shape[1:2], t.dtype) for t in packed.levels)
    inputs = (packed.structure, packed.layout, packed.signatures, levels, packed.device)
    flags = (fn.eval_batch_norm, fn.tokens, repr(sorted(fn.model_kwargs.items())))
    return (modules, tensors, inputs, subset_key(fn.subset), options, output_fn, flags)


def module_config(module: torch.nn.Module) -> tuple[tuple[str, Any], ...]:
    """A module's own settings: its public attributes of plain values (a convolution's stride,
    padding, dilation, groups; an activation's flags; a user module's options), which shape
    its outputs as much as its parameters do."""
    plain = (int, float, str, bool, type(None))

    def is_plain(v: Any) -> bool:
        return isinstance(v, plain) or (isinstance(v, tuple) and all(is_plain(x) for x in v))

    return tuple(
        sorted((k, v) for k, v in vars(module).items() if not k.startswith("_") and is_plain(v))
    )


def subset_key(subset: ParamSubset) -> Any:
    """A subset as a hashable key (names, selected entries and column order)."""
    selection = tuple(
        (n, None if i is None else tuple(i.tolist())) for n, i in subset.indices.items()
    )
    return selection, None if subset.columns is None else tuple(subset.columns.tolist())


def _user_fn(output_fn: Any) -> Any:
    """The user's function behind the library's wrappers (they are made per call)."""
    return getattr(output_fn, "user", None) or output_fn
