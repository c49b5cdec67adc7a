"""The engine's plan cache: a second call with the same shapes pays no measuring pass, survey
or probe and gives the same result; the cache is bounded, weakly keyed, clearable."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from cases import DTYPE
from conftest import CASE_BY_ID, jacnorm_jobs

import multiscale_jac as mj
from multiscale_jac.models import ConvBlock


@pytest.fixture(autouse=True)
def fresh_cache():
    mj.clear_plan_cache()
    yield
    mj.clear_plan_cache()


def _counts() -> tuple[int, int, int]:
    info = mj.plan_cache_info()
    return info.measured, info.surveyed, info.probed


@pytest.mark.parametrize(
    "strategy, mode", [("auto", "auto"), ("padded", "rev"), ("bucketed", "fwd")]
)
def test_second_call_pays_no_planning(strategy: str, mode: str) -> None:
    case = CASE_BY_ID["fpn_scale_ragged"]
    model = case.build()
    subset = mj.ParamSubset.from_flat_indices(model, [40, 3, 77, 12, 5])
    kwargs = dict(params=subset, output_fn=case.output_fn, strategy=strategy, mode=mode)
    first = mj.per_sample_jacobian(model, case.inputs(), **kwargs)
    before = _counts()
    assert before[0] > 0  # the first call measured
    second = mj.per_sample_jacobian(model, case.inputs(), **kwargs)
    assert _counts() == before  # no measuring pass, survey or probe
    assert "plan: cached (the same shapes ran before)" in second.notes
    assert mj.plan_cache_info().hits == 1
    torch.testing.assert_close(second.jacobian, first.jacobian, atol=0, rtol=0)
    assert (second.strategy, second.mode, second.structured) == (
        first.strategy,
        first.mode,
        first.structured,
    )


def test_the_key_is_shapes_not_values() -> None:
    torch.manual_seed(0)
    model = ConvBlock(3, 8).to(DTYPE).eval()
    x = [torch.randn(2, 3, 9, 9, dtype=DTYPE), torch.randn(2, 3, 8, 8, dtype=DTYPE)]
    mj.per_sample_jacobian(model, x, params="conv.2.*")
    with torch.no_grad():
        model.conv[2].weight.mul_(2.0)  # new values, same structure: a hit, the new values used
    res = mj.per_sample_jacobian(model, [t * 3 for t in x], params="conv.2.*")
    ref = mj.reference.per_sample_jacobian_loop(model, [t * 3 for t in x], params="conv.2.*")
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    assert mj.plan_cache_info().hits == 1
    misses = mj.plan_cache_info().misses
    mj.per_sample_jacobian(model, [t[:1] for t in x], params="conv.2.*")  # other shapes
    mj.per_sample_jacobian(model, x, params="conv.0.*")  # another subset
    mj.per_sample_jacobian(model, x, params="conv.2.*", output_fn=lambda y: y.sum(1))
    mj.per_sample_jacobian(model, x, params="conv.2.*", mode="rev")  # other options
    model.train()  # other flags (BatchNorm-free: allowed)
    mj.per_sample_jacobian(model, x, params="conv.2.*")
    assert mj.plan_cache_info().misses == misses + 5


def test_the_cache_never_keeps_a_model_alive_and_is_bounded() -> None:
    model = ConvBlock(3, 8).to(DTYPE).eval()
    x = [torch.randn(2, 3, 9, 9, dtype=DTYPE)]
    mj.per_sample_jacobian(model, x, params="conv.2.*")
    assert mj.plan_cache_info().size == 1
    del model
    gc.collect()
    assert mj.plan_cache_info().size == 0
    cache = mj.engine.PLAN_CACHE if hasattr(mj.engine, "PLAN_CACHE") else None
    assert cache is not None
    maxsize, cache.maxsize = cache.maxsize, 3
    try:
        model = ConvBlock(3, 8).to(DTYPE).eval()
        for size in (9, 10, 11, 12, 13):
            mj.per_sample_jacobian(model, [torch.randn(1, 3, size, size, dtype=DTYPE)])
        assert mj.plan_cache_info().size == 3
    finally:
        cache.maxsize = maxsize
    mj.clear_plan_cache()
    assert mj.plan_cache_info() == (0, 0, 0, maxsize, 0, 0, 0)


def test_a_small_job_runs_its_cheapest_plan(measuring, monkeypatch) -> None:
    """Under tune='auto' a job whose loop would be quick skips the survey, the padded plan and
    the probes (planning would cost more than it saves); tune='estimate' plans in full."""
    import multiscale_jac.engine as engine

    monkeypatch.setattr(engine, "SMALL_JOB_S", 60.0)  # every job here is small
    case = CASE_BY_ID["bn_cnn_multicrop"]
    model = case.build()
    res = mj.per_sample_jacobian(model, case.inputs(), params="features.*")
    assert res.strategy == "bucketed" and mj.plan_cache_info().surveyed == 0
    assert any(n.startswith("auto: a small job") for n in res.notes)
    ref = mj.reference.per_sample_jacobian_loop(model, case.inputs(), params="features.*")
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    mj.clear_plan_cache()
    full = mj.per_sample_jacobian(model, case.inputs(), params="features.*", tune="estimate")
    assert not any(n.startswith("auto: a small job") for n in full.notes)


def test_tune_measure_times_the_shortlist() -> None:
    case = CASE_BY_ID["fpn_scale_ragged"]
    model = case.build()
    res = mj.per_sample_jacobian(
        model, case.inputs(), params="head.*", output_fn=case.output_fn, tune="measure"
    )
    tuned = [n for n in res.notes if n.startswith("tune: timed on")]
    assert tuned and "; chose " in tuned[0]
    assert mj.plan_cache_info().probed >= 2
    ref = mj.reference.per_sample_jacobian_loop(
        model, case.inputs(), params="head.*", output_fn=case.output_fn
    )
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    probed = mj.plan_cache_info().probed
    again = mj.per_sample_jacobian(
        model, case.inputs(), params="head.*", output_fn=case.output_fn, tune="measure"
    )
    assert mj.plan_cache_info().probed == probed  # cached: no second probe
    # the first call's timed samples ran the other routes: equal up to rounding
    torch.testing.assert_close(again.jacobian, res.jacobian, atol=1e-12, rtol=0)


def test_route_timing_keeps_full_collections_out_and_restores_the_collector(monkeypatch) -> None:
    """A collection over the whole process inside one timed call once made the faster route
    look 10x slower: the objects from before are frozen for the collector while a route is
    timed, and unfrozen after (a caller's own freeze is left alone)."""
    from multiscale_jac import _tuning

    seen: list[int] = []
    with _tuning.stopwatch() as elapsed:
        seen.append(gc.get_freeze_count())
    assert seen[0] > 0 and gc.get_freeze_count() == 0 and elapsed[0] >= 0
    with pytest.raises(KeyError), _tuning.stopwatch():  # undone on errors too
        raise KeyError("x")
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the caller's own
    try:
        frozen = gc.get_freeze_count()
        with _tuning.stopwatch():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    # every timed route call of a tuned run ran with the process's objects frozen
    calls: list[int] = []
    real = mj.engine._fill

    def spy(*args, **kwargs):
        if kwargs.get("only") is not None:
            calls.append(gc.get_freeze_count())
        return real(*args, **kwargs)

    monkeypatch.setattr(mj.engine, "_fill", spy)
    case = CASE_BY_ID["fpn_scale_ragged"]
    mj.per_sample_jacobian(
        case.build(), case.inputs(), params="head.*", output_fn=case.output_fn, tune="measure"
    )
    assert calls and all(calls)
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("tune", ["auto", "measure"])
def test_jacobian_norm_times_its_routes_on_the_run_itself(measuring, tune: str) -> None:
    """``jacobian_sq_norm(method="auto")`` times its routes on the first chunks of the job
    (each chunk counted once in the result: value and gradient equal a forced method's),
    caches the fastest, and the second call with the same shapes probes nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model = model.to(DTYPE)
    x = torch.randn(70 if tune == "auto" else 5, 4, dtype=DTYPE)

    def value_and_grad(**kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        s = mj.jacobian_sq_norm(model, x, chunk_size=8, **kw)
        s.backward()
        return s.detach(), [p.grad.clone() for p in model.parameters()]

    ref_s, ref_g = value_and_grad(method="hvp")
    probed = _counts()[2]
    got_s, got_g = value_and_grad(tune=tune)
    assert _counts()[2] >= probed + 3  # layerwise, vmap and hvp were timed
    assert mj.plan_cache_info().size == 1  # the choice
    torch.testing.assert_close(got_s, ref_s, atol=1e-10, rtol=0)
    for g, r in zip(got_g, ref_g):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)
    probed = _counts()[2]
    again_s, again_g = value_and_grad(tune=tune)
    assert _counts()[2] == probed  # the cached choice: no probe
    torch.testing.assert_close(again_s, ref_s, atol=1e-10, rtol=0)
    for g, r in zip(again_g, ref_g):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)
    mj.clear_plan_cache()
    probed = _counts()[2]
    with torch.no_grad():  # value only: nothing timed, nothing cached
        mj.jacobian_sq_norm(model, x, chunk_size=8, tune=tune)
    assert _counts()[2] == probed and mj.plan_cache_info().size == 0


@pytest.mark.parametrize(
    ("n", "timed_routes", "left_out"),
    [
        (200, ["layerwise/32", "vmap/32", "vmap/16", "hvp/16", "vmap/67"], None),
        (110, ["layerwise/32", "vmap/32"], "left out hvp/16, vmap/16"),
    ],
    ids=["every_route_and_a_larger_chunk", "short_bucket_leaves_routes_out"],
)
def test_jacobian_norm_default_chunks_time_every_route_twice(
    measuring, monkeypatch, n: int, timed_routes: list[str], left_out: str | None
) -> None:
    """With default chunks, ``layerwise`` (whose own default chunk would take most of the
    samples) is timed at ``vmap``'s chunk, every route the samples allow is timed (``vmap``
    also at a larger chunk from the samples left over: 72 of 200, split evenly: 67), the
    routes near the fastest a second time (``probe`` counts both), and the chunks stay
    counted exactly once; with fewer samples ``hvp`` and the half ``vmap`` chunk go first."""
    jobs = jacnorm_jobs(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    model = model.to(DTYPE)
    x = torch.randn(n, 4, dtype=DTYPE)
    ref = mj.jacobian_sq_norm(model, x, method="hvp")
    probed = _counts()[2]
    got = mj.jacobian_sq_norm(model, x)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    (note,) = [n for n in jobs[-1].notes if n.startswith("tune: timed chunks")]
    timed = note.split(": ", 2)[2].split(" per sample")[0].split(", ")
    assert [t.rsplit(" ", 2)[0] for t in timed] == timed_routes, note
    assert _counts()[2] >= probed + len(timed) + 1  # the fastest re-timed at least
    short = [n for n in jobs[-1].notes if "left out" in n]
    assert (short[0].split(": ", 2)[2] if short else None) == left_out, jobs[-1].notes


@pytest.mark.parametrize("case_id", ["fpn_scale_ragged", "seed_convblock_levels"])
def test_auto_times_routes_on_the_run_itself(measuring, monkeypatch, case_id: str) -> None:
    """``tune="auto"``: the shortlisted routes run the first samples of the job, timed, and
    those samples' Jacobians stay in the result (exact against the loop); the fastest is
    cached and the second call times nothing."""
    from multiscale_jac import engine

    monkeypatch.setattr(engine, "MIN_PROBE_BATCH", 3)
    case = CASE_BY_ID[case_id]
    model = case.build()
    kwargs = dict(params=case.glob, output_fn=case.output_fn)
    inputs = case.inputs
    if case.ragged:  # samples enough in the largest bucket to time every route on one each
        inputs = lambda: case.inputs() * 4  # noqa: E731
    res = mj.per_sample_jacobian(model, inputs(), **kwargs)
    tuned = [n for n in res.notes if n.startswith("tune: timed on the run's first samples")]
    assert tuned and "; chose " in tuned[0], res.notes
    assert mj.plan_cache_info().probed >= 2
    ref = mj.reference.per_sample_jacobian_loop(model, inputs(), **kwargs)
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    torch.testing.assert_close(res.outputs, ref.outputs, atol=1e-10, rtol=0)
    probed = mj.plan_cache_info().probed
    again = mj.per_sample_jacobian(model, inputs(), **kwargs)
    assert mj.plan_cache_info().probed == probed
    torch.testing.assert_close(again.jacobian, ref.jacobian, atol=1e-10, rtol=0)


def test_diag_fisher_times_layerwise_against_vmap_on_the_data(measuring, monkeypatch) -> None:
    """``diag_fisher(method="auto")`` runs the first batch layer-wise, times layer-wise at two
    chunk sizes and ``vmap`` on its samples (those results dropped: the result equals a forced
    method's), caches the fastest, and the second call with the same shapes times nothing."""
    from multiscale_jac import fisher

    monkeypatch.setattr(fisher, "MIN_TUNE_SAMPLES", 16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(12, 3)
    ).to(DTYPE)
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(40, 2, 4, 4, generator=g, dtype=DTYPE),
            torch.randint(0, 3, (40,), generator=g),
        )
    ]
    ref = mj.diag_fisher(model, data, method="layerwise")
    probed = _counts()[2]
    res = mj.diag_fisher(model, data)
    # timed (how many runs a route takes depends on the machine's speed: not counted)
    assert _counts()[2] > probed
    probed = _counts()[2]
    (note,) = [n for n in res.notes if n.startswith("tune: timed on the data")]
    assert "layerwise/32 " in note and "layerwise/40 " in note and "vmap/32 " in note, note
    torch.testing.assert_close(res.flat, ref.flat, atol=1e-12, rtol=0)
    again = mj.diag_fisher(model, data)
    assert _counts()[2] == probed
    assert any(n.startswith("cached choice") for n in again.notes), again.notes
    torch.testing.assert_close(again.flat, ref.flat, atol=1e-12, rtol=0)


@pytest.mark.parametrize("fastest, sizes", [(0, [32, 8]), (1, [40]), (2, [])])
def test_diag_fisher_runs_the_chunk_it_chose(
    measuring, monkeypatch, fastest: int, sizes: list
) -> None:
    """The route and layer-wise chunk ``auto`` found fastest are cached and run: layer-wise in
    chunks of 32 or of the whole bucket (40), or ``vmap`` (no layer-wise run)."""
    from multiscale_jac import fisher

    monkeypatch.setattr(fisher, "MIN_TUNE_SAMPLES", 16)
    from multiscale_jac import _tuning

    order = [("layerwise", 32), ("layerwise", 40), ("vmap", 32)]
    real = _tuning._time_one

    def timed(route, fn, devices) -> float | None:  # the fastest by fiat
        t = real(route, fn, devices)
        if t is None or not isinstance(route, tuple):  # (a layer-wise kernel's probe)
            return t
        return 1.0 if order.index((route[0].value, route[1])) == fastest else 2.0

    monkeypatch.setattr(_tuning, "_time_one", timed)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4))
    data = [(torch.randn(40, 5).to(DTYPE), torch.randint(0, 4, (40,)))]
    model = model.to(DTYPE)
    ref = mj.diag_fisher(model, data, method="layerwise")
    first = mj.diag_fisher(model, data)
    method, chunk = order[fastest]
    assert first.notes[-1].endswith(f"chose {method!r} with {chunk} samples a chunk"), first.notes
    seen: list[int] = []
    run = fisher._FisherRun._layerwise_chunk

    def count(self, fn, levels, y, noise):
        seen.append(len(y))
        return run(self, fn, levels, y, noise)

    monkeypatch.setattr(fisher._FisherRun, "_layerwise_chunk", count)
    again = mj.diag_fisher(model, data)
    assert seen == sizes
    with_chunk = f" with {chunk} samples a chunk" if method == "layerwise" else ""
    assert again.notes == (f"cached choice: {method!r}{with_chunk} (the same shapes ran before)",)
    for res in (first, again):
        torch.testing.assert_close(res.flat, ref.flat, atol=1e-12, rtol=0)


def test_diag_fisher_tune_leaves_the_random_state(measuring, monkeypatch) -> None:
    """The timed runs of ``auto`` are dropped without drawing from the generator or the
    global random state: ``kind="mc"`` draws the forced method's labels for the next batch."""
    from multiscale_jac import fisher

    monkeypatch.setattr(fisher, "MIN_TUNE_SAMPLES", 16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4))
    model = model.to(DTYPE)
    x = torch.randn(36, 5, dtype=DTYPE)
    data = [(x, torch.zeros(36, dtype=torch.long)), (x[:5] + 1, torch.zeros(5, dtype=torch.long))]

    def mc(**kw) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(3)
        g = torch.Generator().manual_seed(7)
        res = mj.diag_fisher(model, data, kind="mc", mc_samples=2, generator=g, **kw)
        return res.flat, torch.rand(3)  # the global state after the call

    (ref, after_ref), probed = mc(method="layerwise"), _counts()[2]
    got, after = mc()
    assert _counts()[2] > probed  # tuned
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(after, after_ref, atol=0, rtol=0)


def test_jacobian_norm_ties_go_to_the_largest_chunk(measuring, monkeypatch) -> None:
    """Routes the timing cannot tell apart (here: every chunk takes the same time per sample)
    go to the one with the largest chunk, the fewest vectorised calls (192 samples: 128 for
    the warm-up chunk and the routes' chunks, ``vmap`` also timed at 64 on the rest)."""
    from multiscale_jac import _tuning, jacnorm

    real = _tuning._time_one

    def same_rate(route, fn, devices) -> float | None:
        t = real(route, fn, devices)
        return None if t is None else 1e-3

    seen: list[list[int]] = []
    route = jacnorm._Job._route

    def spy(self, method):
        run = route(self, method)

        def call(with_grad, chunks):
            chunks = list(chunks)
            seen.extend(c[1] for c in chunks[:1])  # none left: the tune's took every sample
            return run(with_grad, chunks)

        return call

    monkeypatch.setattr(_tuning, "_time_one", same_rate)
    monkeypatch.setattr(jacnorm._Job, "_route", spy)
    jobs = jacnorm_jobs(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    x = torch.randn(192, 4, dtype=DTYPE)
    mj.jacobian_sq_norm(model.to(DTYPE), x).backward()
    assert jobs[-1].notes[-1].endswith("chose 'vmap' with 64 samples a chunk"), jobs[-1].notes


@pytest.mark.parametrize(
    "planned, faster, chosen",
    [
        (None, "smaller", 12),
        (None, "larger", 12),
        (3, "larger", 12),
        (2, "larger", 6),
        (4, "smaller", 4),
        (3, "flat", 3),
        (1, "larger", 1),
    ],
    ids=[
        "whole-bucket-is-not-timed",
        "whole-bucket-stays",
        "three-grows-to-the-bucket",
        "two-grows-up-to-growth-times-the-plan",
        "four-never-shrinks",
        "no-fixed-cost-stays",
        "one-sample-is-not-grown",
    ],
)
def test_auto_times_the_samples_per_call(
    measuring, monkeypatch, planned, faster: str, chosen: int
) -> None:
    """``tune="auto"`` times the chosen route's calls at their planned size and half it, on
    the same samples, and grows them where the fitted fixed cost of a call says larger calls
    pay (where the bucket has the samples; never beyond ``_tuning.GROWTH`` x the planned
    size); nothing larger than the calls that run is timed, and calls never shrink; the size
    runs, is cached, and the result stays exact. Timings forced: per-sample seconds falling
    (``larger``: a fixed cost a call), rising (``smaller``) or flat with the call size."""
    from multiscale_jac import _planning, engine

    monkeypatch.setattr(engine, "MIN_PROBE_BATCH", 3)
    if planned is not None:  # this many samples per call planned (else the whole bucket)
        plan_chunks = _planning.plan_chunks
        monkeypatch.setattr(
            _planning,
            "plan_chunks",
            lambda *a, **kw: dataclasses.replace(plan_chunks(*a, **kw), samples=planned),
        )
    from multiscale_jac import _tuning

    real = _tuning._time_one

    sizes: list[int] = []

    def forced(size, fn, devices) -> float | None:  # keys: samples per call
        t = real(size, fn, devices)
        sizes.append(size)
        per_sample = {"larger": 1.0 / size, "smaller": float(size), "flat": 1.0}[faster]
        return None if t is None else per_sample

    monkeypatch.setattr(_tuning, "_time_one", forced)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(12, 3)
    ).to(DTYPE)
    x = torch.randn(12, 2, 4, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    kwargs = dict(strategy="vmap", mode="rev", entries="generic")
    res = mj.per_sample_jacobian(model, x, **kwargs)
    timed = [n for n in res.notes if " in calls of " in n]
    if planned in (1, None):  # one sample a call fills the working set, or the whole
        assert not timed, res.notes  # bucket runs in one call: not timed
    else:
        (note,) = timed
        assert note.endswith(f"chose {chosen}"), note
    if timed:
        assert max(sizes) == (planned or 12), sizes  # no call timed above the planned size
    assert res.chunk_size == chosen, res.notes
    ref = mj.reference.per_sample_jacobian_loop(model, x)
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    probed = mj.plan_cache_info().probed
    again = mj.per_sample_jacobian(model, x, **kwargs)
    assert mj.plan_cache_info().probed == probed  # cached: nothing timed again
    assert again.chunk_size == chosen
    torch.testing.assert_close(again.jacobian, ref.jacobian, atol=1e-10, rtol=0)


def test_a_given_chunk_size_is_not_timed(measuring, monkeypatch) -> None:
    """The caller's ``chunk_size`` is kept: no call size is timed against it."""
    from multiscale_jac import engine

    monkeypatch.setattr(engine, "MIN_PROBE_BATCH", 3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).to(DTYPE)
    x = torch.randn(12, 4, dtype=DTYPE)
    res = mj.per_sample_jacobian(model, x, strategy="vmap", mode="rev", chunk_size=8)
    assert res.chunk_size == 8
    assert not [n for n in res.notes if " in calls of " in n], res.notes


# ---------------------------------------------------------------------- every sample its own shape
def _own_shapes() -> list:
    """Four samples of ``DenseHead``, each with a shape of its own (every bucket a singleton)."""
    from cases import ragged_samples

    return ragged_samples([[(3, 4)], [(2, 2)], [(4, 3)], [(1, 2)]], [2])


def _forced_estimates(monkeypatch, ratio: float) -> None:
    """The engine's route estimates (``plan_seconds`` in :meth:`tune`): 1 s for the cost
    model's own choice (planned first), ``ratio`` s for every other route."""
    from multiscale_jac import engine

    first: list = []

    def fake(plan) -> float:
        first.append(first[0] if first else plan)
        return 1.0 if plan is first[0] else ratio

    monkeypatch.setattr(engine, "plan_seconds", fake)


@pytest.mark.parametrize(
    ("ratio", "deep", "timed"),
    [
        (2.0, False, True),  # within the cost model's known error (SHORTLIST): timed
        (10.0, False, False),  # ruled out by the estimate: not timed
        (10.0, True, True),  # a deep model: its estimates are known to be further off
        (100.0, True, False),  # beyond DEEP_SHORTLIST even so
    ],
)
def test_close_estimates_are_timed_on_singleton_buckets(
    measuring, monkeypatch, ratio: float, deep: bool, timed: bool
) -> None:
    """``tune="auto"`` times the routes estimated within the model's error of each other also
    where every sample has a shape of its own (it did not: the largest bucket had one sample),
    each route on samples of its own; far estimates are not timed. The timed samples stay in
    the result: exact against the loop either way."""
    from multiscale_jac import engine

    monkeypatch.setattr(engine, "MIN_PROBE_BATCH", 4)
    monkeypatch.setattr(engine, "SMALL_JOB_S", 0.0)  # planned in full, however quick
    monkeypatch.setattr(engine, "DEEP_DEPTH", 1 if deep else 10**9)
    _forced_estimates(monkeypatch, ratio)
    model = CASE_BY_ID["dense_per_pixel"].build()
    res = mj.per_sample_jacobian(model, _own_shapes(), params="cls.*", entries="generic")
    probed = mj.plan_cache_info().probed
    spread = [n for n in res.notes if n.startswith("tune: every sample has a shape of its own")]
    assert (probed > 0) == timed and bool(spread) == timed, res.notes
    assert any(n.startswith("tune: a deep model") for n in res.notes) == (deep and timed)
    ref = mj.reference.per_sample_jacobian_loop(model, _own_shapes(), params="cls.*")
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    again = mj.per_sample_jacobian(model, _own_shapes(), params="cls.*", entries="generic")
    assert mj.plan_cache_info().probed == probed  # cached: no second probe
    torch.testing.assert_close(again.jacobian, ref.jacobian, atol=1e-10, rtol=0)


@pytest.mark.parametrize(("tune", "timed"), [("estimate", False), ("measure", True)])
def test_tune_estimate_never_times_and_measure_always(
    measuring, monkeypatch, tune: str, timed: bool
) -> None:
    """Close estimates on singleton buckets: ``estimate`` never times, ``measure`` always (the
    fixture keeps ``auto`` from timing here: MIN_PROBE_BATCH)."""
    _forced_estimates(monkeypatch, 1.0)
    model = CASE_BY_ID["dense_per_pixel"].build()
    res = mj.per_sample_jacobian(model, _own_shapes(), params="cls.*", tune=tune)
    assert (mj.plan_cache_info().probed > 0) == timed, res.notes
    ref = mj.reference.per_sample_jacobian_loop(model, _own_shapes(), params="cls.*")
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)


def test_a_memory_budget_bounds_the_timed_routes(monkeypatch) -> None:
    """Every timed route is planned within ``memory_budget`` (a route that does not fit is no
    candidate): under a budget the singleton buckets are timed and the result is exact."""
    _forced_estimates(monkeypatch, 1.0)
    model = CASE_BY_ID["dense_per_pixel"].build()
    ref = mj.reference.per_sample_jacobian_loop(model, _own_shapes(), params="cls.*")
    budget = ref.jacobian.numel() * 8 * 4 + 2**20
    res = mj.per_sample_jacobian(
        model, _own_shapes(), params="cls.*", tune="measure", memory_budget=budget
    )
    assert mj.plan_cache_info().probed > 0, res.notes
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)


@pytest.mark.parametrize(("times", "noted"), [((8.0, 1.0), True), ((1.5, 1.0), False)])
def test_a_contradicted_estimate_says_what_the_cost_model_missed(times, noted: bool) -> None:
    """Where the timing ranks the estimate's choice below another route by SHORTLIST x or
    more against the estimate, a note gives both routes' estimates and times for the job and
    what the cost model missed (here: seconds a pass far over its per-pass constant)."""
    from multiscale_jac import engine
    from multiscale_jac._checks import prepare
    from multiscale_jac._planning import EngineOptions
    from multiscale_jac.enums import Tune

    model = CASE_BY_ID["dense_per_pixel"].build()
    prep = prepare(
        model,
        _own_shapes(),
        params="cls.*",
        output_fn=None,
        batch_norm="error",
        randomness="error",
        input_kind=None,
    )
    run = engine._EngineRun(
        prep.function(prep.packed), prep.packed, EngineOptions(tune=Tune.MEASURE)
    )
    run.first()
    (first, _), (other, _) = run.trial[:2]
    run.estimates = {first: 1.0, other: 2.0}  # the estimate's choice: twice as fast
    slow, fast = times  # per sample (4 samples)
    run._contradiction(first, other, {first: slow, other: fast}, dict(run.trial))
    notes = [n for n in run.notes if "contradicts the estimate" in n]
    assert bool(notes) == noted, run.notes
    if noted:
        assert f"by {round(slow / fast * 2)}x" in notes[0]
        assert "measured 32 s and 4 s for the job" in notes[0]
        assert notes[0].endswith("is what it missed"), notes[0]


@pytest.mark.slow  # the deep model; the DenseHead case above checks the same rule in the fast tier
def test_bifpn_entries_spread_through_its_cells_on_own_shapes() -> None:
    """The BiFPN with single entries spread through its cells (edge weights, convs, BatchNorm)
    on pyramids of a shape each: every route timed on samples of its own, the result exact."""
    from cases import bifpn_pyramids, bifpn_spread

    model = CASE_BY_ID["bifpn_ragged"].build()
    subset = bifpn_spread(model)
    inputs = lambda: bifpn_pyramids([(4, 4), (8, 4), (4, 8), (8, 8)])  # noqa: E731
    res = mj.per_sample_jacobian(model, inputs(), params=subset, tune="measure")
    assert any(n.startswith("tune: every sample has a shape of its own") for n in res.notes)
    ref = mj.reference.per_sample_jacobian_loop(model, inputs(), params=subset)
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    torch.testing.assert_close(res.outputs, ref.outputs, atol=1e-10, rtol=0)


@pytest.mark.parametrize("case_id", ["fpn_scale_ragged", "seed_convblock_levels"])
def test_no_timed_call_holds_more_than_measure_x_the_lightest_route(
    measuring, monkeypatch, case_id: str
) -> None:
    """Every call ``auto`` times holds at most ``_tuning.MEASURE`` x the working set of the
    lightest shortlisted route's planned calls (the memory model's), or is one sample: a
    heavier route runs fewer samples a timed call, so that the measuring's peak memory
    stays near the route that runs, whichever wins. The result stays exact."""
    from multiscale_jac import _tuning, engine

    monkeypatch.setattr(engine, "MIN_PROBE_BATCH", 3)
    calls: list[tuple[int, int, int]] = []  # (samples, planned samples a call, its workset)
    least: list[int] = []
    run_route, try_routes = engine._RouteTiming._run_route, engine._RouteTiming.try_routes

    def spy_routes(self):
        least.append(min(p.workset for _, p in self.trial if p.workset > 0))
        return try_routes(self)

    def spy_run(self, key, plan, k, *args):
        calls.append((k, engine._call_size(plan, self.packed), plan.workset))
        return run_route(self, key, plan, k, *args)

    monkeypatch.setattr(engine._RouteTiming, "try_routes", spy_routes)
    monkeypatch.setattr(engine._RouteTiming, "_run_route", spy_run)
    case = CASE_BY_ID[case_id]
    model = case.build()
    kwargs = dict(params=case.glob, output_fn=case.output_fn)
    inputs = (lambda: case.inputs() * 4) if case.ragged else case.inputs
    res = mj.per_sample_jacobian(model, inputs(), **kwargs)
    assert least and calls, res.notes
    bar = _tuning.MEASURE * least[0] + 1
    # a timed call's working set: its samples a call (one at least, whatever it holds)
    over = [(k, n, w) for k, n, w in calls if min(k, n) > 1 and min(k, n) * w / n > bar]
    assert not over, (calls, least)
    ref = mj.reference.per_sample_jacobian_loop(model, inputs(), **kwargs)
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
