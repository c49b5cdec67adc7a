"""The command line: demo, help, bad options."""

from __future__ import annotations

import subprocess
import sys

import pytest

from multiscale_jac.cli import main


@pytest.mark.slow
def test_demo_prints_table_and_passes(capsys) -> None:
    assert main(["demo", "--samples", "3", "--entries", "40"]) == 0
    out = capsys.readouterr().out
    assert "strategy" in out and "max |diff|" in out
    assert "head.*" in out and "40 entries" in out
    assert "bucketed" in out  # mixed sizes -> buckets
    assert "OK: every Jacobian equals the loop reference" in out


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
    assert "demo" in out.stdout


def test_bench_help_and_suites(capsys) -> None:
    from multiscale_jac import cli

    suites = list(cli._load_driver().SUITES)  # the one list of suites: benchmarks/driver.py
    assert suites and all((cli._benchmarks_dir() / f"{s}.py").is_file() for s in suites)
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


def test_bench_report_from_suite_json(tmp_path) -> None:
    """The report reads every method record, whatever the nesting of a suite's JSON."""
    import json

    from multiscale_jac.cli import _load_driver

    driver = _load_driver()
    raw = tmp_path / "raw"
    raw.mkdir()
    record = {"seconds": 0.5, "ratio_to_train_step": 2.0, "peak_memory_bytes": 3 * 2**20}
    (raw / "bench_fisher.json").write_text(
        json.dumps({"env": {}, "workloads": {"vgg-n8": {"methods": {"library": record}}}})
    )
    (raw / "bench_laplace.json").write_text(
        json.dumps({"cells": [{"method": "library", "B": 32, "k": 100, **record}]})
    )
    rows = driver.collect(raw, ["bench_fisher", "bench_laplace"])
    assert [(r["suite"], r["workload"], r["method"]) for r in rows] == [
        ("bench_fisher", "vgg-n8", "library"),
        ("bench_laplace", "B=32 k=100", "library"),
    ]
    results = {"environment": driver.environment("cpu"), "quick": True, "runs": [], "rows": rows}
    report = driver.render_report(results, {})
    assert "## bench_laplace" in report and "| B=32 k=100 | library | 0.5 | 2 | 3 |" in report


@pytest.mark.slow
def test_bench_from_existing_results(tmp_path) -> None:
    import json

    raw = tmp_path / "raw"
    raw.mkdir()
    record = {"seconds": 1.0, "ratio_to_train_step": 3.0, "peak_memory_bytes": 2**20}
    (raw / "bench_jacnorm.json").write_text(
        json.dumps({"workloads": {"w": {"methods": {"m": record}}}})
    )
    (raw / "bench_jacnorm_quick.json").write_text(
        json.dumps({"cells": [{"method": "q", **record}]})
    )
    out = tmp_path / "report"
    assert main(["bench", "--from", str(raw), "--out", str(out), "--suites", "bench_jacnorm"]) == 0
    report = (out / "report.md").read_text()
    assert "| w | m | 1 | 3 | 1 |" in report and "| q |" not in report  # full runs only
    results = json.loads((out / "results.json").read_text())
    assert results["environment"]["torch"] and len(results["rows"]) == 1
