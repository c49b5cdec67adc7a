"""The driver of ``multiscale-jac bench``: run the benchmark suites and write one report.

``multiscale-jac bench`` loads this file from the source tree's ``benchmarks/`` folder (or from
``$MULTISCALE_JAC_BENCHMARKS``); it is not part of the installed package. It imports nothing
but the standard library at module level (torch only inside :func:`environment`, matplotlib
inside the plotting), so that the command line can read :data:`SUITES` for ``--help`` cheaply.

The suites are the ``bench_*.py`` scripts next to this file. Each runs in its own process and
writes its JSON; this module then reads every method record (any JSON object with ``seconds``
and ``ratio_to_train_step`` or ``peak_memory_bytes``) into one table:

* ``DIR/raw/<suite>*.json``: what each suite wrote;
* ``DIR/results.json``: the environment and every record (suite, workload, method, seconds,
  ratio to a training step, peak memory, memory ratio);
* ``DIR/report.md``: one markdown table per suite;
* ``DIR/<suite>.png``: time ratio and peak memory per method, log scale (needs matplotlib, the
  ``plot`` extra; skipped with a note otherwise).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "QUICK_ARGS",
    "SUITES",
    "benchmarks_dir",
    "collect",
    "environment",
    "render_report",
    "run_bench",
    "write_report",
]

#: suite -> whether the script takes ``--device`` (the one list of suites: the command line
#: reads it for ``--suites``)
SUITES: dict[str, bool] = {
    "bench_jacobian": True,
    "bench_multires": True,
    "bench_subset": False,
    "bench_fisher": False,
    "bench_jacnorm": False,
    "bench_laplace": False,
    "bench_peers": True,
}


#: extra arguments of ``--quick`` runs, keeping the whole run within a few minutes on 2 cores
#: (the heaviest cells of the suites' own quick modes are their loop references)
QUICK_ARGS: dict[str, list[str]] = {
    "bench_jacobian": ["--workloads", "fpn", "--repeats", "1"],
    "bench_multires": ["--repeats", "1"],
    "bench_subset": ["--workloads", "a", "b-k100-o10"],
    "bench_fisher": [
        *("--repeats", "1", "--methods", "train_step", "loop", "jacobian_vectorize"),
        *("vmap_grad", "backpack", "library"),
    ],
    "bench_jacnorm": ["--repeats", "1", "--models", "cnn3"],
    "bench_laplace": ["--repeats", "1"],
    # one cell against the code a user would write (the suite's own --quick grid is larger)
    "bench_peers": [
        *("--workloads", "jacnorm", "--models", "gelu_cnn", "--memory", "main"),
        *("--min-run-time", "0.1", "--method-limit", "10"),
    ],
}


def benchmarks_dir() -> Path:
    """The folder of the suites: the one holding this file."""
    return Path(__file__).resolve().parent


def run_bench(
    *,
    quick: bool,
    device: str,
    out: Path,
    suites: Sequence[str],
    progress: bool = True,
    timeout: float | None = None,
) -> int:
    """Run ``suites`` and write the report into ``out``; returns 0, or 1 if a suite failed."""
    scripts = benchmarks_dir()
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    bar = _bar(suites, progress)
    for suite in bar:
        if hasattr(bar, "set_description"):
            bar.set_description(suite)
        if device != "cpu" and not SUITES[suite]:
            runs.append({"suite": suite, "status": "skipped", "reason": f"no --device {device}"})
            continue
        cmd = [sys.executable, str(scripts / f"{suite}.py"), "--out", str(raw)]
        if quick:
            cmd += ["--quick", *QUICK_ARGS.get(suite, [])]
        if SUITES[suite]:
            cmd += ["--device", device]
        t0 = time.perf_counter()
        print(f"== {suite}: {' '.join(cmd[1:])}", flush=True)
        try:
            proc = subprocess.run(cmd, cwd=scripts.parent, timeout=timeout, check=False)
            status = "ok" if proc.returncode == 0 else f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout} s"
        runs.append(
            {"suite": suite, "status": status, "seconds": round(time.perf_counter() - t0, 1)}
        )
    write_report(raw, out, suites, quick=quick, device=device, runs=runs)
    return 0 if all(r["status"] in ("ok", "skipped") for r in runs) else 1


def write_report(
    raw: Path,
    out: Path,
    suites: Sequence[str],
    *,
    quick: bool,
    device: str,
    runs: list[dict[str, Any]] | None = None,
) -> None:
    """``report.md``, ``results.json`` and plots in ``out`` from the suite JSON in ``raw``
    (``runs=None``: a report of earlier runs, ``multiscale-jac bench --from``)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = collect(raw, suites, quick=quick)
    runs = runs if runs is not None else _earlier_runs(rows, suites)
    results = {"environment": environment(device), "quick": quick, "runs": runs, "rows": rows}
    results["summaries"] = _summaries(raw, suites, out, quick=quick)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    plots = _plots(rows, out)
    (out / "report.md").write_text(render_report(results, plots))
    print(f"wrote {out / 'report.md'} and {out / 'results.json'}")


def _summaries(raw: Path, suites: Sequence[str], out: Path, *, quick: bool) -> dict[str, str]:
    """A suite's own summary: the ``report_markdown`` of its JSON, and its ``<file>.png`` (copied
    into ``out``) where it wrote one (bench_peers: auto / best other method per cell)."""
    found: dict[str, str] = {}
    for suite in suites:
        for path in sorted(raw.glob(f"{suite}*.json")):
            if ("_quick" in path.stem) != quick:
                continue
            try:
                text = json.loads(path.read_text()).get("report_markdown")
            except (OSError, json.JSONDecodeError, AttributeError):
                continue
            if text:
                png = path.with_suffix(".png")
                if png.is_file():
                    shutil.copyfile(png, out / f"{path.stem}_summary.png")
                    text = f"![{path.stem}]({path.stem}_summary.png)\n\n{text}"
                found[suite] = text
    return found


def _earlier_runs(rows: list[dict[str, Any]], suites: Sequence[str]) -> list[dict[str, Any]]:
    files = {s: sorted({r["file"] for r in rows if r["suite"] == s}) for s in suites}
    return [
        {"suite": s, "status": "from " + ", ".join(f) if f else "no results"}
        for s, f in files.items()
    ]


def environment(device: str) -> dict[str, Any]:
    import torch

    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device == "cuda" and torch.cuda.is_available():
        env["cuda_device"] = torch.cuda.get_device_name(0)
    return env


def collect(raw: Path, suites: Sequence[str], *, quick: bool | None = None) -> list[dict[str, Any]]:
    """Every method record in the suites' JSON files under ``raw`` (``quick``: only the
    ``*_quick.json`` files, or none of them; ``None``: all)."""
    rows: list[dict[str, Any]] = []
    for suite in suites:
        for path in sorted(raw.glob(f"{suite}*.json")):
            if quick is not None and ("_quick" in path.stem) != quick:
                continue
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            _walk(data, suite, path.name, [], rows)
    return rows


def _walk(node: Any, suite: str, file: str, path: list[str], rows: list[dict[str, Any]]) -> None:
    if isinstance(node, dict):
        if _is_record(node):
            named = "method" in node  # a list entry that names its method: keep its label
            method = str(node["method"] if named else (path[-1] if path else "?"))
            parts = path if named else path[:-1]
            workload = "/".join(p for p in parts if p not in ("workloads", "methods", "cells"))
            rows.append(
                {
                    "suite": suite,
                    "file": file,
                    "workload": workload or "-",
                    "method": method,
                    "seconds": node.get("seconds"),
                    "ratio_to_train_step": node.get("ratio_to_train_step"),
                    "peak_memory_bytes": node.get("peak_memory_bytes"),
                    "memory_ratio_to_train_step": node.get("memory_ratio_to_train_step"),
                }
            )
            return
        for key, value in node.items():
            if key in ("env", "environment", "config", "notes", "memory"):
                continue
            _walk(value, suite, file, [*path, str(key)], rows)
    elif isinstance(node, list):
        for k, value in enumerate(node):
            _walk(value, suite, file, [*path, _label(value, k)], rows)


def _label(value: Any, index: int) -> str:
    """A list entry's name: its ``name``, or its size parameters (``B=32 k=100``)."""
    if isinstance(value, dict):
        if value.get("name"):
            return str(value["name"])
        sizes = [
            f"{key}={value[key]}" for key in ("N", "n", "B", "k") if value.get(key) is not None
        ]
        if sizes:
            return " ".join(sizes)
    return str(index)


def _is_record(node: dict[str, Any]) -> bool:
    return "seconds" in node and ("ratio_to_train_step" in node or "peak_memory_bytes" in node)


def render_report(results: dict[str, Any], plots: dict[str, str]) -> str:
    """The markdown report: environment, what ran, one table per suite."""
    env = results["environment"]
    lines = [
        "# multiscale_jac benchmark report",
        "",
        f"torch {env['torch']}, Python {env['python']}, {env['platform']}, device "
        f"{env['device']}{' (' + env['cuda_device'] + ')' if 'cuda_device' in env else ''}, "
        f"{env['threads']} threads, {env['date_utc']}; {'quick' if results['quick'] else 'full'} "
        "run.",
        "",
        "Times are ratios to one training step measured in the same process; peak memory comes "
        "from a fresh process per cell (CPU: peak RSS rise; CUDA: max_memory_allocated).",
        "",
        "| suite | status | seconds |",
        "|---|---|--:|",
    ]
    for run in results["runs"]:
        lines.append(f"| {run['suite']} | {run['status']} | {run.get('seconds', '-')} |")
    by_suite: dict[str, list[dict[str, Any]]] = {}
    for row in results["rows"]:
        by_suite.setdefault(row["suite"], []).append(row)
    for suite, rows in by_suite.items():
        lines += ["", f"## {suite}", ""]
        if suite in results.get("summaries", {}):
            lines += [results["summaries"][suite], ""]
        if suite in plots:
            lines += [f"![{suite}]({plots[suite]})", ""]
        lines += [
            "| workload | method | seconds | x train step | peak MiB | x train-step memory |",
            "|---|---|--:|--:|--:|--:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['workload']} | {r['method']} | {_fmt(r['seconds'])} | "
                f"{_fmt(r['ratio_to_train_step'])} | "
                f"{_fmt(None if r['peak_memory_bytes'] is None else r['peak_memory_bytes'] / 2**20)}"
                f" | {_fmt(r['memory_ratio_to_train_step'])} |"
            )
    if not plots:
        lines += ["", "(no plots: matplotlib is not installed; `pip install -e .[plot]`)"]
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _plots(rows: list[dict[str, Any]], out: Path) -> dict[str, str]:
    """One PNG per suite (time ratio and peak memory per method, log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    made: dict[str, str] = {}
    suites = sorted({r["suite"] for r in rows})
    for suite in suites:
        sel = [r for r in rows if r["suite"] == suite]
        labels = [f"{r['workload']}\n{r['method']}" for r in sel]
        ratio = [r["ratio_to_train_step"] or 0 for r in sel]
        mem = [(r["peak_memory_bytes"] or 0) / 2**20 for r in sel]
        if not any(ratio) and not any(mem):
            continue
        methods = sorted({r["method"] for r in sel})
        cmap = plt.get_cmap("tab10")
        colors = {m: cmap(k % 10) for k, m in enumerate(methods)}
        fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.5 * len(sel)), 5))
        for ax, values, title in (
            (axes[0], ratio, "time / training step"),
            (axes[1], mem, "peak memory (MiB)"),
        ):
            ax.bar(
                range(len(values)),
                [v if v > 0 else float("nan") for v in values],
                color=[colors[r["method"]] for r in sel],
            )
            ax.set_yscale("log")
            ax.set_title(f"{suite}: {title}")
            ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=6)
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[m]) for m in methods]
        axes[1].legend(handles, methods, fontsize=7, loc="upper right")
        fig.tight_layout()
        name = f"{suite}.png"
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        made[suite] = name
    return made


def _bar(items: Sequence[str], enabled: bool) -> Any:
    if not enabled or not sys.stderr.isatty():
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="bench", unit="suite")
