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

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import jacrev, jvp, vmap

from ._checks import (
    check_bool,
    check_chunk_size,
    check_memory_budget,
    prepare,
    warn_fallback,
)
from ._loop import sample_loop
from ._memory import mib
from ._planning import (
    COST_CONSTANTS,
    EngineOptions,
    VectorPlan,
    choose_strategy,
    decision,
    default_workset,
    estimate_seconds,
    even_chunk,
    first_line,
    loop_decision,
    plan_key,
    plan_seconds,
    plan_strategy,
    replay,
    span_tensor,
)
from ._tuning import (
    COUNTS,
    GROWTH,
    PAYS,
    PLAN_CACHE,
    TIE,
    auto_measures,
    call_fit,
    decide,
    defer,
    deferred_before,
    deferred_note,
    grown,
    grows,
    one_call,
    pick,
    seconds,
    time_candidates,
    trial_samples,
    under_budget,
)
from ._tuning import clear as clear_decisions
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
    the same shapes pays no measuring pass, survey or probe. The layer-wise rules' measured
    convolution kernels (per layer and size class, the layer held weakly) go too. It is state
    of the kind torch keeps for cuDNN autotuning; nothing is stored on the model. Decisions
    read from a file (:func:`multiscale_jac.tuning.load`) go too, and so do the row rules'
    kept results (:mod:`multiscale_jac.rows`: which sample each row of a layer belongs to, by
    op, shapes and owners; plain data, at most 8,192 entries) and the pure followed runs
    whose rows a later run with the same calls takes over (:mod:`multiscale_jac._row_replay`).
    """
    clear_decisions()
    clear_row_cache()


@one_call
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
        tune: How ``auto`` choices are made (:class:`~multiscale_jac.Tune`): ``auto`` times
            the routes the cost model estimates within its known error of each other on the
            run's first samples (batches of 8 or more; where every sample has a shape of its
            own, each route on samples of its own), ``measure`` always, ``estimate`` never;
            the timings, and what the cost model missed where they contradict it, are on
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


#: a job whose loop would take less (seconds) runs its cheapest plan (``tune="auto"``)
SMALL_JOB_S = 0.1
#: routes the cost model expects at most this many times slower than its best are timed
SHORTLIST = 4.0
#: ``tune="auto"`` times routes only on batches of this many samples
MIN_PROBE_BATCH = 8
#: each route is timed on one vectorised call of at least this many samples (where it has
#: them): single samples misjudge the routes that vectorise over samples better
MIN_PROBE_SAMPLES = 8
#: a model is deep where this many differentiable ops lie on one path between a selected
#: entry and the output (``Footprint.depth``): the bench_peers cells up to depth 56 (the
#: transformer; ResNet-8 27, VGG11 30) needed a shortlist spanning at most 2x to hold their
#: fastest route (one shallow cell 5.7x); the BiFPN pyramid of bench_peers (depth 248) 5.3x,
#: its forward routes ran 6-10x their estimates and its reverse ones 0.26-0.41x
DEEP_DEPTH = 100
#: on a deep model the shortlist spans this factor (the cost model's error between two of
#: the BiFPN pyramid's routes reached 24x: bucketed/fwd 10x its estimate, padded/rev 0.41x)
DEEP_SHORTLIST = 32.0
#: where every sample has a shape of its own, a route whose one-sample warm-up (scaled like
#: the timed calls) took this many times the fastest timed route's time is not timed: a
#: route's first call paid at most 2.7x its later time (once 4x, :data:`RETIME`)
WARM_CUTOFF = 4.0


class _RouteTiming:
    """``auto``'s measuring of one call (the half of :class:`_EngineRun` that times routes and
    samples per call on the run's own samples): the shortlist, the routes' timing, the samples
    per vectorised call and the note where the timing contradicts the estimate."""

    fn: PerSampleFunction
    packed: PackedBatch
    options: EngineOptions
    notes: list[str]
    trial: list[tuple[tuple[Strategy, Mode, Entries], VectorPlan]] | None

    def tune(self, ran: Strategy, plan: VectorPlan) -> tuple[Strategy, VectorPlan]:
        """Shortlist the routes ``auto`` chooses between (strategy x mode x entries: those the
        cost model does not rule out by more than its known error, :data:`SHORTLIST`x, or
        :data:`DEEP_SHORTLIST`x on a model :data:`DEEP_DEPTH` ops deep, and always its own
        choice and the same route with generic entries) to be timed on the run itself
        (:meth:`try_routes`): under ``tune="auto"`` on batches of :data:`MIN_PROBE_BATCH`
        samples (the routes also where every sample has a shape of its own, the samples per
        call only where a bucket has several), under ``"measure"`` always."""
        o = self.options
        strategies = [ran]
        if o.strategy is Strategy.AUTO and len(self.packed.buckets()) > 1:
            strategies = [Strategy.BUCKETED, Strategy.PADDED]
        modes = [Mode.REV, Mode.FWD] if o.mode is Mode.AUTO else [plan.mode]
        entries = [o.entries]
        if o.entries is Entries.AUTO and plan.structured:
            entries.append(Entries.GENERIC)  # the structured passes' cost is a guess too
        candidates = [(s, m, e) for s in strategies for m in modes for e in entries]
        if under_budget(o.tune, o.memory_budget, self.notes):
            return ran, plan
        if o.tune is Tune.ESTIMATE or (len(candidates) < 2 and not self.resizable(plan)):
            return ran, plan
        first = (ran, plan.mode, o.entries)  # the estimate's choice: it also warms up
        plans = {first: plan}
        for s, m, e in candidates:
            if (s, m, e) not in plans:
                try:
                    route = dataclasses.replace(o, mode=m, entries=e)
                    plans[s, m, e] = plan_strategy(self.fn, self.packed, s, route, [])
                except (RuntimeError, UnsupportedOpError, MemoryBudgetError):
                    continue  # a route that cannot run is no candidate
        # nothing timed holds more than GROWTH x the estimate's choice's working set, or the
        # default working set where that is larger (what any plan without a budget may hold:
        # a route 7x the estimate's 22 MiB choice ran the BiFPN's ragged batch 1.7x faster)
        self.workset = max(plan.workset, default_workset(plan.device))
        heavy = {k: p.workset for k, p in plans.items() if grows(p.workset, self.workset)}
        if heavy:
            self.notes.append(
                f"tune: not timed, their working set over {GROWTH}x "
                f"{mib(self.workset)} (the estimate's choice's, or the default working set): "
                + ", ".join(f"{_route(k)} ({mib(w)})" for k, w in heavy.items())
            )
        plans = {k: p for k, p in plans.items() if k not in heavy}
        estimates = {k: plan_seconds(p) for k, p in plans.items()}
        best = min(estimates.values())
        keep = {first, (ran, plan.mode, Entries.GENERIC)}
        # the padded plan's pass also runs the masking ops: its depth is not the model's
        depth = max(
            (
                g.footprint.depth
                for k, p in plans.items()
                if k[0] is not Strategy.PADDED
                for g in p.groups
            ),
            default=0,
        )
        self.depth = depth
        error = DEEP_SHORTLIST if depth >= DEEP_DEPTH else SHORTLIST  # the model's known error
        trial = [(k, p) for k, p in plans.items() if estimates[k] <= error * best or k in keep]
        # routes estimated within the model's error of each other are timed, also where every
        # sample has a shape of its own (each route then runs samples of its own); the
        # samples per call only where a bucket has several
        largest = max(len(b.indices) for b in self.packed.buckets())
        if not (len(trial) > 1 or self.resizable(plan)):
            return ran, plan
        if o.tune is not Tune.MEASURE and (
            len(self.packed) < MIN_PROBE_BATCH or (largest < 2 and len(trial) < 2)
        ):
            return ran, plan
        extra, work = self.timing_cost(first, trial, estimates, largest)
        verdict = decide(o.tune, self.fn.model, self.key, extra=extra, work=work)
        # ``auto`` measuring on the estimate's word (not deferred before): the timing also
        # stops where it does not pay as measured (time_candidates' units), deferring then
        on_estimate = o.tune is Tune.AUTO and not deferred_before(self.fn.model, self.key)
        self.guard = len(self.packed) if verdict == "measure" and on_estimate else None
        if verdict == "defer":
            self.deferred = True
            self.notes.append(deferred_note(extra, work))
        if verdict == "measure":
            self.trial, self.estimates = trial, estimates
            if error != SHORTLIST and len(trial) > 1:
                self.notes.append(
                    f"tune: a deep model ({depth} ops between the selected entries and the "
                    f"output): the routes estimated within {error:g}x of the best are timed"
                )
        return ran, plan

    def timing_cost(
        self,
        first: tuple[Strategy, Mode, Entries],
        trial: list[tuple[tuple[Strategy, Mode, Entries], VectorPlan]],
        estimates: dict[tuple[Strategy, Mode, Entries], float],
        largest: int,
    ) -> tuple[float, float]:
        """The estimated seconds that timing ``trial`` adds to the call and the call's own
        (the estimate's choice ``first`` for the job), by the cost model: each route's
        one-sample warm-up, and on its timed samples (a share of the largest bucket, twice
        with the second round) what it costs over ``first`` (the samples count towards the
        result); one more warm-up call for the samples per call."""
        n = len(self.packed)
        per = {k: estimates[k] / n for k, _ in trial}
        share = max(largest // len(trial) - 1, min(largest, MIN_PROBE_SAMPLES))
        extra = sum(per.values()) + sum(
            2 * share * max(0.0, per[k] - per[first]) for k in per if k != first
        )
        return extra + per[first], estimates[first]

    def stop_timing(self) -> None:
        """The timing did not pay as measured: nothing is cached and the same call again
        measures (as a deferred one)."""
        if not self.deferred:
            self.deferred = True
            defer(self.fn.model, self.key)
            self.notes.append(
                "tune: timing stopped: it cost more than "
                f"{PAYS:.0%} of the job as measured; the same call again measures"
            )

    def resizable(self, plan: VectorPlan) -> bool:
        """Whether the samples per vectorised call are ``auto``'s to time: the caller set no
        ``chunk_size`` and the largest bucket's calls can grow (:meth:`call_sizes`)."""
        return self.options.chunk_size is None and self.call_sizes(plan)[1]

    def call_sizes(self, plan: VectorPlan) -> tuple[int, bool]:
        """The planned samples per call ``n`` of the largest bucket, and whether they may grow
        (the bucket has more samples, no ``memory_budget`` bounds the calls, and ``n`` is at
        least 2, so that half of it is a call too: one sample a call fills the default
        working set already, and on the strided tanh CNN, 21 MB of Jacobian a sample, the
        timed calls of two ran faster and the whole batch slower)."""
        n = _call_size(plan, self.packed)
        largest = max(len(b.indices) for b in self.packed.buckets())
        return n, self.options.memory_budget is None and 2 <= n < largest

    def try_routes(self) -> tuple[tuple[Tensor, Tensor], set[int], Strategy, VectorPlan]:
        """Run the first samples of the largest bucket with each shortlisted route: a
        one-sample warm-up (a route's first call pays one-time costs), then one vectorised
        call on an equal share of the bucket, at least :data:`MIN_PROBE_SAMPLES` (or the whole
        bucket), timed; then the routes within ``RETIME`` of the fastest once more, the faster
        of its two times counting (the rules of :mod:`~multiscale_jac._tuning`: a route's
        first vectorised call at a size still paid up to 2.7x its later time); a tie goes to
        the estimate's choice; then the chosen route's samples per call (:meth:`try_calls`). Their
        Jacobians go into the result, so timing costs only the slower routes' extra time.
        Where the bucket is too small for every route to get new samples, later routes redo
        samples already done (their results are the same). Where every sample has a shape of
        its own (the largest bucket holds one), each route runs samples of its own instead,
        the smallest first, and its time is scaled to the whole job by its own estimate
        (:meth:`_run_route`); a route whose warm-up took :data:`WARM_CUTOFF` times the fastest
        timed one is not timed. Where the timing contradicts the estimate by
        :data:`SHORTLIST`x or more, a note says what the cost model missed. Returns the
        result buffers, the samples done and the fastest route."""
        trial, self.trial = self.trial or [], None  # ((strategy, mode, entries), plan)
        into = _buffers([p for _, p in trial], self.fn)
        bucket = max(self.packed.buckets(), key=lambda b: len(b.indices))
        self.spread = len(bucket.indices) == 1 and len(trial) > 1
        if self.spread:  # every sample its own shape: the samples in order of size
            sizes = [sum(t.numel() for t in self.packed.sample(i)) for i in range(len(self.packed))]
            bucket = _Samples(sorted(range(len(self.packed)), key=sizes.__getitem__))
        pool = list(bucket.indices)
        share = max(len(pool) // len(trial) - 1, min(len(pool), MIN_PROBE_SAMPLES))
        done: set[int] = set()

        least = min((p.workset for _, p in trial if p.workset > 0), default=0)

        def call_size(plan: VectorPlan) -> int:
            # one vectorised call of the route (its samples per call), up to a share of the
            # bucket (per-sample times of one sample misjudge routes that vectorise better)
            # and to MEASURE x the lightest route's calls (a heavier route that loses would
            # otherwise hold more than the route that runs)
            n = _call_size(plan, self.packed)
            return min(share, trial_samples(n, plan.workset, least))

        if len(trial) == 1:  # only the samples per call are timed
            ((best, plan),) = trial
            into, done, plan = self.try_calls(best, plan, bucket, pool, into, done)
            return into, done, best[0], plan
        plans = dict(trial)
        skipped: list[str] = []

        def skip(key: tuple[Strategy, Mode, Entries], warm: float, times: dict) -> bool:
            if self.spread and times and warm > WARM_CUTOFF * min(times.values()):
                skipped.append(f"{_route(key)} (warm-up {warm * len(self.packed):.3g} s)")
                return True
            return False

        times = time_candidates(
            list(plans),
            lambda k: self._run_route(k, plans[k], call_size(plans[k]), bucket, pool, into, done),
            devices=[trial[0][1].device],
            warm_up=lambda k: self._run_route(k, plans[k], 1, bucket, pool, into, done),
            skip=skip,
            units=self.guard,
            on_stop=self.stop_timing,
        )
        if not times:  # every route failed on the data: the run meets the error again
            return into, set(), trial[0][0][0], trial[0][1]
        best = pick(times, prefer=lambda k: k == trial[0][0])  # ties: the estimate's
        if self.spread:
            n = len(self.packed)
            self.notes.append(
                "tune: every sample has a shape of its own: each route timed on samples of "
                "its own, scaled to the whole job by its estimate: "
                + ", ".join(
                    f"{_route(k)} {v * n:.3g} s (estimated {self.estimates[k]:.3g} s)"
                    for k, v in times.items()
                )
                + (f"; not timed after its warm-up: {', '.join(skipped)}" if skipped else "")
                + f"; chose {_route(best)}"
            )
        else:
            self.notes.append(
                "tune: timed on the run's first samples (vectorised calls): "
                + ", ".join(f"{_route(k)} {v * 1e3:.1f} ms" for k, v in times.items())
                + f" per sample; chose {_route(best)}"
            )
        self._contradiction(trial[0][0], best, times, dict(trial))
        self.options = dataclasses.replace(self.options, mode=best[1], entries=best[2])
        plan = dict(trial)[best]
        if self.resizable(plan) and not self.deferred:  # (deferred: the timing stopped)
            into, done, plan = self.try_calls(best, plan, bucket, pool, into, done)
        return into, done, best[0], plan

    def _contradiction(
        self,
        first: tuple[Strategy, Mode, Entries],
        best: tuple[Strategy, Mode, Entries],
        times: dict[tuple[Strategy, Mode, Entries], float],
        plans: dict[tuple[Strategy, Mode, Entries], VectorPlan],
    ) -> None:
        """Note where the timing ranks the estimate's choice ``first`` below ``best`` by
        :data:`SHORTLIST`x or more against the estimate: the two routes' estimates and their
        times for the whole job, and what the cost model missed: it counts a fixed
        ``call_s`` a vectorised forward pass (plus work by activation bytes), and the route
        its timing fell furthest behind runs so many passes of so many ops each."""
        est = self.estimates
        if best == first or first not in times or first not in est or best not in est:
            return
        off = (est[best] / est[first]) / (times[best] / times[first])
        if off < SHORTLIST:
            return
        n = len(self.packed)
        job = {k: times[k] * n for k in (first, best)}
        worse = max((first, best), key=lambda k: job[k] / est[k])  # furthest over its estimate
        plan = plans[worse]
        passes = len(plan.spans) if plan.mode is Mode.FWD else 1
        calls = (
            sum(-(-len(g.indices) // min(c.samples for c in g.chunks)) for g in plan.groups)
            * passes
        )
        call_s = COST_CONSTANTS.get(plan.device.type, COST_CONSTANTS["cuda"])["call_s"]
        per_pass = job[worse] / calls
        missed = (
            f"each pass took about {per_pass * 1e3:.0f} ms, not the {call_s * 1e3:.0f} ms it "
            f"counts a vectorised forward pass (plus work by activation bytes): the per-op cost "
            f"of a pass through {self.depth} ops is what it missed"
            if per_pass >= SHORTLIST * call_s
            else f"its work by activation bytes misjudged {_route(worse)}"
        )
        per_call = f", {passes} a call: one per selected tensor" if passes > 1 else ""
        self.notes.append(
            f"tune: the timing contradicts the estimate by {off:.0f}x: estimated "
            f"{_route(first)} {est[first]:.3g} s and {_route(best)} {est[best]:.3g} s, measured "
            f"{job[first]:.3g} s and {job[best]:.3g} s for the job; {_route(worse)} took "
            f"{job[worse] / est[worse]:.3g}x its estimate in {calls} vectorised passes"
            f"{per_call}: {missed}"
        )

    def try_calls(
        self,
        key: tuple[Strategy, Mode, Entries],
        plan: VectorPlan,
        bucket: Any,
        pool: list[int],
        into: tuple[Tensor, Tensor],
        done: set[int],
    ) -> tuple[tuple[Tensor, Tensor], set[int], VectorPlan]:
        """Grow the chosen route's samples per vectorised call where a call's fixed cost says
        larger calls pay: the planned size ``n`` and ``n // 2`` are timed on as many samples
        each (a warm-up call each first: a first call at a size pays one-time costs), a
        call's time is fitted as a fixed cost plus a cost per sample, and the calls grow to
        the largest size, up to ``GROWTH`` x ``n`` and the bucket (:func:`even_chunk`), whose
        fitted time per sample beats ``n``'s measured one by :data:`~multiscale_jac._tuning.TIE`
        (the cost model sizes calls by a default working set, a guess). Nothing larger than
        the calls that run is timed: a timed call of ``2n`` that lost held twice the working
        set of the calls that ran (the peak memory of the measuring then exceeded the run's).
        Calls never shrink below ``n``: timing a smaller size against ``n`` held ``n``'s
        working set already."""
        if not self.resizable(plan):
            return into, done, plan
        n, _ = self.call_sizes(plan)
        largest = len(bucket.indices)
        half = n // 2
        plans = {n: plan, half: _resized(plan, half, n)}
        window = min(max(2 * n, MIN_PROBE_SAMPLES), largest)
        warm: set[int] = set()

        def warm_up(size: int) -> float | None:
            if size in warm:
                return 1.0  # warmed up before: nothing to run
            warm.add(size)
            return self._run_route(key, plans[size], size, bucket, pool, into, done)

        times = time_candidates(
            [n, half],
            lambda size: self._run_route(key, plans[size], window, bucket, pool, into, done),
            devices=[plan.device],
            warm_up=warm_up,
            retime=0.0,  # the pair runs as many samples each: no second round
            units=self.guard,
            on_stop=self.stop_timing,
        )
        if n not in times or half not in times:
            return into, done, plan
        fixed, each = call_fit(half, times[half], n, times[n])
        # the working set run: GROWTH x the estimate's choice's (calls grow with samples)
        most = min(largest, GROWTH * n, grown(n, plan.workset, self.workset))
        sizes = sorted({even_chunk(min(2**i * n, most), largest) for i in range(1, GROWTH)})
        faster = [k for k in sizes if k > n and TIE * (fixed / k + each) <= times[n]]
        chosen = max(faster, default=n)
        if chosen != n:
            plans[chosen] = _resized(plan, chosen, n)
        self.notes.append(
            f"tune: {_route(key)} in calls of {n} samples {times[n] * 1e3:.1f} ms, {half} "
            f"samples {times[half] * 1e3:.1f} ms per sample (each on the same samples, after a "
            f"warm-up call): a call {fixed * 1e3:.2f} ms and {each * 1e3:.2f} ms a sample; "
            f"chose {chosen}"
        )
        return into, done, plans[chosen]

    def _run_route(
        self,
        key: tuple[Strategy, Mode, Entries],
        plan: VectorPlan,
        k: int,
        bucket: Any,
        pool: list[int],
        into: tuple[Tensor, Tensor],
        done: set[int],
    ) -> float | None:
        """One call of a route on ``k`` samples: the next of ``pool`` (taken from it), or the
        bucket's last ones where too few are left. Returns the work it did for
        :func:`~multiscale_jac._tuning.time_candidates`: its samples, or, where samples
        differ in shape, the whole job's count scaled by the route's own estimate for them
        (``None``: it failed, noted)."""
        idx = pool[:k] if len(pool) >= k else list(bucket.indices[-k:])
        if len(pool) >= k:
            del pool[:k]
        try:
            with torch.no_grad():
                _fill(plan, self.fn, self.options.randomness, [], into=into, only=set(idx))
        except (RuntimeError, NotImplementedError) as err:
            self.notes.append(f"tune: {_route(key)} failed ({first_line(err)})")
            return None
        done.update(idx)
        if self.spread:  # samples of different shapes: scaled by the route's own estimate
            return len(self.packed) * _estimate_of(plan, idx) / plan_seconds(plan)
        return len(idx)


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
        self.key = plan_key(fn, packed, options)
        self.cached = PLAN_CACHE.get(fn.model, self.key)
        #: the shortlisted routes, timed on the first samples of the run (:meth:`try_routes`)
        self.trial: list[tuple[tuple[Strategy, Mode, Entries], VectorPlan]] | None = None
        #: the cost model's seconds for every planned route of the job (:meth:`tune`)
        self.estimates: dict[tuple[Strategy, Mode, Entries], float] = {}
        #: every sample has a shape of its own: routes are timed on samples of their own,
        #: scaled by their estimates (:meth:`try_routes`)
        self.spread = False
        #: the most ops between a selected entry and the output (:meth:`tune`)
        self.depth = 0
        #: ``tune="auto"`` found measuring too dear for this call: nothing cached, the same
        #: call again measures (:func:`~multiscale_jac._tuning.decide`)
        self.deferred = False
        #: the job's samples where measuring was decided on the estimate of its work: the
        #: timing stops where it does not pay as measured (``None``: asked for, or met again)
        self.guard: int | None = None
        #: the working set of the estimate's choice, at least the default one: what timing
        #: may grow by GROWTH
        self.workset = 0

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
            ran, plan = self.tune(ran, plan)
        return ran, plan

    def small_job(self) -> bool:
        """Under ``tune="auto"``, a job whose loop would take under :data:`SMALL_JOB_S` (one
        forward pass, timed, times the samples and rows) runs its cheapest plan: no survey, no
        padded plan, no probe (planning would cost more than it saves)."""
        o = self.options
        free = [o.strategy is Strategy.AUTO, o.mode is Mode.AUTO, o.entries is Entries.AUTO]
        if o.tune is not Tune.AUTO or not any(free) or not auto_measures():
            return False
        levels = tuple(self.packed.sample(self.packed.largest_sample))
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            once, out = seconds(lambda: self.fn.call(self.fn.params, levels))
        rows = out.numel()
        loop = once * len(self.packed) * (1 + 2 * rows)
        if loop >= SMALL_JOB_S:
            return False
        mode = o.mode
        if mode is Mode.AUTO:
            mode = Mode.FWD if self.fn.subset.numel < rows else Mode.REV
        entries = Entries.GENERIC if o.entries is Entries.AUTO else o.entries
        self.options = dataclasses.replace(o, mode=mode, entries=entries)
        self.notes.append(
            f"auto: a small job (the loop would take about {loop * 1e3:.0f} ms): mode "
            f"{mode.value!r}, {entries.value} entries, no survey or probe"
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
            if self.cached is None and not self.fallbacks and not self.deferred:
                PLAN_CACHE.put(self.fn.model, self.key, decision(plan, structured, self.notes))
            return self.result(jac, outputs, plan.sizes, ran, plan.mode, **extra)
        jac, outputs, sizes = sample_loop(self.fn, self.packed, self.notes)
        if self.cached is None and self.fallbacks and not self.deferred:
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


class _Samples(NamedTuple):
    """Samples in the order :meth:`_EngineRun.try_routes` takes them (a bucket's ``indices``,
    or every sample, the smallest first, where every sample has a shape of its own)."""

    indices: list[int]


def _estimate_of(plan: VectorPlan, idx: list[int]) -> float:
    """The cost model's seconds for ``plan`` on samples ``idx`` alone (each group's share
    in calls of its planned size)."""
    chosen = set(idx)
    groups = []
    for g in plan.groups:
        n = sum(1 for i in g.indices if i in chosen)
        if n:
            groups.append((n, min(n, min(c.samples for c in g.chunks)), g.footprint))
    return estimate_seconds(groups, plan, plan.strategy is Strategy.PADDED)


def _call_size(plan: VectorPlan, packed: PackedBatch) -> int:
    """Samples per vectorised call of ``plan`` in the largest shape bucket."""
    bucket = max(packed.buckets(), key=lambda b: len(b.indices))
    (group,) = [g for g in plan.groups if bucket.indices[0] in g.indices]
    return max(c.samples for c in group.chunks)


def _resized(plan: VectorPlan, k: int, n: int) -> VectorPlan:
    """``plan`` with ``k / n`` times its samples per vectorised call (at least one, at most a
    group's samples)."""
    groups = [
        dataclasses.replace(
            g,
            chunks=tuple(
                dataclasses.replace(c, samples=max(1, min(len(g.indices), c.samples * k // n)))
                for c in g.chunks
            ),
        )
        for g in plan.groups
    ]
    return dataclasses.replace(plan, groups=groups)


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
