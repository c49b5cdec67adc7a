"""Per-sample Jacobians w.r.t. a parameter subset: the vectorised engine.

Strategies (:class:`~multiscale_jac.enums.Strategy`; what each runs and falls back to is tabled
in ``docs/design.md``): ``vmap``, ``bucketed`` (``vmap`` per shape-signature bucket),
``padded`` (one ``vmap`` over the padded batch under ``masked.MaskedMode``), ``loop`` (the
reference, always runs) and ``auto`` (planned in ``_planning``). A fallback is recorded on the
result (``result.strategy``, ``result.fallback``) and :func:`per_sample_jacobian` warns once
(:class:`~multiscale_jac.FallbackWarning`, at the caller's line); with ``strict=True`` it raises
instead. The derived quantities call :func:`run_engine` with inputs they have already checked
and report its fallbacks the same way.

Modes: ``rev`` vmaps ``jacrev`` (one backward per output row, batched); ``fwd`` vmaps JVPs with
one-hot tangents, one parameter tensor at a time (a tangent on a deep tensor does not travel
through the layers before it); ``auto`` picks ``fwd`` when P is smaller than the (mean) number
of outputs per sample, else ``rev``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import jacrev, jvp, vmap

from ._calibration import machine
from ._checks import (
    check_bool,
    check_chunk_size,
    check_memory_budget,
    prepare,
    warn_fallback,
)
from ._loop import sample_loop
from ._plan_cache import COUNTS, PLAN_CACHE
from ._plan_cache import clear as clear_plans
from ._planning import (
    EngineOptions,
    VectorPlan,
    choose_strategy,
    decision,
    default_workset,
    first_line,
    loop_decision,
    plan_key,
    plan_seconds,
    plan_strategy,
    replay,
    span_tensor,
)
from ._tuning import Route, decided, tune
from ._tuning import clear as clear_decisions
from ._work import count_work
from .adapter import PerSampleFunction
from .entries import NotStructuredError, entry_call
from .enums import (
    BatchNormPolicy,
    Entries,
    InputKind,
    MemoryBudgetError,
    Mode,
    Randomness,
    Strategy,
    Tune,
    UnsupportedOpError,
    parse_enum,
    parse_tune,
)
from .packing import PackedBatch
from .result import JacobianResult, output_mask_from_sizes
from .rows import clear_row_cache
from .subset import ParamSubset

__all__ = [
    "PlanCacheInfo",
    "clear_plan_cache",
    "per_sample_jacobian",
    "plan_cache_info",
    "run_engine",
]


class PlanCacheInfo(NamedTuple):
    """The engine's plan cache (``plan_cache_info()``): ``hits`` and ``misses`` of lookups,
    ``size`` entries of at most ``maxsize``, and how often planning ran a measuring forward
    pass (``measured``), a structured survey (``surveyed``) and a route probe (``probed``)
    since the process started or the cache was cleared."""

    hits: int
    misses: int
    size: int
    maxsize: int
    measured: int
    surveyed: int
    probed: int


def plan_cache_info() -> PlanCacheInfo:
    """The state of the engine's process-wide plan cache (see :func:`clear_plan_cache`)."""
    c = PLAN_CACHE
    return PlanCacheInfo(
        c.hits, c.misses, len(c), c.maxsize, COUNTS["measure"], COUNTS["survey"], COUNTS["probe"]
    )


def clear_plan_cache() -> None:
    """Forget every cached plan and reset the counters of :func:`plan_cache_info`.

    The engine keeps, process-wide, the decisions it took (strategy, mode, structured
    tensors, chunks, measured sizes) for each model (held weakly: never kept alive by the
    cache) and call signature (the model's structure, the inputs' shapes, the subset, the
    options), at most ``maxsize`` of them, least recently used first out; a second call with
    the same shapes pays no planning pass, survey or timing. The layer-wise rules' measured
    convolution kernels (per layer and size class, the layer held weakly) go too. It is state
    of the kind torch keeps for cuDNN autotuning; nothing is stored on the model. Decisions
    read from a file (:func:`multiscale_jac.tuning.load`) go too, and so do the row rules'
    kept results (:mod:`multiscale_jac.rows`: which sample each row of a layer belongs to, by
    op, shapes and owners; plain data, at most 8,192 entries) and the pure followed runs
    whose rows a later run with the same calls takes over (:mod:`multiscale_jac._row_replay`).
    """
    clear_plans()
    clear_decisions()
    clear_row_cache()


def per_sample_jacobian(
    model: nn.Module,
    inputs: Any,
    *,
    params: ParamSubset | str | list[str] | None = None,
    output_fn: Callable[[Any], Any] | None = None,
    mode: str | Mode = "auto",
    strategy: str | Strategy = "auto",
    entries: str | Entries = "auto",
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    randomness: str | Randomness = "error",
    batch_norm: str | BatchNormPolicy = "error",
    strict: bool = False,
    input_kind: str | InputKind | None = None,
    tune: str | bool | Tune = "auto",
) -> JacobianResult:
    """Per-sample Jacobians of ``model``'s outputs w.r.t. a subset of its parameters.

    Options shared with the other entry points mean the same everywhere (the options table in
    ``docs/design.md``).

    Args:
        model: Any ``nn.Module``; called unmodified on each sample as a batch of one.
        inputs: Anything :func:`~multiscale_jac.pack` accepts, or a ``PackedBatch``.
        params: A :class:`ParamSubset`, a parameter name/glob or a list of them; default all.
        output_fn: Applied to the model's output (batch dim of one kept) before flattening,
            e.g. to reduce it.
        mode: ``"auto"``, ``"rev"`` or ``"fwd"``.
        strategy: ``"auto"``, ``"vmap"``, ``"bucketed"``, ``"padded"`` or ``"loop"``.
        entries: ``"auto"``, ``"structured"`` or ``"generic"``: how columns of conv/linear
            weights and biases are computed (:class:`~multiscale_jac.Entries`); ``auto`` picks
            per tensor by the cost model. The result's ``structured`` lists what ran
            structured.
        chunk_size: Samples per vectorised call (``1`` runs the samples one by one through
            the same code path). Default: from ``memory_budget`` or a working-set target.
        memory_budget: Bytes the computation may use, including the returned Jacobian; picks
            samples per call and output rows/tangents per step (estimate in ``docs/design.md``).
        randomness: ``"error"``, ``"different"`` or ``"same"``, for random ops such as dropout in
            train mode, as in ``torch.func.vmap``.
        batch_norm: ``"error"`` or ``"eval"``: what to do with BatchNorm layers in train mode.
        strict: Raise instead of falling back to another strategy.
        input_kind: How to read ``inputs`` where it is ambiguous (see
            :func:`~multiscale_jac.pack`).
        tune: How ``auto`` choices are made (:class:`~multiscale_jac.Tune`): ``auto``
            (default) prices the routes on this machine from the model's ops and flops, nothing
            timed (or runs a choice ``tune=True`` measured before for these shapes);
            ``measure`` (``True``) times every route on the run's first samples; ``estimate``
            (``False``) the cost model alone. The estimates and timings are on
            ``result.notes``.

    Returns:
        A :class:`JacobianResult`; ``.jacobian`` is ``(N, O, P)``, outputs padded to the largest
        ``O`` with ``.output_mask`` when samples have different output sizes; ``.outputs``
        ``(N, O)`` the outputs of the same pass. Columns are in the subset's flat order, the
        order the entries were given in.

    Raises:
        TypeError, ValueError: bad arguments (the message names the offending value);
            :class:`~multiscale_jac.MemoryBudgetError` for a budget below the minimum.
    """
    prep = prepare(
        model,
        inputs,
        params=params,
        output_fn=output_fn,
        batch_norm=batch_norm,
        randomness=randomness,
        input_kind=input_kind,
    )
    options = EngineOptions(
        mode=parse_enum(Mode, mode, "mode"),
        strategy=parse_enum(Strategy, strategy, "strategy"),
        entries=parse_enum(Entries, entries, "entries"),
        chunk_size=check_chunk_size(chunk_size),
        memory_budget=check_memory_budget(memory_budget),
        randomness=prep.randomness,
        strict=check_bool(strict, "strict"),
        tune=parse_tune(tune),
    )
    result = run_engine(prep.function(prep.packed), prep.packed, options)
    warn_fallback([result.fallback])
    return result


def run_engine(
    fn: PerSampleFunction, packed: PackedBatch, options: EngineOptions
) -> JacobianResult:
    """The engine on checked inputs (``packed`` on ``fn``'s device): plans, runs, falls back.

    Nothing is warned: a fallback is recorded on the result's ``fallback`` for the caller to
    report once (``options.strict`` raises instead).

    Raises:
        TypeError: the model failed on integer inputs (images not converted to float, token
            ids into a layer that does not take integers).
    """
    try:
        return _EngineRun(fn, packed, options).run()
    except RuntimeError as err:
        ints = [(lvl, t.dtype) for lvl, t in enumerate(packed.levels) if not t.is_floating_point()]
        if not ints or "strict=True" in str(err):
            raise
        lvl, dtype = ints[0]
        raise TypeError(
            f"the model failed on the inputs, and level {lvl} holds integer data ({dtype}): "
            f"{first_line(err)}. Convert images to floating point (x.float()); integer inputs "
            "(token ids, class maps) are passed as data, for a layer that takes them"
        ) from err


#: a job whose loop is estimated to take less (seconds) runs its cheapest plan: no survey,
#: no padded plan (planning would cost more than it saves; :meth:`_EngineRun.small_job`)
SMALL_JOB_S = 0.1
#: ... unless planning (a forward pass per selected tensor and per shape bucket) is estimated
#: to cost at most this share of that loop
PLANNING_SHARE = 0.1
#: ``tune=True`` times each route on this many samples of the largest bucket (or the batch)
PROBE_SAMPLES = 8


class _RouteTiming:
    """``tune=True``: every route ``auto`` chooses between, timed on the run's first samples."""

    fn: PerSampleFunction
    packed: PackedBatch
    options: EngineOptions
    notes: list[str]
    key: Any
    trial: dict[tuple[Strategy, Mode, Entries], VectorPlan] | None

    def candidates(self, ran: Strategy, plan: VectorPlan) -> None:
        """Under ``tune=True``, plan every route that can (strategy x mode x entries), the
        estimate's choice first, for :meth:`try_routes`."""
        o = self.options
        if o.tune is not Tune.MEASURE:
            return
        ragged = o.strategy is Strategy.AUTO and len(self.packed.buckets()) > 1
        strategies = [Strategy.BUCKETED, Strategy.PADDED] if ragged else [ran]
        modes = [Mode.REV, Mode.FWD] if o.mode is Mode.AUTO else [plan.mode]
        both = o.entries is Entries.AUTO and plan.structured
        entries = [o.entries, Entries.GENERIC] if both else [o.entries]
        plans = {(ran, plan.mode, o.entries): plan}
        for key in [(s, m, e) for s in strategies for m in modes for e in entries]:
            with contextlib.suppress(RuntimeError, UnsupportedOpError, MemoryBudgetError):
                route = dataclasses.replace(o, mode=key[1], entries=key[2])
                if key not in plans:
                    plans[key] = plan_strategy(self.fn, self.packed, key[0], route, [])
        self.trial = plans if len(plans) > 1 else None

    def try_routes(self) -> tuple[tuple[Tensor, Tensor], set[int], Strategy, VectorPlan]:
        """Time each route on the same first :data:`PROBE_SAMPLES` of the largest bucket (all
        singletons: the smallest samples), warmed up on one, their Jacobians kept; returns
        the result buffers, the samples done and the route chosen."""
        plans, self.trial = self.trial or {}, None
        into = _buffers(list(plans.values()), self.fn)
        bucket = max(self.packed.buckets(), key=lambda b: len(b.indices)).indices
        if len(bucket) == 1:
            sizes = [sum(t.numel() for t in self.packed.sample(i)) for i in range(len(self.packed))]
            bucket = sorted(range(len(self.packed)), key=sizes.__getitem__)
        idx = list(bucket[:PROBE_SAMPLES])

        def run(key: tuple[Strategy, Mode, Entries], only: list[int]) -> float | None:
            try:
                with torch.no_grad():
                    _fill(
                        plans[key], self.fn, self.options.randomness, [], into=into, only=set(only)
                    )
            except (RuntimeError, NotImplementedError) as err:
                self.notes.append(f"tune: {_route(key)} failed ({first_line(err)})")
                return None
            return len(only)

        first, p0 = next(iter(plans.items()))
        routes = [
            Route(
                _route(k), partial(run, k, idx), workset=p.workset, warm_up=partial(run, k, idx[:1])
            )
            for k, p in plans.items()
        ]
        routes[0].workset = max(p0.workset, default_workset(p0.device))
        chosen = tune("engine", self.key, routes, devices=[p0.device], notes=self.notes)
        best = next((k for k in plans if chosen and _route(k) == chosen.name), None)
        if best is None:  # every route failed on the data: the run meets the error again
            return into, set(), first[0], p0
        self.options = dataclasses.replace(self.options, mode=best[1], entries=best[2])
        return into, set(idx), best[0], plans[best]

    def recalled(self) -> tuple[Strategy, VectorPlan | None] | None:
        """The route ``tune=True`` chose before for these shapes, planned (``None``: none)."""
        chosen = None if self.options.tune is Tune.ESTIMATE else decided("engine", self.key)
        if chosen is None:
            return None
        strategy, mode, *entries = chosen[0].split("/")  # (as :func:`_route` names it)
        entry = Entries(entries[0] if entries else "auto")
        self.options = dataclasses.replace(self.options, mode=Mode(mode), entries=entry)
        self.notes.append(f"plan: {chosen[0]}, chosen by tune=True before for these shapes")
        return self.plan(Strategy(strategy))


def _vmap_failure(fn: PerSampleFunction, packed: PackedBatch, randomness: Randomness) -> str | None:
    """Why the model's forward pass does not run under ``vmap`` over samples (one sample, a
    batch of one under the transform: an in-place write of a sample's values into a tensor
    made inside the forward pass, data-dependent control flow), or ``None`` where it runs.
    A random op under ``randomness="error"`` is the caller's error to raise, not a failure."""
    levels = packed.stack([packed.buckets()[0].indices[0]])
    values = fn.values()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            vmap(lambda *lv: fn(values, *lv), randomness=randomness.value)(*levels)
    except (RuntimeError, NotImplementedError) as err:
        if "randomness" in str(err):
            return None
        return f"{type(err).__name__}: {first_line(err)}"
    return None


class _EngineRun(_RouteTiming):
    """One call: the strategy that runs, its plan, fallbacks and notes."""

    def __init__(self, fn: PerSampleFunction, packed: PackedBatch, options: EngineOptions) -> None:
        self.fn, self.packed, self.options = fn, packed, options
        self.requested = options  # ``options`` changes when mode 'fwd' turns out impossible
        self.fallbacks: list[str] = []
        self.notes: list[str] = []
        # ``tune=True`` and ``auto`` share plans: ``auto`` runs what ``tune=True`` chose
        shared = Tune.AUTO if options.tune is Tune.MEASURE else options.tune
        self.key = plan_key(fn, packed, dataclasses.replace(options, tune=shared))
        measure = options.tune is Tune.MEASURE and decided("engine", self.key) is None
        self.cached = None if measure else PLAN_CACHE.get(fn.model, self.key)
        #: the routes ``tune=True`` times on the first samples of the run (:meth:`try_routes`)
        self.trial: dict[tuple[Strategy, Mode, Entries], VectorPlan] | None = None

    def fall_back(self, why: str, to: Strategy | Mode, err: Exception | None = None) -> Any:
        instead = f"{to.value!r}" if isinstance(to, Strategy) else f"mode {to.value!r}"
        if self.options.strict:
            if isinstance(err, UnsupportedOpError):
                raise err
            if err is not None:
                raise RuntimeError(f"{why}; strict=True forbids running {instead} instead") from err
            raise ValueError(f"{why}; strict=True forbids running {instead} instead")
        self.fallbacks.append(f"{why}; ran {instead}")
        return to

    def first(self) -> tuple[Strategy, VectorPlan | None]:
        strategy, buckets = self.options.strategy, len(self.packed.buckets())
        if strategy is Strategy.VMAP and buckets > 1:
            why = f"strategy='vmap' needs one shape signature but the batch has {buckets}"
            return self.fall_back(why, Strategy.BUCKETED), None
        failure = None
        if strategy is not Strategy.PADDED:  # a padded route plans on its canvases, probed there
            failure = _vmap_failure(self.fn, self.packed, self.options.randomness)
        if failure is not None:  # planning a route that cannot run would cost more than the loop
            name = (Strategy.VMAP if buckets == 1 else Strategy.BUCKETED).value
            name = name if strategy is Strategy.AUTO else strategy.value
            why = f"strategy {name!r} failed: the model does not run under vmap ({failure})"
            return self.fall_back(why, Strategy.LOOP, RuntimeError(failure)), None
        if (recalled := self.recalled()) is not None:
            return recalled
        if self.small_job():
            if strategy is not Strategy.AUTO:
                return strategy, None
            return (Strategy.VMAP if buckets == 1 else Strategy.BUCKETED), None
        if strategy is Strategy.AUTO and buckets > 1:
            ran, plan = choose_strategy(self.fn, self.packed, self.options, self.notes)
        else:
            ran = Strategy.VMAP if strategy is Strategy.AUTO else strategy
            ran, plan = self.plan(ran)
        if plan is not None:
            self.candidates(ran, plan)
        return ran, plan

    def small_job(self) -> bool:
        """Unless ``tune=True``, a job whose loop is estimated under :data:`SMALL_JOB_S` (one
        forward pass of the largest sample, priced on this machine from the ops and flops it
        dispatched, times the samples and rows), where planning would cost more than
        :data:`PLANNING_SHARE` of it, runs its cheapest plan: no survey, no padded plan."""
        o = self.options
        free = [o.strategy is Strategy.AUTO, o.mode is Mode.AUTO, o.entries is Entries.AUTO]
        if o.tune is Tune.MEASURE or not any(free) or o.strategy is Strategy.PADDED:
            return False  # (padded asked for: the model sees padded samples only)
        levels = tuple(self.packed.sample(self.packed.largest_sample))
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out, work = count_work(lambda: self.fn.call(self.fn.params, levels))
        m = machine(self.fn.device, self.fn.values()[0].dtype)
        once = m.overhead(work, "fwd") + m.pass_seconds(work)
        rows = out.numel()
        loop = once * len(self.packed) * (1 + 2 * rows)
        planning = once * (len(self.fn.subset.names) + len(self.packed.buckets()))
        if loop >= SMALL_JOB_S or planning <= PLANNING_SHARE * loop:
            return False
        mode = o.mode
        if mode is Mode.AUTO:
            mode = Mode.FWD if self.fn.subset.numel < rows else Mode.REV
        entries = Entries.GENERIC if o.entries is Entries.AUTO else o.entries
        self.options = dataclasses.replace(o, mode=mode, entries=entries)
        self.notes.append(
            f"auto: a small job (the loop would take about {loop * 1e3:.0f} ms): mode "
            f"{mode.value!r}, {entries.value} entries, no survey"
        )
        return True

    def plan(self, ran: Strategy) -> tuple[Strategy, VectorPlan | None]:
        """Plan ``ran``; a padded strategy that cannot run falls back to ``bucketed``.
        Planning runs plain forward passes: a model that fails there fails in the loop too,
        except for ops the padded strategy has no rule for."""
        try:
            return ran, plan_strategy(self.fn, self.packed, ran, self.options, self.notes)
        except UnsupportedOpError as err:
            why = f"strategy 'padded' cannot run this model ({err})"
            return self.fall_back(why, Strategy.BUCKETED, err), None
        except RuntimeError as err:
            if ran is not Strategy.PADDED:
                raise
            why = (
                f"strategy 'padded' failed in its planning pass "
                f"({type(err).__name__}: {first_line(err)})"
            )
            return self.fall_back(why, Strategy.BUCKETED, err), None

    def failed(self, err: Exception, ran: Strategy, plan: VectorPlan) -> Strategy:
        """What runs after ``ran`` failed while running ``plan``."""
        if self.options.randomness is Randomness.ERROR and "randomness" in str(err):
            raise ValueError(
                "the model calls a random operation (e.g. functional dropout in train mode) "
                "while randomness='error'; put the model in eval mode or pass "
                "randomness='different' or 'same'"
            ) from err
        if plan.mode is Mode.FWD and "forward AD" in str(err):
            # an op without a forward-mode derivative (e.g. SDPA's fused CPU kernel)
            why = f"mode 'fwd' failed ({first_line(err)})"
            if self.requested.mode is Mode.AUTO:
                self.notes.append(f"auto: {why}; chose mode 'rev'")
            else:
                self.fall_back(why, Mode.REV, err)
            self.options = dataclasses.replace(self.options, mode=Mode.REV)
            return ran
        why = f"strategy {ran.value!r} failed ({type(err).__name__}: {first_line(err)})"
        return self.fall_back(
            why, Strategy.BUCKETED if ran is Strategy.PADDED else Strategy.LOOP, err
        )

    def run(self) -> JacobianResult:
        if self.cached is not None and self.cached.strategy is Strategy.LOOP:
            self.fallbacks = [
                f"{why} (on an earlier call with these shapes)" for why in self.cached.notes
            ]
            ran, plan = Strategy.LOOP, None
        elif self.options.strategy is Strategy.LOOP:  # asked for: nothing to plan
            ran, plan = Strategy.LOOP, None
        elif self.cached is not None:  # the same shapes ran before: no measuring, no planning
            ran, plan = self.cached.strategy, replay(self.fn, self.packed, self.cached)
            self.notes = [*self.cached.notes, "plan: cached (the same shapes ran before)"]
        else:
            ran, plan = self.first()
        into: tuple[Tensor, Tensor] | None = None
        done: set[int] = set()
        if self.trial:
            into, done, ran, plan = self.try_routes()
        while ran is not Strategy.LOOP:
            if plan is None or plan.strategy is not ran:
                ran, plan = self.plan(ran)
                if plan is None:
                    continue
            try:
                with torch.no_grad():
                    jac, outputs, structured = _fill(
                        plan, self.fn, self.options.randomness, self.notes, into=into, skip=done
                    )
            except (RuntimeError, NotImplementedError) as err:
                ran, plan = self.failed(err, ran, plan), None
                into, done = None, set()  # the next route fills everything
                continue
            chunks = [c for g in plan.groups for c in g.chunks]
            inner = [c.inner for c in chunks if c.inner is not None]
            extra = {
                "chunk_size": max(c.samples for c in chunks),
                "inner_chunk_size": min(inner) if inner else None,
                "structured": structured,
            }
            if self.cached is None:  # the cost model's price of the route that ran
                self.notes.append(
                    f"plan: {ran.value}/{plan.mode.value} estimated "
                    f"{plan_seconds(plan) * 1e3:.3g} ms on this machine"
                )
            if self.cached is None and not self.fallbacks:
                PLAN_CACHE.put(self.fn.model, self.key, decision(plan, structured, self.notes))
            return self.result(jac, outputs, plan.sizes, ran, plan.mode, **extra)
        jac, outputs, sizes = sample_loop(self.fn, self.packed, self.notes)
        if self.cached is None and self.fallbacks:
            # a route that failed on these shapes fails again: later calls go to the loop
            # (the fallback still recorded and warned on each: cached_loop)
            PLAN_CACHE.put(self.fn.model, self.key, loop_decision(sizes, self.fallbacks))
        return self.result(jac, outputs, sizes, Strategy.LOOP, Mode.REV)

    def result(
        self,
        jac: Tensor,
        outputs: Tensor,
        sizes: tuple[int, ...],
        strategy: Strategy,
        mode: Mode,
        **extra: Any,
    ) -> JacobianResult:
        return JacobianResult(
            jacobian=jac,
            output_mask=output_mask_from_sizes(sizes, jac.device),
            output_sizes=sizes,
            subset=self.fn.subset,
            strategy=strategy,
            mode=mode,
            requested_strategy=self.requested.strategy,
            requested_mode=self.requested.mode,
            fallback="; then ".join(self.fallbacks) or None,
            notes=tuple(self.notes),
            outputs=outputs,
            **extra,
        )


def _route(key: tuple[Strategy, Mode, Entries]) -> str:
    """``strategy/mode`` and the entries where they are not the cost model's (``auto``)."""
    s, m, e = key
    return f"{s.value}/{m.value}" + ("" if e is Entries.AUTO else f"/{e.value}")


def _buffers(plans: list[VectorPlan], fn: PerSampleFunction) -> tuple[Tensor, Tensor]:
    """The ``(N, O, P)`` result and the ``(N, O)`` outputs that ``plans`` fill (every plan of
    one batch has the same sizes): zeros where some plan leaves rows unwritten (ragged or
    padded outputs), else uninitialised."""
    sizes, values = plans[0].sizes, fn.values()
    shape = (len(sizes), max(sizes), fn.subset.numel)
    ragged = len(set(sizes)) > 1 or any(g.table is not None for p in plans for g in p.groups)
    jac = values[0].new_zeros(shape) if ragged else values[0].new_empty(shape)
    return jac, values[0].new_zeros(shape[:2])


def _fill(
    plan: VectorPlan,
    fn: PerSampleFunction,
    randomness: Randomness,
    notes: list[str],
    *,
    into: tuple[Tensor, Tensor] | None = None,
    only: set[int] | None = None,
    skip: set[int] = frozenset(),  # type: ignore[assignment]
) -> tuple[Tensor, Tensor, tuple[str, ...]]:
    """Fill the ``(N, O, P)`` result and the ``(N, O)`` outputs (new, or ``into``) group by
    group, chunk by chunk, for the samples in ``only`` (default: all) not in ``skip``; also
    returns the tensors that ran structured (a structured pass that meets an op it cannot run
    exactly is redone generically, with a note)."""
    subset, values = fn.subset, fn.values()
    structured = list(plan.structured) if plan.mode is Mode.FWD else []
    jac, outputs = _buffers([plan], fn) if into is None else into
    rows = outputs.unsqueeze(-1)  # written like one column of the Jacobian
    flat = None  # each layout column's flat position (the subset's inverse column order)
    if subset.columns is not None:
        flat = subset.to_grouped(torch.arange(subset.numel, device=jac.device))
    for g in plan.groups:
        indices = [i for i in g.indices if (only is None or i in only) and i not in skip]
        if not indices:
            continue
        if plan.mode is Mode.REV:
            for idx in _sample_chunks(indices, g.chunks[0].samples):
                blocks, out = _rev_block(g.fn, values, g.levels(idx), g.chunks[0].inner, randomness)
                _write(rows, idx, out.unsqueeze(-1), slice(0, 1), g.table)
                for name, blk in zip(subset.names, blocks):
                    lo, hi = subset.offsets[name]
                    blk = blk.reshape(*blk.shape[:2], -1)
                    _write(jac, idx, blk, _flat_positions(flat, lo, hi), g.table)
            continue
        for span, chunks in zip(plan.spans, g.chunks):
            name = span_tensor(subset, span)
            for idx in _sample_chunks(indices, chunks.samples):
                levels = g.levels(idx)
                blk = None
                if name in structured:
                    try:
                        out, blk = _entry_block(fn, name, values, levels, chunks.inner, randomness)
                    except NotStructuredError as err:
                        structured.remove(name)
                        notes.append(f"{name}: structured pass stopped ({err}); ran generic")
                if blk is None:
                    out, blk = _fwd_block(
                        g.fn, subset, values, levels, span, chunks.inner, randomness
                    )
                if span == plan.spans[0]:
                    _write(rows, idx, out.unsqueeze(-1), slice(0, 1), g.table)
                _write(jac, idx, blk, _flat_positions(flat, *span), g.table)
    return jac, outputs, tuple(structured) if plan.mode is Mode.FWD else plan.structured


def _sample_chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[s : s + size] for s in range(0, len(indices), size)]


def _flat_positions(flat: Tensor | None, lo: int, hi: int) -> slice | Tensor:
    """Where columns ``[lo, hi)`` of the tensor-by-tensor layout sit in the flat order
    (``flat``: each layout column's position, ``None`` where the orders agree): the result is
    filled in the flat order, never reordered by a copy of it."""
    return slice(lo, hi) if flat is None else flat[lo:hi]


def _write(
    jac: Tensor, idx: list[int], block: Tensor, cols: slice | Tensor, table: Tensor | None
) -> None:
    """Put ``block`` ``(n, O_g, k)`` of samples ``idx`` into columns ``cols`` of ``jac`` (a
    slice or ``(k,)`` positions: :func:`_flat_positions`); with a ``table``, only each
    sample's real rows, moved to the top in order."""

    def put(target: Tensor, values: Tensor) -> None:
        if isinstance(cols, slice):
            target[..., cols] = values
        else:
            target.index_copy_(-1, cols, values)

    if table is None:
        contiguous = idx == list(range(idx[0], idx[-1] + 1))
        if contiguous:
            put(jac[idx[0] : idx[-1] + 1, : block.shape[1]], block)
        elif isinstance(cols, slice):
            jac[idx, : block.shape[1], cols] = block
        else:
            for k, i in enumerate(idx):
                put(jac[i, : block.shape[1]], block[k])
        return
    for k, i in enumerate(idx):
        rows = table[i].nonzero().squeeze(1).to(block.device)
        put(jac[i, : rows.numel()], block[k].index_select(0, rows))


def _rev_block(
    fn: Callable[..., Tensor],
    values: tuple[Tensor, ...],
    levels: list[Tensor],
    inner: int | None,
    randomness: Randomness,
) -> tuple[tuple[Tensor, ...], Tensor]:
    """``(n, O, *selected_shape)`` per selected tensor by vmap over jacrev, and the outputs
    ``(n, O)`` of the same pass."""

    def with_output(vals: tuple[Tensor, ...], *lv: Tensor) -> tuple[Tensor, Tensor]:
        out = fn(vals, *lv)
        return out, out

    in_dims = (None,) + (0,) * len(levels)
    jf = jacrev(with_output, argnums=0, chunk_size=inner, has_aux=True)
    return vmap(jf, in_dims=in_dims, randomness=randomness.value)(values, *levels)


def _fwd_block(
    fn: Callable[..., Tensor],
    subset: ParamSubset,
    values: tuple[Tensor, ...],
    levels: list[Tensor],
    span: tuple[int, int],
    inner: int | None,
    randomness: Randomness,
) -> tuple[Tensor, Tensor]:
    """The outputs ``(n, O)`` and ``(n, O, hi - lo)``: columns ``[lo, hi)`` of the flat order by
    vmapped one-hot JVPs.

    Only the tensors overlapping ``span`` carry tangents (``span`` covers whole tensors).
    """
    lo, hi = span
    names, offsets = subset.names, subset.offsets
    active = [k for k, n in enumerate(names) if lo <= offsets[n][0] and offsets[n][1] <= hi]

    def per_sample(vals: tuple[Tensor, ...], *lv: Tensor) -> Tensor:
        def f_active(*act: Tensor) -> Tensor:
            full = list(vals)
            for k, a in zip(active, act):
                full[k] = a
            return fn(tuple(full), *lv)

        primals = tuple(vals[k] for k in active)

        def one(tangent: Tensor, _j: Tensor) -> tuple[Tensor, Tensor]:
            tangents = []
            for k in active:
                a, b = offsets[names[k]]
                tangents.append(tangent[a - lo : b - lo].reshape(vals[k].shape))
            return jvp(f_active, primals, tuple(tangents))

        return _columns(one, _one_hot_chunks(hi - lo, inner, vals[0]), randomness)

    in_dims = (None,) + (0,) * len(levels)
    return vmap(per_sample, in_dims=in_dims, randomness=randomness.value)(values, *levels)


def _entry_block(
    fn: PerSampleFunction,
    name: str,
    values: tuple[Tensor, ...],
    levels: list[Tensor],
    inner: int | None,
    randomness: Randomness,
) -> tuple[Tensor, Tensor]:
    """The outputs ``(n, O)`` and ``(n, O, k)``: the columns of tensor ``name`` by the structured
    forward pass (:mod:`~multiscale_jac.entries`): tangent ``e_j`` on its values and ``j`` on a
    dummy scalar, one entry per tangent, vmapped over entries and samples."""
    pos = fn.subset.names.index(name)
    v0 = values[pos]

    def per_sample(vals: tuple[Tensor, ...], *lv: Tensor) -> Tensor:
        c0 = v0.new_zeros(())

        def f(v: Tensor, c: Tensor) -> Tensor:
            return entry_call(fn, name, vals, lv, v, c)

        def one(hot: Tensor, j: Tensor) -> tuple[Tensor, Tensor]:
            return jvp(f, (vals[pos], c0), (hot.view_as(v0), j))

        return _columns(one, _one_hot_chunks(v0.numel(), inner, v0), randomness)

    in_dims = (None,) + (0,) * len(levels)
    return vmap(per_sample, in_dims=in_dims, randomness=randomness.value)(values, *levels)


def _one_hot_chunks(width: int, inner: int | None, like: Tensor) -> list[tuple[Tensor, Tensor]]:
    """One-hot tangents ``(c, width)`` in chunks of ``inner`` (``None``: one chunk), each with its
    column indices ``(c,)`` (in ``like``'s dtype: the entry index ``j`` the structured pass
    reads)."""
    out = []
    step = inner or width
    for s in range(0, width, step):
        c = min(step, width - s)
        hot = like.new_zeros((c, width))
        hot[torch.arange(c), torch.arange(s, s + c)] = 1
        out.append((torch.arange(s, s + c, dtype=like.dtype, device=like.device), hot))
    return out


def _columns(
    one: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    chunks: list[tuple[Tensor, Tensor]],
    randomness: Randomness,
) -> tuple[Tensor, Tensor]:
    """``one(tangent, j)`` (a JVP: primal and tangent output) vmapped over the one-hot tangents
    of every chunk (all tangents of a sample see the same random draws): the output ``(O,)`` and
    the columns ``(O, width)``. (Under ``vmap`` the primal comes back once per tangent, all
    equal: the first is kept.)"""
    inner = "error" if randomness is Randomness.ERROR else "same"
    out, cols = None, []
    for j, hot in chunks:
        primal, col = vmap(one, randomness=inner)(hot, j)
        out = primal[0] if out is None else out
        cols.append(col)
    return out, (cols[0] if len(cols) == 1 else torch.cat(cols)).transpose(0, 1)
