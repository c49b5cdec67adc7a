"""The benchmark report (``benchmarks/driver.py``): empty columns left out, re-run rows
labelled, plots readable at page width. Reads and writes JSON only; nothing is timed."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from multiscale_jac.cli import _load_driver

driver = _load_driver()

ENV = {"torch": "0", "python": "3", "platform": "p", "device": "cpu", "threads": 1, "date_utc": "d"}
SUITES = ["bench_fisher", "bench_laplace", "bench_jacnorm"]


def _record(seconds: float, ratio: float | None, mib: float | None, **extra: Any) -> dict:
    return {
        "seconds": seconds,
        "ratio_to_train_step": ratio,
        "peak_memory_bytes": None if mib is None else int(mib * 2**20),
        **extra,
    }


def _raw(tmp_path: Path) -> Path:
    """bench_fisher: a main file (two workloads, memory ratios) and a re-run file of one
    workload; bench_laplace: no memory ratio anywhere; bench_jacnorm: records without values."""
    raw = tmp_path / "raw"
    raw.mkdir()
    main = {
        "env": {"torch": "x"},
        "workloads": {
            "vgg-n8": {
                "methods": {
                    "train_step": _record(0.1, 1.0, 10, memory_ratio_to_train_step=1.0),
                    "library": _record(0.2, 2.0, 20, memory_ratio_to_train_step=2.0),
                }
            },
            "resnet-n8": {
                "methods": {"library": _record(0.4, 4.0, 40, memory_ratio_to_train_step=4.0)}
            },
        },
    }
    rerun = {"workloads": {"vgg-n8": {"methods": {"library": _record(0.3, 3.5, 30)}}}}
    (raw / "bench_fisher.json").write_text(json.dumps(main))
    (raw / "bench_fisher_library_rerun.json").write_text(json.dumps(rerun))
    (raw / "bench_laplace.json").write_text(
        json.dumps({"cells": [{"method": "library", "B": 8, "k": 10, **_record(0.5, 5.0, 50)}]})
    )
    (raw / "bench_jacnorm.json").write_text(
        json.dumps({"workloads": {"w": {"methods": {"m": _record(1.0, None, None)}}}})
    )
    return raw


def _report(tmp_path: Path) -> str:
    rows = driver.collect(_raw(tmp_path), SUITES)
    return driver.render_report({"environment": ENV, "quick": False, "runs": [], "rows": rows}, {})


def _section(report: str, suite: str) -> str:
    return report.split(f"## {suite}\n", 1)[1].split("\n## ", 1)[0]


def test_empty_columns_are_dropped_per_suite(tmp_path) -> None:
    report = _report(tmp_path)
    fisher, laplace, jacnorm = (_section(report, s) for s in SUITES)
    # bench_fisher has memory ratios (in its main file): the column stays
    header = "| workload | method | seconds | x train step | peak MiB | x train-step memory |"
    assert header in fisher
    assert "| vgg-n8 | library | 0.2 | 2 | 20 | 2 |" in fisher
    assert "left out" not in fisher
    # bench_laplace has none: the column and its cells are gone, and the line under it says so
    header = "| workload | method | seconds | x train step | peak MiB |\n|---|---|--:|--:|--:|\n"
    assert header in laplace
    assert "| B=8 k=10 | library | 0.5 | 5 | 50 |\n" in laplace
    assert "left out: x train-step memory." in laplace
    # bench_jacnorm has only seconds
    assert "| workload | method | seconds |\n|---|---|--:|\n| w | m | 1 |\n" in jacnorm
    assert "left out: x train step, peak MiB, x train-step memory." in jacnorm


def test_rerun_rows_are_labelled_and_grouped_with_their_workload(tmp_path) -> None:
    report = _report(tmp_path)
    fisher = _section(report, "bench_fisher")
    table = [line for line in fisher.splitlines() if line.startswith("| ") and "---" not in line]
    assert table[1:] == [
        "| vgg-n8 | train_step | 0.1 | 1 | 10 | 1 |",
        "| vgg-n8 | library | 0.2 | 2 | 20 | 2 |",
        # the re-run comes right after its workload's rows, not after every other workload
        "| vgg-n8 | library (re-run: bench_fisher_library_rerun.json) | 0.3 | 3.5 | 30 | - |",
        "| resnet-n8 | library | 0.4 | 4 | 40 | 4 |",
    ]
    note = (
        "Re-run rows, method marked '(re-run: bench_fisher_library_rerun.json)': 1 row "
        "(vgg-n8); every other row comes from bench_fisher.json."
    )
    assert note in fisher
    # a suite of one file has no re-run label or note
    assert "re-run" not in _section(report, "bench_laplace").lower()


def test_sources_name_the_main_file_and_tag_the_others() -> None:
    def rows(*files: str) -> list[dict[str, Any]]:
        return [{"file": f} for f in files]

    tags = driver._sources("bench_x", rows("bench_x_rerun.json", "bench_x.json"))
    assert tags == {"bench_x.json": None, "bench_x_rerun.json": "re-run"}
    # no main file and only re-runs: both are re-runs, told apart by number
    tags = driver._sources("bench_x", rows("bench_x_a_rerun.json", "bench_x_b_rerun.json"))
    assert tags == {"bench_x_a_rerun.json": "re-run 1", "bench_x_b_rerun.json": "re-run 2"}
    tags = driver._sources("bench_x", rows("bench_x.json", "bench_x_other.json"))
    assert tags == {"bench_x.json": None, "bench_x_other.json": "from"}
    label = driver._method_label({"method": "m", "file": "bench_x_other.json"}, tags, full=True)
    assert label == "m (from: bench_x_other.json)"


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plot_written_for_a_suite_with_data_only(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    rows = driver.collect(_raw(tmp_path), SUITES)
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench_jacnorm.png").write_bytes(b"stale")  # an earlier report's figure
    made = driver._plots(rows, out)
    assert made == {"bench_fisher": ["bench_fisher.png"], "bench_laplace": ["bench_laplace.png"]}
    assert not (out / "bench_jacnorm.png").exists()  # no data: no figure, the stale one gone
    width, height = _png_size(out / "bench_fisher.png")
    assert 850 <= width <= 1000  # page width: 8.5 in at 110 dpi
    assert height < width  # four rows: not a tall figure
    # the report links each figure
    results = {"environment": ENV, "quick": False, "runs": [], "rows": rows}
    report = driver.render_report(results, made)
    assert "![bench_fisher](bench_fisher.png)" in report
    assert "![bench_jacnorm]" not in report


def test_plot_panels_rows_and_split(tmp_path) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    rows = driver.collect(_raw(tmp_path), SUITES)
    fisher = driver._by_workload([r for r in rows if r["suite"] == "bench_fisher"])
    tags = driver._sources("bench_fisher", fisher)
    colors = {m: "C0" for m in ("train_step", "library")}
    fig = driver._figure(plt, "bench_fisher", fisher, tags, colors, 1, 1)
    try:
        assert len(fig.axes) == 2  # time and memory share the rows
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert labels == [
            "vgg-n8 · train_step",
            "vgg-n8 · library",
            "vgg-n8 · library (re-run)",
            "resnet-n8 · library",
        ]
        assert fig.axes[0].get_xscale() == "log"
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "re-run: bench_fisher_library_rerun.json" in legend
        assert all(t.get_fontsize() >= 8 for t in fig.axes[0].get_yticklabels())
    finally:
        plt.close(fig)
    # no memory numbers: the memory panel is dropped
    no_mem = [{**r, "peak_memory_bytes": None} for r in fisher]
    fig = driver._figure(plt, "bench_fisher", no_mem, tags, colors, 1, 1)
    try:
        assert len(fig.axes) == 1 and "time" in fig.axes[0].get_title()
    finally:
        plt.close(fig)
    # many rows: one figure per group of whole workloads, none above the cap
    many = [{**fisher[0], "workload": f"w{k // 3}", "method": f"m{k % 3}"} for k in range(21)]
    parts = driver._plot_parts(many, 9)
    assert [len(p) for p in parts] == [9, 9, 3]
    workloads = [{r["workload"] for r in p} for p in parts]
    assert sum(len(w) for w in workloads) == len(set().union(*workloads)) == 7
    out = tmp_path / "split"
    out.mkdir()
    (out / "bench_fisher.png").write_bytes(b"stale")
    made = driver._plots(many, out, max_rows=9)
    assert made == {"bench_fisher": [f"bench_fisher_part{k}.png" for k in (1, 2, 3)]}
    assert sorted(p.name for p in out.iterdir()) == made["bench_fisher"]


def test_write_report_links_existing_plots(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    driver.write_report(_raw(tmp_path), out, SUITES, quick=False, device="cpu")
    report = (out / "report.md").read_text()
    linked = [line.split("(", 1)[1].rstrip(")") for line in report.splitlines() if "![" in line]
    assert linked == ["bench_fisher.png", "bench_laplace.png"]
    assert all((out / name).is_file() for name in linked)
    assert "library (re-run: bench_fisher_library_rerun.json)" in report
