"""The benchmark grid's report (``benchmarks/render.py`` through ``benchmarks/driver.py``): one
results file, a table per named grid, runs labelled, plots written. Reads and writes JSON only;
nothing is timed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from multiscale_jac.cli import _load_driver

driver = _load_driver()
ENV = {"torch": "0", "device": "cpu", "threads": 2, "date_utc": "2026-01-01T00:00:00"}


def _method(kind: str, seconds: float | None, ratio: float | None, mib: float | None) -> dict:
    rec: dict = {"kind": kind, "valid": True}
    if seconds is not None:
        rec.update(seconds=seconds, ratio_to_train_step=ratio)
    if mib is not None:
        rec["peak_memory_bytes"] = int(mib * 2**20)
    return rec


def _results() -> dict:
    step = _method("train", 0.1, 1.0, 10)
    main = {
        "family": "main",
        "run": 1,
        "name": "fisher/m",
        "workload": "fisher",
        "methods": {
            "train_step": step,
            "vmap_chunks": _method("peer", 0.3, 3.0, 30),
            "library_auto": _method("library", 0.2, 2.0, 20),
            "library_layerwise": _method("route", 0.19, 1.9, 20),
        },
        "best_other": "vmap_chunks",
        "best_route": "library_layerwise",
        "best_route_seconds": 0.19,
        "library_over_best_other": 2 / 3,
        "auto_over_best_route": 0.2 / 0.19,
    }
    batch = [
        {
            "family": "batch",
            "run": 2,
            "name": f"fisher/m@n={n}",
            "workload": "fisher",
            "N": n,
            "methods": {
                "train_step": step,
                "library_auto": {
                    **_method("library", 0.1 * n, n, 2 * n),
                    "memory_ratio_to_train_step": 1.5,
                },
                "autograd_jacobian": {
                    "kind": "peer",
                    "skipped": "not run: estimated 20 GiB",
                    "estimated_bytes": 20 * 2**30,
                },
            },
        }
        for n in (8, 16)
    ]
    laplace = {
        "family": "laplace_torch",
        "run": 2,
        "name": "laplace/c@n=32,k=100",
        "model": "c",
        "N": 32,
        "P": 100,
        "methods": {
            "library_auto": _method("library", 0.5, 5.0, 138),
            "laplace_torch": {**_method("peer", None, None, 6820), "run": 1},
        },
    }
    runs = [
        {"id": 1, "env": {**ENV, "git_commit": "abc1234567"}, "config": {}, "source": "converted"},
        {"id": 2, "env": {**ENV, "git_commit": "def7654321"}, "config": {"quick": True}},
    ]
    return {"runs": runs, "cells": [main, *batch, laplace]}


def test_tables_state_units_and_runs() -> None:
    import sys

    sys.path.insert(0, str(driver.benchmarks_dir()))
    import render

    r = _results()
    assert (
        "| fisher/m | 2.00 | vmap_chunks | 3.00 | 0.67 | layerwise | 1.05 |" in render.main_table(r)
    )
    batch = render.methods_table(r, "batch", "n")
    assert "| fisher/m | 8 | library_auto | 0.80 | 8.00 | 16.0 | 1.50 |" in batch
    assert "| fisher/m | 16 | autograd_jacobian | est. 20.0 GiB, not run |" in batch
    lt = render.laplace_torch_table(r)
    assert "| laplace/c@n=32,k=100 | laplace_torch | - | 6.66 GiB | 1 |" in lt  # MiB -> GiB
    assert "| laplace/c@n=32,k=100 | library_auto | 0.50 | 138 MiB | 2 |" in lt
    runs = render.runs_page(r)
    assert "| 1 | 2026-01-01 | abc1234 |" in runs and "converted" in runs and "| quick |" in runs


def test_report_from_the_results_file(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "grid.json").write_text(json.dumps(_results()))
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.png").write_bytes(b"old")  # an earlier report's figure
    driver.write_report(raw, out, ["main", "batch"], quick=False)
    report = (out / "report.md").read_text()
    assert "## main" in report and "## batch" in report and "## laplace_torch" not in report
    assert "<summary>main: 1 cell</summary>" in report and "**fisher/m** (N=None" in report
    assert not (out / "stale.png").exists()
    results = json.loads((out / "results.json").read_text())
    assert {c["family"] for c in results["cells"]} == {"main", "batch"}
    pytest.importorskip("matplotlib")
    for name in ("grid_main.png", "grid_batch.png"):
        assert f"({name})" in report
        width, height = struct.unpack(">II", (out / name).read_bytes()[16:24])
        assert width >= 800 and height >= 400


def test_published_blocks_are_rewritten_and_checked(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(driver.benchmarks_dir()))
    import render

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "results" / "grid.json").write_text(json.dumps(_results()))
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# P\n\n<!-- figures: main from benchmarks/results/grid.json -->\nold\n<!-- /figures -->\n"
    )
    assert render.stale_blocks(tmp_path) == ["docs/page.md: main from benchmarks/results/grid.json"]
    assert render.update_pages(tmp_path) == [page]
    assert "| fisher/m | 2.00 |" in page.read_text() and render.stale_blocks(tmp_path) == []
    page.write_text(page.read_text().replace("figures: main", "figures: nope"))
    assert render.stale_blocks(tmp_path) == [
        "docs/page.md: nope from benchmarks/results/grid.json (no such figure or results file)"
    ]
