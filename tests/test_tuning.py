"""Measuring in one place (``multiscale_jac._tuning``): the loop's rules (warm-up, retime, tie),
the decision caches and their file form (``multiscale_jac.tuning.save`` / ``load``)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import multiscale_jac as mj
from multiscale_jac import _tuning

DTYPE = torch.float64
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_clock(monkeypatch):
    """The loop's clock reads the seconds the run callback leaves in ``clock[0]``."""
    clock = [0.0]

    @contextlib.contextmanager
    def stopwatch(devices=()):
        elapsed: list[float] = []
        yield elapsed
        elapsed.append(clock[0])

    monkeypatch.setattr(_tuning, "stopwatch", stopwatch)
    return clock


def test_every_candidate_warms_up_then_those_within_retime_run_again(fake_clock) -> None:
    """Warm-up, one timed run each, then a second round for those within RETIME of the
    fastest (the faster time counting); a failed candidate is absent."""
    seconds = {"a": [9.0, 1.0, 0.8], "b": [9.0, 2.5, 3.0], "c": [9.0, 4.0], "d": [None]}
    calls: list[str] = []

    def run(k: str) -> float | None:
        calls.append(k)
        t = seconds[k].pop(0)
        if t is None:
            return None
        fake_clock[0] = t
        return 1.0

    probes = _tuning.COUNTS["probe"]
    times = _tuning.time_candidates(["a", "b", "c", "d"], run)
    assert calls == ["a", "a", "b", "b", "c", "c", "d", "a", "b"]
    assert times == {"a": 0.8, "b": 2.5, "c": 4.0}
    assert _tuning.COUNTS["probe"] == probes + 5  # timed runs only, not warm-ups


def test_a_skipped_candidate_is_not_timed_and_units_divide(fake_clock) -> None:
    def run(k: str) -> float:
        fake_clock[0] = {"a": 4.0, "b": 40.0}[k]
        return 4.0  # four samples: seconds per sample

    times = _tuning.time_candidates(
        ["a", "b"], run, skip=lambda k, warm, times: bool(times) and warm > 4 * min(times.values())
    )
    assert times == {"a": 1.0}


@pytest.mark.parametrize(
    ("times", "prefer", "chosen"),
    [
        ({"small": 1.0, "large": 1.04}, "large".__eq__, "large"),  # within TIE: the preferred
        ({"small": 1.0, "large": 1.06}, "large".__eq__, "small"),  # outside TIE: the fastest
        ({"small": 1.04, "large": 1.0}, None, "large"),  # no preference: the fastest
    ],
    ids=["tie-goes-to-preferred", "no-tie", "no-preference"],
)
def test_pick_breaks_ties_by_the_callers_preference(times, prefer, chosen) -> None:
    assert _tuning.pick(times, prefer=prefer) == chosen


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 36, 3)).to(
        DTYPE
    )


def _data(n: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, 8, 8, generator=g, dtype=DTYPE), torch.randint(0, 3, (n,)))]


def _ragged() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    sizes = [8, 8, 10, 10, 8, 10, 8, 10, 8]
    return [torch.randn(3, s, s, generator=g, dtype=DTYPE) for s in sizes]


class _Fcn(nn.Module):
    """A per-pixel head: outputs as large as the input (ragged samples, ragged outputs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh())
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _work() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The engine (ragged), the Fisher and the Jacobian-norm regulariser, each measuring."""
    fcn = _Fcn().to(DTYPE)
    jac = mj.per_sample_jacobian(fcn, _ragged(), params="head.*", tune="measure").jacobian
    fisher = mj.diag_fisher(_net(), _data(), tune="measure").flat
    norm = mj.jacobian_sq_norm(_net(), _data(70)[0][0], tune="measure")
    return jac, fisher, norm


def _counts() -> tuple[int, int, int]:
    info = mj.plan_cache_info()
    return info.measured, info.surveyed, info.probed


def test_saved_decisions_measure_nothing_after_load(tmp_path) -> None:
    """What the engine, the Fisher and the Jacobian-norm regulariser measured, saved and loaded
    into an emptied cache: new models of the same structure run the saved choices (no
    measuring pass, survey or probe) to the same numbers."""
    first = _work()
    assert _counts()[2] > 0  # it measured
    path = tmp_path / "decisions.pt"
    written = mj.tuning.save(path)
    assert written >= 3
    mj.clear_plan_cache()
    assert mj.tuning.load(path) == written
    again = _work()
    assert _counts() == (0, 0, 0)
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_a_decision_from_another_machine_setting_is_not_used(tmp_path) -> None:
    """The key holds the environment (here: the CPU threads): a decision measured with other
    settings is ignored and the call measures again."""
    mj.diag_fisher(_net(), _data(), tune="measure")
    path = tmp_path / "decisions.pt"
    mj.tuning.save(path)
    mj.clear_plan_cache()
    mj.tuning.load(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        res = mj.diag_fisher(_net(), _data(), tune="measure")
    finally:
        torch.set_num_threads(threads)
    assert _counts()[2] > 0 and not any(n.startswith("cached") for n in res.notes), res.notes


def test_a_foreign_file_is_refused(tmp_path) -> None:
    """Not a decision file, or one holding anything but plain data and the library's decision
    types (read with ``weights_only=True``): a ValueError naming the file."""
    plain = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, plain)
    with pytest.raises(ValueError, match=re.escape(str(plain))):
        mj.tuning.load(plain)
    code = tmp_path / "code.pt"
    torch.save({"format": _tuning._FORMAT, "decisions": {"plans": {"k": nn.Linear(1, 1)}}}, code)
    with pytest.raises(ValueError, match=re.escape(str(code))):
        mj.tuning.load(code)
    assert len(_tuning.PLAN_CACHE.known) == 0


def test_closures_key_by_what_they_hold() -> None:
    """Two output functions of the same code holding different values have different keys; one
    holding a tensor cannot be written at all (its state is not its code)."""

    def span(a: int):
        return lambda out: out[:, a:]

    model = nn.Linear(2, 2)
    k1 = _tuning.portable_key(model, ("x", span(1)))
    k2 = _tuning.portable_key(model, ("x", span(2)))
    assert k1 != k2 and k1 == _tuning.portable_key(model, ("x", span(1)))
    w = torch.ones(2)
    with pytest.raises(_tuning._Unportable):
        _tuning.portable_key(model, ("x", lambda out: out * w))


def test_a_forward_with_a_comprehension_keys_the_same_in_every_process() -> None:
    """A comprehension in ``forward`` is a nested code object whose ``repr`` holds its address:
    the same source compiled twice (as in two processes) keys the same, other code does not."""
    source = textwrap.dedent(
        """
        import torch
        class Block(torch.nn.Module):
            def forward(self, xs):
                return torch.cat([x.flatten(1) {op} 1 for x in xs], dim=1)
        """
    )

    def compiled(op: str) -> type:
        space: dict = {}
        exec(compile(source.format(op=op), "<model>", "exec"), space)
        return space["Block"]

    a, b, c = compiled("*"), compiled("*"), compiled("+")
    assert repr(a.forward.__code__.co_consts) != repr(b.forward.__code__.co_consts)  # addresses
    assert _tuning.portable_key(a(), ("k",)) == _tuning.portable_key(b(), ("k",))
    assert _tuning.portable_key(a(), ("k",)) != _tuning.portable_key(c(), ("k",))


def test_tune_false_never_probes_a_kernel(measuring, monkeypatch) -> None:
    """The layer-wise convolution kernels are timed under ``auto`` / ``measure`` only: with
    ``tune=False`` the columns run and nothing is timed or cached."""
    from multiscale_jac import layerwise

    monkeypatch.setattr(layerwise, "PROBE_MIN_FLOPS", 0.0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 16, 3))
    data = [(torch.randn(6, 8, 4, 4), torch.randint(3, (6,)))]
    mj.diag_fisher(model, data, method="layerwise", tune=False)
    assert _counts()[2] == 0 and len(_tuning.KERNEL_CACHE) == 0
    mj.diag_fisher(model, data, method="layerwise", tune=True)
    assert _counts()[2] > 0 and len(_tuning.KERNEL_CACHE) > 0


def test_the_clock_is_read_in_tuning_alone() -> None:
    """One place measures: no other module of the package reads a clock."""
    package = ROOT / "multiscale_jac"
    readers = [
        str(p.relative_to(package))
        for p in sorted(package.rglob("*.py"))
        if p.name != "_tuning.py"
        and any(
            w in p.read_text() for w in ("perf_counter", "stopwatch(", "monotonic(", "time.time(")
        )
    ]
    assert readers == []


@pytest.mark.slow
def test_the_environment_variable_names_a_file_that_outlives_the_process(tmp_path) -> None:
    """``MULTISCALE_JAC_TUNING_CACHE``: the first process measures and writes the file at exit;
    the second reads it and measures nothing."""
    script = textwrap.dedent(
        """
        import torch, multiscale_jac as mj
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        x = torch.randn(40, 5)
        mj.diag_fisher(model, [(x, torch.randint(0, 3, (40,)))], tune="measure")
        print(mj.plan_cache_info().probed)
        """
    )
    env = {**os.environ, _tuning.ENV_VAR: str(tmp_path / "decisions.pt")}
    env["PYTHONPATH"] = str(ROOT)

    def probes() -> int:
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        return int(out.stdout.split()[-1])

    assert probes() > 0
    assert (tmp_path / "decisions.pt").exists()
    assert probes() == 0


# ---------------------------------------------------------------------- measuring pays
@pytest.mark.parametrize(
    ("extra", "work", "first", "second"),
    [(1.0, 10.0, "measure", "measure"), (5.0, 10.0, "defer", "measure")],
    ids=["pays", "deferred-then-measured"],
)
def test_decide_measures_where_it_pays_or_the_call_repeats(
    measuring, monkeypatch, extra, work, first, second
) -> None:
    monkeypatch.setattr(_tuning, "PAYS", 0.25)
    owner = nn.Linear(1, 1)
    assert _tuning.decide(mj.Tune.AUTO, owner, "k", extra=extra, work=work) == first
    assert _tuning.decide(mj.Tune.AUTO, owner, "k", extra=extra, work=work) == second
    assert _tuning.decide(mj.Tune.ESTIMATE, owner, "j", extra=0.0, work=1.0) == "estimate"
    assert _tuning.decide(mj.Tune.MEASURE, owner, "j", extra=9.0, work=1.0) == "measure"
    _tuning.set_auto_measures(False)
    assert _tuning.decide(mj.Tune.AUTO, owner, "j", extra=0.0, work=1.0) == "estimate"


def _one_shot_then_repeated(call) -> list[int]:
    """Probes counted by each of three calls of ``call``."""
    counts = []
    for _ in range(3):
        before = _counts()[2]
        notes = call()
        counts.append(_counts()[2] - before)
        deferred = any("ran the estimate; the same call again measures" in n for n in notes)
        assert deferred == (len(counts) == 1), notes
    return counts


def test_each_entry_point_defers_measuring_a_one_shot_call(measuring, monkeypatch) -> None:
    """Where measuring costs more than PAYS of a call (small jobs here), ``tune="auto"`` runs
    the estimate's choice on the first call (nothing timed, a note says so), measures on the
    second call of the same shapes and runs the cached choice from the third: a one-shot
    call never pays for measuring."""
    from multiscale_jac import engine

    monkeypatch.setattr(_tuning, "PAYS", 0.25)
    monkeypatch.setattr(engine, "SMALL_JOB_S", 0.0)
    monkeypatch.setattr(engine, "MIN_PROBE_BATCH", 4)
    fcn, fisher_net, norm_net = _Fcn().to(DTYPE), _net(), _net()
    ragged, data, x = _ragged(), _data(), _data(200)[0][0]
    runs = {
        "per_sample_jacobian": lambda: mj.per_sample_jacobian(fcn, ragged, params="head.*").notes,
        "diag_fisher": lambda: mj.diag_fisher(fisher_net, data).notes,
    }
    for name, call in runs.items():
        first, second, third = _one_shot_then_repeated(call)
        assert first == 0 and second > 0 and third == 0, name
    jobs: list = []
    from multiscale_jac import jacnorm

    init = jacnorm._Job.__init__
    monkeypatch.setattr(
        jacnorm._Job, "__init__", lambda self, *a, **k: (init(self, *a, **k), jobs.append(self))[0]
    )
    first, second, third = _one_shot_then_repeated(
        lambda: (mj.jacobian_sq_norm(norm_net, x), jobs[-1].notes)[1]
    )
    assert first == 0 and second > 0 and third == 0


def test_a_layers_kernels_are_timed_the_second_time_it_is_met(measuring, monkeypatch) -> None:
    """Timing a convolution's kernels costs several runs of the layer: under ``auto`` its
    first meeting runs columns (nothing timed or cached), the second times them, the third
    runs the cached choice."""
    from multiscale_jac import layerwise

    monkeypatch.setattr(_tuning, "PAYS", 0.25)
    monkeypatch.setattr(layerwise, "PROBE_MIN_FLOPS", 0.0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 16, 3))
    data = [(torch.randn(6, 8, 4, 4), torch.randint(3, (6,)))]
    probes = []
    for _ in range(3):
        before = _counts()[2]
        mj.diag_fisher(model, data, method="layerwise")
        probes.append(_counts()[2] - before)
    assert probes[0] == 0 and probes[1] > 0 and probes[2] == 0, probes


def test_a_deferred_decision_waits_for_a_later_call_not_a_later_chunk(
    measuring, monkeypatch
) -> None:
    """Met again inside the same public call (a Laplace fit's next chunk), a deferred decision
    still runs the estimate: the call's work was counted once; the next call measures."""
    monkeypatch.setattr(_tuning, "PAYS", 0.25)
    owner = nn.Linear(1, 1)
    with _tuning.call_scope():
        assert _tuning.decide(mj.Tune.AUTO, owner, "k", extra=5.0, work=1.0) == "defer"
        with _tuning.call_scope():  # nested: the same call
            assert _tuning.decide(mj.Tune.AUTO, owner, "k", extra=5.0, work=1.0) == "defer"
    with _tuning.call_scope():
        assert _tuning.decide(mj.Tune.AUTO, owner, "k", extra=5.0, work=1.0) == "measure"


@pytest.mark.parametrize(("warm_a", "stops"), [(3.0, True), (1.0, False)], ids=["stops", "goes-on"])
def test_timing_stops_where_it_does_not_pay_as_measured(fake_clock, warm_a, stops) -> None:
    """With the job's ``units``: once the seconds spent beyond the units done at the fastest
    rate exceed PAYS of the job at that rate, nothing more is timed (a warm-up of 3 s on a
    job of 4 s at 1 s a unit: 2 s beyond, over 0.25 x 4 = 1 s)."""
    seconds = {"a": [warm_a, 1.0, 1.0], "b": [1.0, 1.5]}
    calls: list[str] = []
    stopped: list[bool] = []

    def run(k: str) -> float:
        calls.append(k)
        fake_clock[0] = seconds[k].pop(0)
        return 1.0

    times = _tuning.time_candidates(
        ["a", "b"], run, units=4.0, retime=1.2, on_stop=lambda: stopped.append(True)
    )
    if stops:
        assert calls == ["a", "a"] and times == {"a": 1.0} and stopped == [True]
    else:
        assert calls == ["a", "a", "b", "b", "a"] and times == {"a": 1.0, "b": 1.5}
        assert stopped == []


def test_a_first_call_whose_timing_does_not_pay_defers(measuring, monkeypatch, fake_clock) -> None:
    """The engine measures where the estimate says it pays; where the timing then costs more
    than PAYS of the job as measured (every timed block 1 s, PAYS tiny: a warm-up of one
    sample already does), it stops after the estimate's route, caches nothing and says so;
    the next call measures, the third runs the cache."""
    from multiscale_jac import engine

    fake_clock[0] = 1.0
    monkeypatch.setattr(_tuning, "PAYS", 1e-9)
    monkeypatch.setattr(engine, "PAYS", 1e-9)
    monkeypatch.setattr(engine, "SMALL_JOB_S", 0.0)
    monkeypatch.setattr(engine, "MIN_PROBE_BATCH", 4)
    monkeypatch.setattr(engine._RouteTiming, "timing_cost", lambda self, *a: (0.0, 1.0))
    # every route timed on its full share (a heavier route's calls capped to one sample would
    # take 1 s a sample here, the rate of the warm-up: timing that pays)
    monkeypatch.setattr(_tuning, "MEASURE", 1e9)
    fcn, ragged = _Fcn().to(DTYPE), _ragged()
    probes, stopped = [], []
    for _ in range(3):
        before = _counts()[2]
        notes = mj.per_sample_jacobian(fcn, ragged, params="head.*").notes
        probes.append(_counts()[2] - before)
        stopped.append(any("timing stopped" in n for n in notes))
    assert stopped == [True, False, False], stopped
    assert probes[0] <= 1 and probes[1] > probes[0] and probes[2] == 0, probes


@pytest.mark.parametrize(
    ("samples", "workset", "chosen", "most"),
    [(4, 100, 100, 16), (4, 200, 100, 8), (4, 1000, 100, 4), (4, 50, 100, 16), (4, 100, 0, 16)],
    ids=["as-chosen", "twice", "over-growth", "half", "unplanned"],
)
def test_growth_bounds_what_is_timed_by_the_estimates_working_set(
    samples: int, workset: int, chosen: int, most: int
) -> None:
    """A candidate over GROWTH x the estimate's choice's working set is not timed, and a call
    grows its samples only while its working set stays within that (at least as it is, at
    most GROWTH x its samples)."""
    assert _tuning.GROWTH == 4
    assert _tuning.grows(workset, chosen) is (chosen > 0 and workset > 4 * chosen)
    assert _tuning.grown(samples, workset, chosen) == most


def test_a_route_over_growth_is_not_timed(measuring) -> None:
    """Timing the routes: forward mode with generic entries of 96 entries selected by index
    of a wide weight holds a tangent of the whole (512, 2048) weight per entry and sample
    (the memory model counts it: 4 MiB each), over GROWTH x the default working set (the
    structured route the estimate chose holds less): it is not run, and a note says so with
    both working sets."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 512), nn.Tanh(), nn.Linear(512, 3)).eval()
    subset = mj.ParamSubset.from_indices(model, {"0.weight": torch.arange(0, 96 * 97, 97)})
    x = torch.randn(64, 2048)
    res = mj.per_sample_jacobian(model, x, params=subset, mode="fwd", tune="measure")
    assert res.structured == ("0.weight",)
    (note,) = [n for n in res.notes if n.startswith("tune: not timed")]
    assert "vmap/fwd/generic" in note and "MiB" in note, note
    timed = [n for n in res.notes if n.startswith("tune: timed")]
    assert all("generic" not in n for n in timed), timed


def test_freed_memory_is_released_after_every_timed_run(fake_clock, monkeypatch) -> None:
    """The rule **release**: after each warm-up and timed run (retimes included) the loop
    gives freed heap memory back, so one candidate's freed memory does not stay resident
    under the next's."""
    released, runs = [], []
    monkeypatch.setattr(_tuning, "release", lambda: released.append(len(runs)))

    def run(k: str) -> float:
        runs.append(k)
        fake_clock[0] = {"a": 1.0, "b": 1.5}[k]
        return 1.0

    _tuning.time_candidates(["a", "b"], run)
    assert len(runs) == 6  # warm-up, timed, retimed: both within RETIME
    assert released == [1, 2, 3, 4, 5, 6]


def _budgeted(tune: str, monkeypatch) -> list[list[str]]:
    """The engine (ragged), the Fisher and the Jacobian-norm regulariser under a budget large
    enough for every route: their notes."""
    from multiscale_jac import jacnorm

    jobs: list[object] = []
    init = jacnorm._Job.__init__

    def spy(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        jobs.append(self)

    monkeypatch.setattr(jacnorm._Job, "__init__", spy)
    budget = 64 * 2**20
    fcn = _Fcn().to(DTYPE)
    jac = mj.per_sample_jacobian(fcn, _ragged(), params="head.*", tune=tune, memory_budget=budget)
    fisher = mj.diag_fisher(_net(), _data(), tune=tune, memory_budget=budget)
    mj.jacobian_sq_norm(_net(), _data(70)[0][0], tune=tune, memory_budget=budget)
    norm = [n for job in jobs for n in job.notes]  # type: ignore[attr-defined]
    return [list(jac.notes), list(fisher.notes), norm]


def test_under_a_budget_auto_times_nothing_on_any_entry_point(measuring, monkeypatch) -> None:
    """The rule **budget** (``_tuning.under_budget``): ``tune="auto"`` with a ``memory_budget``
    runs the estimate's choice on every entry point (no probe, the note says why), where
    ``tune="measure"`` times the same jobs."""
    probes = _tuning.COUNTS["probe"]
    for notes in _budgeted("auto", monkeypatch):
        assert _tuning.BUDGET_NOTE in notes, notes
    assert _tuning.COUNTS["probe"] == probes
    mj.clear_plan_cache()
    _budgeted("measure", monkeypatch)
    assert _tuning.COUNTS["probe"] > probes


def test_call_fit_recovers_a_fixed_cost_and_a_cost_per_sample() -> None:
    """Calls of 2 s plus 0.5 s a sample, seen as seconds per sample at 2 and 4 samples."""
    fixed, each = _tuning.call_fit(2, (2 + 2 * 0.5) / 2, 4, (2 + 4 * 0.5) / 4)
    assert (fixed, each) == pytest.approx((2.0, 0.5))
    fixed, each = _tuning.call_fit(3, 1.0, 6, 1.0)  # no fixed cost: nothing to grow for
    assert (fixed, each) == pytest.approx((0.0, 1.0))


@pytest.mark.parametrize(
    ("samples", "workset", "least", "timed"),
    [
        (16, 32, 10, 3),  # a heavier route: 0.6 x 10 of its 2 a sample
        (16, 8, 10, 12),  # the lightest route too: 0.6 x 10 of its 0.5 a sample
        (16, 5, 10, 16),  # lighter than the bar: as planned
        (16, 10_000, 10, 1),  # one sample over the bar still runs one
        (16, 32, 0, 16),  # nothing planned: no rule
    ],
)
def test_trial_samples_keep_a_timed_call_within_measure_x_the_lightest(
    samples: int, workset: int, least: int, timed: int
) -> None:
    assert _tuning.MEASURE == 0.6
    assert _tuning.trial_samples(samples, workset, least) == timed
