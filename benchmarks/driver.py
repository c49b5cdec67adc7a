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
* ``DIR/<suite>.png`` (``<suite>_part<k>.png`` for a suite of many rows): time ratio and peak
  memory per workload and method, horizontal bars on log scales (needs matplotlib, the ``plot``
  extra; skipped with a note otherwise).
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


#: the value columns of a suite's table: header, alignment, how a row's value is read
_COLUMNS: tuple[tuple[str, str, Any], ...] = (
    ("seconds", "--:", lambda r: r.get("seconds")),
    ("x train step", "--:", lambda r: r.get("ratio_to_train_step")),
    ("peak MiB", "--:", lambda r: _mib(r.get("peak_memory_bytes"))),
    ("x train-step memory", "--:", lambda r: r.get("memory_ratio_to_train_step")),
)

#: rows per plot: a suite with more rows gets one figure per group of workloads
PLOT_MAX_ROWS = 30


def render_report(results: dict[str, Any], plots: dict[str, Any]) -> str:
    """The markdown report: environment, what ran, one table per suite.

    A suite's table leaves out the value columns that no row of the suite fills, and its rows are
    grouped by workload (first appearance first). Rows from a file other than the suite's main
    file (a re-run, ``<suite>_*rerun*.json``) have that file in their method's label, and a line
    under the table says which rows they are. ``plots``: suite -> PNG name or list of names.
    """
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
        names = plots.get(suite) or []
        for name in [names] if isinstance(names, str) else names:
            lines += [f"![{suite}]({name})", ""]
        lines += _table(suite, rows)
    if not plots:
        lines += ["", "(no plots: matplotlib is not installed; `pip install -e .[plot]`)"]
    return "\n".join(lines) + "\n"


def _table(suite: str, rows: list[dict[str, Any]]) -> list[str]:
    """A suite's markdown table (no empty value columns, re-run rows labelled), with a line
    under it naming the re-run rows and the left-out columns."""
    rows = _by_workload(rows)
    tags = _sources(suite, rows)
    columns = [c for c in _COLUMNS if any(c[2](r) is not None for r in rows)]
    lines = [
        "| workload | method | " + " | ".join(c[0] for c in columns) + " |",
        "|---|---|" + "".join(f"{c[1]}|" for c in columns),
    ]
    for r in rows:
        cells = [r["workload"], _method_label(r, tags, full=True)]
        cells += [_fmt(c[2](r)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    main = [f for f, tag in tags.items() if tag is None]
    for file, tag in tags.items():
        if tag is None:
            continue
        sel = [r for r in rows if r.get("file") == file]
        workloads = list(dict.fromkeys(r["workload"] for r in sel))
        plural = "s" if len(sel) != 1 else ""
        notes.append(
            f"{'Re-run' if tag.startswith('re-run') else 'Other'} rows, method marked "
            f"'({tag}: {file})': {len(sel)} row{plural} ({', '.join(workloads)})"
            + (f"; every other row comes from {', '.join(main)}." if main else ".")
        )
    dropped = [c[0] for c in _COLUMNS if c not in columns]
    if dropped:
        notes.append(f"Columns without a value in this suite are left out: {', '.join(dropped)}.")
    for note in notes:  # each its own paragraph
        lines += ["", note]
    return lines


def _mib(value: Any) -> float | None:
    return None if value is None else value / 2**20


def _by_workload(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` grouped by workload, the workloads in order of first appearance (stable)."""
    order = {w: k for k, w in enumerate(dict.fromkeys(r["workload"] for r in rows))}
    return sorted(rows, key=lambda r: order[r["workload"]])


def _sources(suite: str, rows: list[dict[str, Any]]) -> dict[str, str | None]:
    """Each file of a suite's rows -> ``None`` for the suite's main file, else its tag:
    ``re-run`` (``re-run 2``, ... when there are several) for a file whose stem has ``rerun``,
    ``from`` for any other file. The main file is ``<suite>.json`` (or ``<suite>_quick.json``),
    else the first file (by name) without ``rerun`` in its name."""
    files = sorted({str(r.get("file") or "") for r in rows})
    main = next((f for f in files if f in (f"{suite}.json", f"{suite}_quick.json")), None)
    if main is None:
        main = next((f for f in files if "rerun" not in Path(f).stem), None)
    tags: dict[str, str | None] = {}
    reruns = [f for f in files if f != main and "rerun" in Path(f).stem]
    for f in files:
        if f == main:
            tags[f] = None
        elif f in reruns:
            tags[f] = "re-run" if len(reruns) == 1 else f"re-run {reruns.index(f) + 1}"
        else:
            tags[f] = "from"
    return tags


def _method_label(row: dict[str, Any], tags: dict[str, str | None], *, full: bool) -> str:
    """``library``, or for a row from another file ``library (re-run: <file>)`` (``full``) or
    ``library (re-run)`` (plots, whose legend names the file)."""
    file = str(row.get("file") or "")
    tag = tags.get(file)
    if tag is None:
        return str(row["method"])
    if full or tag == "from":
        return f"{row['method']} ({tag}: {file})" if full else f"{row['method']} ({file})"
    return f"{row['method']} ({tag})"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _plot_parts(rows: list[dict[str, Any]], max_rows: int) -> list[list[dict[str, Any]]]:
    """``rows`` (grouped by workload) cut into figures of at most ``max_rows`` rows, whole
    workloads per figure where a workload fits, the figures about equally tall."""
    groups: list[list[dict[str, Any]]] = []
    for r in rows:
        if groups and groups[-1][0]["workload"] == r["workload"]:
            groups[-1].append(r)
        else:
            groups.append([r])
    chunks = [g[k : k + max_rows] for g in groups for k in range(0, len(g), max_rows)]

    def fill(target: int) -> list[list[dict[str, Any]]]:
        parts: list[list[dict[str, Any]]] = []
        for chunk in chunks:
            if parts and len(parts[-1]) + len(chunk) <= target:
                parts[-1].extend(chunk)
            else:
                parts.append(list(chunk))
        return parts

    fewest = len(fill(max_rows))  # filling up to the cap gives the fewest figures
    for target in range(-(-len(rows) // fewest), max_rows):  # the most even fill as few
        if len(parts := fill(target)) == fewest:
            return parts
    return fill(max_rows)


def _plots(
    rows: list[dict[str, Any]], out: Path, *, max_rows: int = PLOT_MAX_ROWS
) -> dict[str, list[str]]:
    """PNGs per suite: horizontal bars, one row per ``workload · method`` (grouped by workload,
    colour by method, re-run rows hatched), time as a multiple of a training step and peak
    memory in two panels sharing the rows, log scales; a panel without data is left out, a suite
    without data gets no figure, one with more than ``max_rows`` rows one figure per group of
    workloads (``<suite>_part1.png``, ...). Returns suite -> the PNG names."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    made: dict[str, list[str]] = {}
    for suite in sorted({r["suite"] for r in rows}):
        for old in [out / f"{suite}.png", *sorted(out.glob(f"{suite}_part*.png"))]:
            old.unlink(missing_ok=True)  # an earlier report's figures of this suite
        sel = _by_workload([r for r in rows if r["suite"] == suite])
        if not any(_plot_values(r)[0] or _plot_values(r)[1] for r in sel):
            continue
        tags = _sources(suite, sel)
        methods = list(dict.fromkeys(str(r["method"]) for r in sel))
        cmap = plt.get_cmap("tab10")
        colors = {m: cmap(k % 10) for k, m in enumerate(methods)}
        parts = _plot_parts(sel, max_rows)
        names = []
        with plt.rc_context({"font.size": 9, "axes.titlesize": 10, "legend.fontsize": 8.5}):
            for k, part in enumerate(parts, 1):
                fig = _figure(plt, suite, part, tags, colors, k, len(parts))
                name = f"{suite}.png" if len(parts) == 1 else f"{suite}_part{k}.png"
                fig.savefig(out / name, dpi=110, metadata={"Software": None})
                plt.close(fig)
                names.append(name)
        made[suite] = names
    return made


def _plot_values(row: dict[str, Any]) -> tuple[float | None, float | None]:
    """A row's time ratio and peak MiB, ``None`` where missing or not positive (log scale)."""
    ratio, mem = row.get("ratio_to_train_step"), _mib(row.get("peak_memory_bytes"))
    return (
        ratio if isinstance(ratio, (int, float)) and ratio > 0 else None,
        mem if isinstance(mem, (int, float)) and mem > 0 else None,
    )


def _figure(
    plt: Any,
    suite: str,
    rows: list[dict[str, Any]],
    tags: dict[str, str | None],
    colors: dict[str, Any],
    part: int,
    n_parts: int,
) -> Any:
    """One figure of :func:`_plots`: the rows top to bottom, one panel per quantity with data."""
    import math

    values = [_plot_values(r) for r in rows]
    panels = [
        (0, "time / one training step (log)"),
        (1, "peak memory, MiB (log)"),
    ]
    panels = [(i, t) for i, t in panels if any(v[i] is not None for v in values)]
    height = 1.9 + 0.27 * len(rows)
    fig, axes = plt.subplots(
        1,
        len(panels),
        sharey=True,
        figsize=(8.5, height),
        layout="constrained",
        squeeze=False,
    )
    y = list(range(len(rows)))
    labels = [f"{r['workload']} · {_method_label(r, tags, full=False)}" for r in rows]
    rerun = [tags.get(str(r.get("file") or "")) is not None for r in rows]
    for ax, (i, title) in zip(axes[0], panels):
        data = [v[i] for v in values]
        present = [v for v in data if v is not None]
        # half a decade or less below the shortest bar
        lo = 10 ** (math.floor(2 * math.log10(min(present) * 0.7)) / 2)
        hi = max(present) * 3  # room for the value written at the bar's end
        if i == 0:
            lo = min(lo, 0.5)
        for yk, v, r, hatched in zip(y, data, rows, rerun):
            if v is None:
                ax.text(lo * 1.15, yk, "no data", va="center", fontsize=8, color="0.4")
                continue
            ax.barh(
                yk,
                v - lo,
                left=lo,
                height=0.75,
                color=colors[str(r["method"])],
                hatch="///" if hatched else None,
                edgecolor="white" if hatched else None,
                linewidth=0,
            )
            ax.text(v * 1.08, yk, _fmt(v), va="center", fontsize=8)
        # workload groups: a light band behind every other workload
        start = 0
        for k in range(1, len(rows) + 1):
            if k == len(rows) or rows[k]["workload"] != rows[start]["workload"]:
                if len({r["workload"] for r in rows[:start]}) % 2 == 1:
                    ax.axhspan(start - 0.5, k - 0.5, color="0.93", zorder=0)
                start = k
        if i == 0:
            ax.axvline(1.0, color="0.25", linestyle="--", linewidth=1, zorder=3)
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.set_title(title)
        ax.grid(axis="x", which="major", color="0.85", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.tick_params(axis="x", labelsize=8)
    axes[0][0].set_yticks(y, labels, fontsize=8)
    axes[0][0].set_ylim(len(rows) - 0.5, -0.5)
    in_part = {str(r["method"]) for r in rows}
    used = [m for m in colors if m in in_part]  # the suite's order, the same in every part
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[m]) for m in used]
    names = list(used)
    for file, tag in tags.items():
        if tag is not None and any(str(r.get("file") or "") == file for r in rows):
            handles.append(
                plt.Rectangle((0, 0), 1, 1, facecolor="0.6", hatch="///", edgecolor="white")
            )
            names.append(f"{tag}: {file}")
    if panels[0][0] == 0:
        handles.append(plt.Line2D([], [], color="0.25", linestyle="--", linewidth=1))
        names.append("1 training step")
    fig.legend(handles, names, loc="outside lower center", ncols=min(4, len(names)), frameon=False)
    part_note = f" (part {part} of {n_parts})" if n_parts > 1 else ""
    fig.suptitle(f"{suite}{part_note}", fontsize=11)
    return fig


def _bar(items: Sequence[str], enabled: bool) -> Any:
    if not enabled or not sys.stderr.isatty():
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="bench", unit="suite")
