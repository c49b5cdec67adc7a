"""The engine's plan cache: a second call with the same shapes pays no measuring pass, survey
or probe and gives the same result; the cache is bounded, weakly keyed, clearable."""

from __future__ import annotations

import gc

import pytest
import torch
from cases import DTYPE
from conftest import CASE_BY_ID, jacnorm_jobs

import multiscale_jac as mj
from multiscale_jac import _tuning
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


def test_a_small_job_runs_its_cheapest_plan(monkeypatch) -> None:
    """Unless tune=True, a job whose loop is estimated quick skips the survey and the padded
    plan (planning would cost more than it saves); tune=True plans in full."""
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
    full = mj.per_sample_jacobian(model, case.inputs(), params="features.*", tune="measure")
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
    # every timed route call of a tuned run (on more samples than its warm-up's one) ran
    # with the process's objects frozen
    calls: list[tuple[int, int]] = []
    real = mj.engine._fill

    def spy(*args, **kwargs):
        if kwargs.get("only") is not None:
            calls.append((len(kwargs["only"]), gc.get_freeze_count()))
        return real(*args, **kwargs)

    monkeypatch.setattr(mj.engine, "_fill", spy)
    case = CASE_BY_ID["fpn_scale_ragged"]
    mj.per_sample_jacobian(
        case.build(), case.inputs() * 2, params="head.*", output_fn=case.output_fn, tune=True
    )
    timed = [frozen for n, frozen in calls if n > 1]
    assert timed and all(timed), calls
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("tune", ["measure"])
def test_jacobian_norm_times_its_routes_on_the_run_itself(tune: str) -> None:
    """``jacobian_sq_norm(method="auto", tune=True)`` times its routes on the first chunks of the job
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
    assert len(_tuning._DECISIONS) == 1  # the choice
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
    assert _counts()[2] == probed and len(_tuning._DECISIONS) == 0


def test_jacobian_norm_default_chunks_time_every_route(monkeypatch) -> None:
    """With default chunks, ``layerwise`` (whose own default chunk would take most of the
    samples) is timed at ``vmap``'s chunk, ``vmap`` also at a larger chunk (up to GROWTH x
    its own, splitting the 200 samples evenly: 100) and at half its chunk, the larger chunk
    first; the routes' results are dropped: the value equals a forced method's."""
    jobs = jacnorm_jobs(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    model = model.to(DTYPE)
    x = torch.randn(200, 4, dtype=DTYPE)
    ref = mj.jacobian_sq_norm(model, x, method="hvp")
    probed = _counts()[2]
    got = mj.jacobian_sq_norm(model, x, tune=True)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    (note,) = [n for n in jobs[-1].notes if n.startswith("tune: timed")]
    timed = note.split(": ", 2)[2].split(" per sample")[0].split(", ")
    routes = ["vmap/100", "layerwise/32", "vmap/32", "vmap/16", "hvp/16"]
    assert [t.rsplit(" ", 2)[0] for t in timed] == routes, note
    assert _counts()[2] >= probed + len(timed) + 1  # the fastest re-timed at least


@pytest.mark.parametrize("case_id", ["fpn_scale_ragged", "seed_convblock_levels"])
def test_measure_times_routes_on_the_run_itself(case_id: str) -> None:
    """``tune=True``: every route runs the first samples of the job, timed, and those
    samples' Jacobians stay in the result (exact against the loop); the fastest is cached and
    the second call times nothing."""
    case = CASE_BY_ID[case_id]
    model = case.build()
    kwargs = dict(params=case.glob, output_fn=case.output_fn, tune=True)
    inputs = case.inputs
    if case.ragged:  # samples enough in the largest bucket to time every route on one each
        inputs = lambda: case.inputs() * 4  # noqa: E731
    res = mj.per_sample_jacobian(model, inputs(), **kwargs)
    tuned = [n for n in res.notes if n.startswith("tune: timed on")]
    assert tuned and "; chose " in tuned[0], res.notes
    assert mj.plan_cache_info().probed >= 2
    del kwargs["tune"]
    ref = mj.reference.per_sample_jacobian_loop(model, inputs(), **kwargs)
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    torch.testing.assert_close(res.outputs, ref.outputs, atol=1e-10, rtol=0)
    probed = mj.plan_cache_info().probed
    again = mj.per_sample_jacobian(model, inputs(), **kwargs)
    assert mj.plan_cache_info().probed == probed
    torch.testing.assert_close(again.jacobian, ref.jacobian, atol=1e-10, rtol=0)


def test_diag_fisher_times_layerwise_against_vmap_on_the_data() -> None:
    """``diag_fisher(method="auto", tune=True)`` runs the first batch layer-wise, times layer-wise at two
    chunk sizes and ``vmap`` on its samples (those results dropped: the result equals a forced
    method's), caches the fastest, and the second call with the same shapes times nothing."""
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
    res = mj.diag_fisher(model, data, tune=True)
    # timed (how many runs a route takes depends on the machine's speed: not counted)
    assert _counts()[2] > probed
    probed = _counts()[2]
    (note,) = [n for n in res.notes if n.startswith("tune: timed on the data")]
    assert "layerwise/32 " in note and "layerwise/40 " in note and "vmap/32 " in note, note
    torch.testing.assert_close(res.flat, ref.flat, atol=1e-12, rtol=0)
    again = mj.diag_fisher(model, data)  # the default reads the measured choice
    assert _counts()[2] == probed
    assert any("chosen by tune=True before" in n for n in again.notes), again.notes
    torch.testing.assert_close(again.flat, ref.flat, atol=1e-12, rtol=0)


@pytest.mark.parametrize("fastest, sizes", [(0, [40]), (1, [32, 8]), (2, [])])
def test_diag_fisher_runs_the_chunk_it_chose(monkeypatch, fastest: int, sizes: list) -> None:
    """The route and layer-wise chunk ``tune=True`` found fastest are cached and run by later
    default calls: layer-wise in chunks of 32 or of the whole bucket (40), or ``vmap`` (no
    layer-wise run)."""
    from multiscale_jac import _tuning, fisher

    order = ["layerwise/40", "layerwise/32", "vmap/32"]
    real = _tuning._time

    def timed(route, devices) -> float | None:  # the fastest by fiat
        t = real(route, devices)
        if t is None or route.name not in order:  # (a layer-wise kernel's probe)
            return t
        return 1.0 if order.index(route.name) == fastest else 2.0

    monkeypatch.setattr(_tuning, "_time", timed)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4))
    data = [(torch.randn(40, 5).to(DTYPE), torch.randint(0, 4, (40,)))]
    model = model.to(DTYPE)
    ref = mj.diag_fisher(model, data, method="layerwise")
    first = mj.diag_fisher(model, data, tune=True)
    assert first.notes[-1].endswith(f"chose {order[fastest]}"), first.notes
    seen: list[int] = []
    run = fisher._FisherRun._layerwise_chunk

    def count(self, fn, levels, y, noise):
        seen.append(len(y))
        return run(self, fn, levels, y, noise)

    monkeypatch.setattr(fisher._FisherRun, "_layerwise_chunk", count)
    again = mj.diag_fisher(model, data)
    assert seen == sizes
    assert again.notes == (f"plan: {order[fastest]}, chosen by tune=True before for these shapes",)
    for res in (first, again):
        torch.testing.assert_close(res.flat, ref.flat, atol=1e-12, rtol=0)


def test_diag_fisher_tune_leaves_the_random_state() -> None:
    """The timed runs of ``tune=True`` are dropped without drawing from the generator or the
    global random state: ``kind="mc"`` draws the forced method's labels for the next batch."""
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
    got, after = mc(tune=True)
    assert _counts()[2] > probed  # tuned
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(after, after_ref, atol=0, rtol=0)


def test_jacobian_norm_ties_go_to_the_largest_chunk(monkeypatch) -> None:
    """Routes the timing cannot tell apart (here: every chunk takes the same time per sample)
    go to the one with the largest chunk, the fewest vectorised calls (192 samples: ``vmap``
    at 96), which runs the job."""
    from multiscale_jac import _tuning

    real = _tuning._time

    def same_rate(route, devices) -> float | None:
        return None if real(route, devices) is None else 1e-3

    monkeypatch.setattr(_tuning, "_time", same_rate)
    jobs = jacnorm_jobs(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    x = torch.randn(192, 4, dtype=DTYPE)
    mj.jacobian_sq_norm(model.to(DTYPE), x, tune=True).backward()
    assert jobs[-1].notes[-1].endswith("chose vmap/96"), jobs[-1].notes
    assert jobs[-1].chunk_for(jobs[-1].method) == 96


def test_a_given_chunk_size_is_kept_when_measuring() -> None:
    """The caller's ``chunk_size`` is kept under ``tune=True``: routes are timed at it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).to(DTYPE)
    x = torch.randn(12, 4, dtype=DTYPE)
    res = mj.per_sample_jacobian(model, x, strategy="vmap", chunk_size=8, tune=True)
    assert res.chunk_size == 8
    assert mj.plan_cache_info().probed > 0, res.notes


# ---------------------------------------------------------------------- every sample its own shape
def _own_shapes() -> list:
    """Four samples of ``DenseHead``, each with a shape of its own (every bucket a singleton)."""
    from cases import ragged_samples

    return ragged_samples([[(3, 4)], [(2, 2)], [(4, 3)], [(1, 2)]], [2])


@pytest.mark.parametrize(
    ("tune", "timed"), [("auto", False), ("estimate", False), ("measure", True)]
)
def test_only_tune_true_times_routes_on_singleton_buckets(tune: str, timed: bool) -> None:
    """Every sample a shape of its own: ``auto`` and ``estimate`` time nothing, ``measure``
    times every route on the same smallest samples; the result is exact either way."""
    model = CASE_BY_ID["dense_per_pixel"].build()
    res = mj.per_sample_jacobian(model, _own_shapes(), params="cls.*", tune=tune)
    assert (mj.plan_cache_info().probed > 0) == timed, res.notes
    ref = mj.reference.per_sample_jacobian_loop(model, _own_shapes(), params="cls.*")
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)


def test_a_memory_budget_bounds_the_timed_routes() -> None:
    """Every timed route is planned within ``memory_budget`` (a route that does not fit is no
    candidate): under a budget the singleton buckets are timed and the result is exact."""
    model = CASE_BY_ID["dense_per_pixel"].build()
    ref = mj.reference.per_sample_jacobian_loop(model, _own_shapes(), params="cls.*")
    budget = ref.jacobian.numel() * 8 * 4 + 2**20
    res = mj.per_sample_jacobian(
        model, _own_shapes(), params="cls.*", tune="measure", memory_budget=budget
    )
    assert mj.plan_cache_info().probed > 0, res.notes
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)


@pytest.mark.slow  # the deep model; the DenseHead case above checks the same rule in the fast tier
def test_bifpn_entries_spread_through_its_cells_on_own_shapes() -> None:
    """The BiFPN with single entries spread through its cells (edge weights, convs, BatchNorm)
    on pyramids of a shape each: every route timed on the same samples, the result exact."""
    from cases import bifpn_pyramids, bifpn_spread

    model = CASE_BY_ID["bifpn_ragged"].build()
    subset = bifpn_spread(model)
    inputs = lambda: bifpn_pyramids([(4, 4), (8, 4), (4, 8), (8, 8)])  # noqa: E731
    res = mj.per_sample_jacobian(model, inputs(), params=subset, tune="measure")
    assert any(n.startswith("tune: timed on") for n in res.notes), res.notes
    ref = mj.reference.per_sample_jacobian_loop(model, inputs(), params=subset)
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    torch.testing.assert_close(res.outputs, ref.outputs, atol=1e-10, rtol=0)
