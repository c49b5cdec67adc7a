"""Measuring in one place (``multiscale_jac._tuning``): the loop's rules (warm-up, retime, tie),
the decision caches and their file form (``multiscale_jac.tuning.save`` / ``load``)."""

from __future__ import annotations

import contextlib
import json
import math
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
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)  # (chunks summed in another order)


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


def test_tune_false_never_probes_a_kernel(monkeypatch) -> None:
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


# ---------------------------------------------------------------------- nothing timed by default
def _default_then_measured(call) -> list[int]:
    """Probes counted by each of: three default calls, one ``tune=True`` call, one default
    call after it (which reads the measured decision)."""
    counts = []
    for tune in ("auto", "auto", "auto", "measure", "auto"):
        before = _counts()[2]
        call(tune)
        counts.append(_counts()[2] - before)
    return counts


def test_no_entry_point_times_anything_unless_asked(monkeypatch) -> None:
    """``tune="auto"`` (the default) times nothing on any entry point, on the first call or
    any later one (no call is slower because it is the second); ``tune=True`` measures, and
    the decision it measured is what later default calls of the same shapes run."""
    from multiscale_jac import jacnorm

    fcn, fisher_net, norm_net = _Fcn().to(DTYPE), _net(), _net()
    ragged, data, x = _ragged(), _data(), _data(70)[0][0]
    jobs: list = []
    init = jacnorm._Job.__init__
    monkeypatch.setattr(
        jacnorm._Job, "__init__", lambda self, *a, **k: (init(self, *a, **k), jobs.append(self))[0]
    )
    runs = {
        "per_sample_jacobian": lambda t: mj.per_sample_jacobian(
            fcn, ragged, params="head.*", tune=t, entries="generic"
        ),
        "diag_fisher": lambda t: mj.diag_fisher(fisher_net, data, tune=t),
        "jacobian_sq_norm": lambda t: mj.jacobian_sq_norm(norm_net, x, tune=t),
    }
    for name, call in runs.items():
        counts = _default_then_measured(call)
        assert counts[:3] == [0, 0, 0] and counts[3] > 0 and counts[4] == 0, (name, counts)


def test_a_layers_kernels_are_timed_only_under_tune_true(monkeypatch) -> None:
    """A convolution's layer-wise kernels: columns under ``tune="auto"`` (nothing timed,
    nothing cached, however often the layer is met); timed under ``tune=True``, and that
    choice read by later default calls."""
    from multiscale_jac import layerwise

    monkeypatch.setattr(layerwise, "PROBE_MIN_FLOPS", 0.0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 16, 3))
    data = [(torch.randn(6, 8, 4, 4), torch.randint(3, (6,)))]
    probes = []
    for tune in ("auto", "auto", "measure", "auto"):
        before = _counts()[2]
        mj.diag_fisher(model, data, method="layerwise", tune=tune)
        probes.append(_counts()[2] - before)
    assert probes[:2] == [0, 0] and probes[2] > 0 and probes[3] == 0, probes
    assert len(_tuning.KERNEL_CACHE) > 0


@pytest.mark.parametrize(
    ("workset", "chosen"), [(100, 100), (400, 100), (401, 100), (50, 100), (100, 0)]
)
def test_growth_bounds_what_is_timed_by_the_estimates_working_set(
    workset: int, chosen: int
) -> None:
    """A candidate over GROWTH x the estimate's choice's working set is not timed (``0``:
    not planned, no rule)."""
    assert _tuning.GROWTH == 4
    assert _tuning.grows(workset, chosen) is (chosen > 0 and workset > 4 * chosen)


def test_a_route_over_growth_is_not_timed() -> None:
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


# ---------------------------------------------------------------------- the machine, calibrated
def test_work_counts_ops_by_kind_and_flops() -> None:
    """One linear layer on one sample: a matrix product of 2 x 4 x 3 flops (bias included in
    the product's op), counted as dense; a ReLU after it: another kind; 3 elements written
    by each."""
    from multiscale_jac import _calibration

    lin = nn.Linear(4, 3)
    x = torch.randn(1, 4)
    out, work = _calibration.count_work(lambda: torch.relu(lin(x)))
    kinds = dict(zip(_calibration.KINDS, work.ops))
    assert out.shape == (1, 3) and work.flops == 2 * 4 * 3
    assert kinds["dense"] == 1 and kinds["other"] >= 1 and kinds["norm"] == 0
    assert work.elems == 3 * (kinds["dense"] + kinds["other"])


def test_the_machine_is_calibrated_once_and_kept_in_a_file(tmp_path, monkeypatch) -> None:
    """Unfixed, the first price calibrates this machine (every cost positive and finite) and
    writes it under ``MULTISCALE_JAC_CACHE_DIR``, keyed with the library and torch versions;
    a later process (the in-process copy dropped) reads the file instead of measuring; a file
    it cannot read is measured over; ``off`` writes nothing."""
    from multiscale_jac import __version__, _calibration

    monkeypatch.setenv(_calibration.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(_calibration, "_MACHINES", {})
    before = _calibration.use_machine(None)
    try:
        first = _calibration.machine(torch.device("cpu"), torch.float32)
        values = [first.flop_s, first.elem_s, *first.call_s.values()]
        values += [v for p in _calibration.PASSES for v in first.op_s[p]]
        assert all(0 <= v < 1 and math.isfinite(v) for v in values)
        assert first.flop_s > 0 and first.elem_s > 0
        stored = json.loads((tmp_path / "machine.json").read_text())
        (key,) = stored
        assert __version__ in key and torch.__version__ in key
        monkeypatch.setattr(_calibration, "_MACHINES", {})
        monkeypatch.setattr(_calibration, "measure_machine", lambda *a: pytest.fail("measured"))
        assert _calibration.machine(torch.device("cpu"), torch.float32) == first
        (tmp_path / "machine.json").write_text("not json")
        monkeypatch.setattr(_calibration, "_MACHINES", {})
        monkeypatch.setattr(_calibration, "measure_machine", lambda *a: first)
        assert _calibration.machine(torch.device("cpu"), torch.float32) == first
        assert key in json.loads((tmp_path / "machine.json").read_text())
        off = tmp_path / "off"
        monkeypatch.setenv(_calibration.CACHE_ENV, "off")
        monkeypatch.setattr(_calibration, "_MACHINES", {})
        assert _calibration.cache_path() is None
        _calibration.machine(torch.device("cpu"), torch.float32)
        assert not off.exists()
    finally:
        _calibration.use_machine(before)


def test_a_multi_branch_backbone_prices_forward_mode_per_selected_tensor() -> None:
    """An HRNet-style backbone, a 10-output readout, 36 single entries spread over its
    tensors: forward mode runs one pass of the whole model per selected tensor, reverse mode
    one pass and 10 rows. Priced from the model's own ops and flops, ``auto`` runs ``rev``
    (a constant per pass, as before, chose ``fwd``: 4x slower measured), and the Jacobian is
    exact."""
    torch.manual_seed(0)
    model = mj.models.MultiBranchNet(ch=4, stages=2, blocks=1).to(DTYPE).eval()
    total = sum(p.numel() for p in model.parameters())
    idx = torch.randperm(total, generator=torch.Generator().manual_seed(0))[:36]
    subset = mj.ParamSubset.from_flat_indices(model, idx)
    x = torch.randn(4, 3, 16, 16, dtype=DTYPE)
    res = mj.per_sample_jacobian(model, x, params=subset, tune=False)
    (note,) = [n for n in res.notes if n.startswith("mode: estimated")]
    fwd, rev = (float(v) for v in re.findall(r"(?:fwd|rev) ([\d.]+) ms", note))
    assert res.mode == "rev" and fwd > 3 * rev, note
    ref = mj.reference.per_sample_jacobian_loop(model, x, params=subset)
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
