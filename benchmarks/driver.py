"""The driver of ``multiscale-jac bench``: run the benchmark grid and write its report.

``multiscale-jac bench`` loads this file from the source tree's ``benchmarks/`` folder (or from
``$MULTISCALE_JAC_BENCHMARKS``); it is not part of the installed package and imports only the
standard library (the command line reads :data:`SUITES` for ``--help`` cheaply). The named
grids run in ``bench_peers.py`` (a fresh worker per cell) into ``DIR/raw/grid[_quick].json``;
``render.py`` writes ``DIR/report.md``, ``DIR/results.json`` (the same records) and the plots
(with matplotlib, the ``plot`` extra). ``--from DIR`` renders ``DIR/grid.json`` without running.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

#: the named grids of ``bench_peers.py`` (its ``FAMILIES``; a test keeps the two in step)
SUITES = ("main", "choice", "batch", "entries", "dense", "laplace_torch", "first_call")

#: what ``multiscale-jac bench --quick`` runs without ``--suites``: one main cell against the
#: code a user would write, a few minutes on 2 cores (``--suites ...`` runs those named grids'
#: quick cells; ``bench_peers.py --grid all --quick``: every one)
QUICK_SUITES: tuple[str, ...] = ("main",)
QUICK_ARGS: list[str] = ["--cells", "jacnorm/gelu_cnn", "--memory", "main"]


def benchmarks_dir() -> Path:
    """The folder of the grid: the one holding this file."""
    return Path(__file__).resolve().parent


def results_file(folder: Path, *, quick: bool) -> Path:
    return folder / ("grid_quick.json" if quick else "grid.json")


def run_bench(
    *,
    quick: bool,
    device: str,
    out: Path,
    suites: Sequence[str],
    progress: bool = True,
    timeout: float | None = None,
) -> int:
    """Run the named grids ``suites`` and write the report into ``out``; returns 0, or 1 if
    the grid failed (a cell that fails is recorded in the results and does not fail it)."""
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(benchmarks_dir() / "bench_peers.py"), "--grid", *suites]
    cmd += ["--out", str(raw), "--device", device]
    if quick:
        cmd += ["--quick", *(QUICK_ARGS if tuple(suites) == QUICK_SUITES else [])]
    print(f"== {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    try:
        code = subprocess.run(cmd, cwd=benchmarks_dir().parent, timeout=timeout, check=False)
        status = code.returncode
    except subprocess.TimeoutExpired:
        print(f"the grid ran past --timeout {timeout} s", flush=True)
        status = 1
    print(f"== the grid took {time.time() - t0:.0f} s", flush=True)
    if results_file(raw, quick=quick).exists():
        write_report(raw, out, suites, quick=quick, device=device)
    return 0 if status == 0 else 1


def write_report(
    raw: Path, out: Path, suites: Sequence[str], *, quick: bool, device: str = "cpu"
) -> None:
    """``report.md``, ``results.json`` and the plots in ``out`` from the results file in
    ``raw`` (its cells of the named grids ``suites``)."""
    sys.path.insert(0, str(benchmarks_dir()))
    import render

    path = results_file(raw, quick=quick)
    results = json.loads(path.read_text())
    results["cells"] = [c for c in results["cells"] if c.get("family") in suites]
    results["report"] = {"from": path.name, "suites": list(suites), "device": device}
    render.write_report(results, out)
