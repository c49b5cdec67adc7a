"""Measuring in one place (``multiscale_jac._tuning``): the one path's rules (warm-up,
retime, tie, growth), the choices kept and their file form (``multiscale_jac.tuning.save`` /
``load``), nothing timed unless ``tune=True``; the machine's calibration."""

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
from multiscale_jac._tuning import Route

DTYPE = torch.float64
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_clock(monkeypatch):
    """The tuner's clock reads the seconds the run callback leaves in ``clock[0]``."""
    clock = [0.0]

    @contextlib.contextmanager
    def stopwatch(devices=()):
        elapsed: list[float] = []
        yield elapsed
        elapsed.append(clock[0])

    monkeypatch.setattr(_tuning, "stopwatch", stopwatch)
    return clock


def _routes(seconds: dict, calls: list, clock: list, **fields) -> list[Route]:
    """Routes whose every run (warm-ups included) takes the next of their ``seconds``
    (``None``: fails), one sample each."""

    def run(name: str) -> float | None:
        calls.append(name)
        t = seconds[name].pop(0)
        if t is None:
            return None
        clock[0] = t
        return 1.0

    return [Route(k, lambda k=k: run(k), **fields.get(k, {})) for k in seconds]


def test_every_route_warms_up_then_those_within_retime_run_again(fake_clock) -> None:
    """Warm-up, one timed run each, then a second round for those within RETIME of the
    fastest (the faster time counting); a failed route is no candidate; the choice is kept."""
    seconds = {"a": [9.0, 1.0, 0.8], "b": [9.0, 2.5, 3.0], "c": [9.0, 4.0], "d": [None]}
    calls: list[str] = []
    notes: list[str] = []
    probes = _tuning.COUNTS["probe"]
    chosen = _tuning.tune("f", ("k",), _routes(seconds, calls, fake_clock), devices=[], notes=notes)
    assert calls == ["a", "a", "b", "b", "c", "c", "d", "a", "b"]
    assert chosen.name == "a" and _tuning.decided("f", ("k",)) == ("a", None)
    assert _tuning.COUNTS["probe"] == probes + 5  # timed runs only, not warm-ups
    assert "a 800 ms" in notes[0] and "b 2.5e+03 ms" in notes[0] and " d " not in notes[0]
    assert _tuning.decided("f", ("other",)) is None and _tuning.decided("g", ("k",)) is None


@pytest.mark.parametrize(
    ("times", "chosen"),
    [((1.04, 1.0), "first"), ((1.06, 1.0), "second"), ((1.0, 1.04), "first")],
    ids=["tie-goes-to-the-earlier", "no-tie", "fastest-first"],
)
def test_ties_go_to_the_earlier_route(fake_clock, times, chosen) -> None:
    seconds = {"first": [0.0, times[0], times[0]], "second": [0.0, times[1], times[1]]}
    assert (
        _tuning.tune("f", None, _routes(seconds, [], fake_clock), devices=[], notes=[]).name
        == chosen
    )
    assert _tuning.decided("f", None) is None  # a None key keeps nothing


def test_chunked_routes_are_priced_in_whole_chunks(fake_clock) -> None:
    """With ``samples``, a chunked route costs seconds per sample times the samples its whole
    chunks run: 0.9 per sample in chunks of 64 (128 of 100 samples) loses to 1.0 in chunks
    of 100."""
    seconds = {"big": [0.0, 1.0, 1.0], "small": [0.0, 0.9, 0.9]}
    fields = {"big": {"chunk": 100}, "small": {"chunk": 64}}
    routes = _routes(seconds, [], fake_clock, **fields)
    assert _tuning.tune("f", None, routes, [], [], samples=100).name == "big"


def test_a_route_over_growth_or_already_warm_is_not_run_untimed(fake_clock) -> None:
    """GROWTH x the first route's working set bounds what is timed (noted); a route whose
    warm-up does nothing is timed at once."""
    seconds = {"a": [1.0, 1.0], "b": [0.5, 0.5, 0.5], "c": [0.1]}
    calls: list[str] = []
    fields = {
        "a": {"workset": 100, "warm_up": lambda: 1},
        "b": {"workset": 400},
        "c": {"workset": 401},
    }
    notes: list[str] = []
    chosen = _tuning.tune(
        "f", None, _routes(seconds, calls, fake_clock, **fields), devices=[], notes=notes
    )
    assert chosen.name == "b" and calls == ["a", "b", "b", "a", "b"]
    assert notes[0].startswith("tune: not timed") and "'c'" in notes[0]


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
    into an emptied cache: new models of the same structure run the saved choices (nothing
    timed) to the same numbers."""
    first = _work()
    assert _counts()[2] > 0  # it measured
    path = tmp_path / "decisions.json"
    written = mj.tuning.save(path)
    assert written >= 3
    mj.clear_plan_cache()
    assert mj.tuning.load(path) == written
    again = _work()
    assert _counts()[2] == 0  # nothing timed: the saved choices ran
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)  # (chunks summed in another order)


def test_a_decision_from_another_machine_setting_is_not_used(tmp_path) -> None:
    """The key holds the environment (here: the CPU threads): a decision measured with other
    settings is ignored and the call measures again."""
    mj.diag_fisher(_net(), _data(), tune="measure")
    path = tmp_path / "decisions.json"
    mj.tuning.save(path)
    mj.clear_plan_cache()
    mj.tuning.load(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        res = mj.diag_fisher(_net(), _data(), tune="measure")
    finally:
        torch.set_num_threads(threads)
    assert _counts()[2] > 0 and not any("by tune=True before" in n for n in res.notes), res.notes


def test_a_foreign_file_is_refused(tmp_path) -> None:
    """Not a decision file (a weights file, JSON of another format, an entry that is not a
    route name and chunk): a ValueError naming the file, nothing read."""
    plain = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, plain)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "x", "decisions": {}}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": _tuning._FORMAT, "decisions": {"k": ["a", "b"]}}))
    for path in (plain, other, bad):
        with pytest.raises(ValueError, match=re.escape(str(path))):
            mj.tuning.load(path)
    assert len(_tuning._DECISIONS) == 0


def test_a_key_means_the_same_in_another_process() -> None:
    """A key is text without object addresses: types and functions by name, weak references
    by their target; the same key made in another process digests the same."""
    script = textwrap.dedent(
        """
        import weakref, torch
        from multiscale_jac import _tuning

        def head(out):
            return out[:, :2]

        key = (torch.nn.Conv2d, head, weakref.ref(head), torch.Size([2, 3]), torch.float64,
               torch.Generator(), ("x", 3))
        print(_tuning._digest("f", key))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    digests = [
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout.split()[-1]
        for _ in range(2)
    ]
    assert digests[0] == digests[1]
    assert _tuning._digest("f", (nn.Conv2d,)) != _tuning._digest("f", (nn.Linear,))


def test_tune_false_never_probes_a_kernel(monkeypatch) -> None:
    """The layer-wise convolution kernels are timed under ``auto`` / ``measure`` only: with
    ``tune=False`` the columns run and nothing is timed or cached."""
    from multiscale_jac import layerwise

    monkeypatch.setattr(layerwise, "PROBE_MIN_FLOPS", 0.0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 16, 3))
    data = [(torch.randn(6, 8, 4, 4), torch.randint(3, (6,)))]
    mj.diag_fisher(model, data, method="layerwise", tune=False)
    assert _counts()[2] == 0 and len(_tuning._DECISIONS) == 0
    mj.diag_fisher(model, data, method="layerwise", tune=True)
    assert _counts()[2] > 0 and len(_tuning._DECISIONS) > 0


def test_the_clock_is_read_in_tuning_alone() -> None:
    """One place measures: no other module of the package reads a clock (they time through
    ``_tuning.stopwatch``)."""
    package = ROOT / "multiscale_jac"
    readers = [
        str(p.relative_to(package))
        for p in sorted(package.rglob("*.py"))
        if p.name != "_tuning.py"
        and any(
            w in p.read_text() for w in ("perf_counter", "monotonic(", "time.time(", "process_time")
        )
    ]
    assert readers == []


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
    assert len(_tuning._DECISIONS) > 0


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
    assert "vmap/fwd/generic" in note, note
    timed = [n for n in res.notes if n.startswith("tune: timed")]
    assert all("generic" not in n for n in timed), timed


# ---------------------------------------------------------------------- the machine, calibrated
def test_work_counts_ops_by_kind_and_flops() -> None:
    """One linear layer on one sample: a matrix product of 2 x 4 x 3 flops (bias included in
    the product's op), counted as dense; a ReLU after it: another kind; 3 elements written
    by each."""
    from multiscale_jac import _work

    lin = nn.Linear(4, 3)
    x = torch.randn(1, 4)
    out, work = _work.count_work(lambda: torch.relu(lin(x)))
    kinds = dict(zip(_work.KINDS, work.ops))
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
