"""The command line: demo, help, bad options."""

from __future__ import annotations

import subprocess
import sys

import pytest

from multiscale_jac.cli import main


@pytest.mark.slow
def test_demo_prints_table_and_passes(capsys) -> None:
    assert main(["demo", "--samples", "2", "--entries", "20", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "strategy" in out and "max |diff|" in out
    assert "head.*" in out and "20 entries" in out
    assert "bucketed" in out  # mixed sizes -> buckets
    for words in ("first s", "warm s", "loop warm s", "warm calls after the first"):
        assert words in out
    assert "speed-up = loop warm s / warm s" in out
    assert "OK: every Jacobian equals the loop reference" in out


def _fake_row(subset: str, diff: float = 0.0):
    from multiscale_jac._demo import DemoRow

    return DemoRow(subset, 7, "bucketed", "fwd", (2, 5, 7), 9.0, 0.5, 2.0, diff, 3, 2)


def test_demo_streams_rows_and_reports_warm_times(monkeypatch, capsys) -> None:
    """Each row is printed (flushed) as soon as it is computed, and the speed-up is warm loop
    over warm engine, never the first call (no real computation: the rows are made up)."""
    import multiscale_jac._demo as demo

    seen_before_second: list = []

    def fake_iter_demo(**kwargs):
        assert kwargs["repeats"] == 3 and kwargs["samples"] == 2
        kwargs["progress"]("head.*: engine, first call (planning included)")
        yield _fake_row("head.*")
        seen_before_second.append(capsys.readouterr())
        yield _fake_row("7 entries")

    monkeypatch.setattr(demo, "iter_demo", fake_iter_demo)
    assert main(["demo", "--samples", "2", "--entries", "7"]) == 0
    first_part, progress = seen_before_second[0]
    assert "warm times are medians of up to 3 calls after the first" in first_part
    assert "first s" in first_part and "loop warm s" in first_part
    assert "head.*" in first_part and "7 entries" not in first_part  # streamed, not batched
    captured = capsys.readouterr()
    out = first_part + captured.out
    row = next(line for line in out.splitlines() if line.startswith("7 entries"))
    assert "9.000" in row and "0.500" in row and "2.000" in row
    assert "4.0x" in row  # 2.0 / 0.5: warm over warm
    assert "0.2x" not in row  # not 2.0 / 9.0 (first call)
    assert "speed-up = loop warm s / warm s (warm calls vs warm calls)" in out
    assert "head.*: engine 3, loop 2" in out
    assert "OK: every Jacobian equals the loop reference" in out
    assert "engine, first call (planning included)" in progress  # the progress line (stderr)


def test_demo_fails_on_a_difference(monkeypatch, capsys) -> None:
    import multiscale_jac._demo as demo

    monkeypatch.setattr(demo, "iter_demo", lambda **_: iter([_fake_row("head.*", diff=1.0)]))
    assert main(["demo", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "FAIL: head.* differ" in captured.out and captured.err == ""


def test_demo_speed_up_is_warm_over_warm() -> None:
    row = _fake_row("x")
    assert row.speed_up == row.loop_s / row.engine_s == 4.0


def test_version_prints_the_package_version(capsys) -> None:
    import importlib.metadata

    import multiscale_jac

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"multiscale-jac {multiscale_jac.__version__} (torch ")
    assert importlib.metadata.version("multiscale_jac") == multiscale_jac.__version__
    assert "CPU-only build" in out or "CUDA" in out


def test_help_lists_commands(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--samples" in out and "--device" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--samples", "0"], "expected a positive integer, got '0'"),
        (["demo", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["bench", "--suites", "bench_nope"], "invalid choice: 'bench_nope'"),
        (["bench", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["bench", "--timeout", "-3"], "expected a positive integer, got '-3'"),
        (["bench", "--out", __file__], "exists and is not a folder"),
    ],
)
def test_bad_options_exit_nonzero(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_no_command_prints_help(capsys) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


@pytest.mark.slow
def test_module_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "multiscale_jac", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "demo" in out.stdout and "--version" in out.stdout
    import multiscale_jac

    out = subprocess.run(
        [sys.executable, "-m", "multiscale_jac", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith(f"multiscale-jac {multiscale_jac.__version__} ")


def test_bench_help_and_suites(capsys) -> None:
    from multiscale_jac import cli

    suites = list(cli._load_driver().SUITES)  # the named grids: benchmarks/driver.py
    grid = (cli._benchmarks_dir() / "bench_peers.py").read_text()
    assert suites and all(f'\n    "{s}": (' in grid for s in suites)  # bench_peers.FAMILIES
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for word in ("--quick", "--device", "--out", "--suites", "report.md", "results.json"):
        assert word in out
    assert all(s in out for s in suites)


def test_bench_driver_imports_no_torch() -> None:
    """The driver is loaded for ``bench --help``; it imports torch only when it measures."""
    from multiscale_jac import cli

    path = str(cli._load_driver().__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('driver', {path!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_bench_without_scripts_says_where(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("MULTISCALE_JAC_BENCHMARKS", str(tmp_path))
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])  # the help needs no benchmarks folder
    assert info.value.code == 0
    assert "--suites" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["bench", "--quick", "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "no benchmark scripts" in err and str(tmp_path) in err
    assert "source checkout" in err and "MULTISCALE_JAC_BENCHMARKS" in err
    assert not (tmp_path / "out").exists()


def test_bench_checks_suites_when_help_had_no_driver(monkeypatch, capsys) -> None:
    """A parser built without the driver (no choices) still rejects an unknown suite."""
    from multiscale_jac import cli

    monkeypatch.setattr(cli, "_driver_suites", lambda: None)
    with pytest.raises(SystemExit) as info:
        main(["bench", "--suites", "bench_nope"])
    assert info.value.code == 2
    assert "invalid choice: 'bench_nope'" in capsys.readouterr().err


def _grid_results() -> dict:
    """A results file of two named grids (one run), as bench_peers.py writes it."""
    env = {"torch": "0", "device": "cpu", "threads": 2, "date_utc": "2026-01-01T00:00:00"}
    step = {"kind": "train", "seconds": 0.5, "ratio_to_train_step": 1.0, "peak_memory_bytes": 2**20}
    auto = {"kind": "library", "seconds": 1.0, "ratio_to_train_step": 2.0, "valid": True}
    cell = {"run": 1, "workload": "fisher", "model": "m", "N": 8, "P": 10, "O": 3}
    return {
        "runs": [{"id": 1, "env": env, "config": {"quick": False}}],
        "cells": [
            {
                **cell,
                "family": "main",
                "name": "fisher/m",
                "methods": {"train_step": step, "library_auto": auto},
            },
            {**cell, "family": "batch", "name": "fisher/m@n=8", "methods": {"library_auto": auto}},
        ],
    }


def test_bench_report_from_the_results_file(tmp_path) -> None:
    """The report renders the named grids asked for from the one results file."""
    import json

    from multiscale_jac.cli import _load_driver

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "grid.json").write_text(json.dumps(_grid_results()))
    _load_driver().write_report(raw, tmp_path / "out", ["main"], quick=False)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## main" in report and "| fisher/m | 2.00 |" in report and "## batch" not in report
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [c["name"] for c in results["cells"]] == ["fisher/m"]


@pytest.mark.slow
def test_bench_from_existing_results(tmp_path) -> None:
    import json

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "grid.json").write_text(json.dumps(_grid_results()))
    (raw / "grid_quick.json").write_text(json.dumps({"runs": [], "cells": []}))
    out = tmp_path / "report"
    assert main(["bench", "--from", str(raw), "--out", str(out), "--suites", "batch"]) == 0
    report = (out / "report.md").read_text()
    assert "## batch" in report and "| fisher/m | 8 | library_auto | 1.00 | 2.00 |" in report
    results = json.loads((out / "results.json").read_text())
    assert results["runs"][0]["env"]["torch"] == "0" and len(results["cells"]) == 1
