"""Every published figure of the benchmark grid, rendered from one results file.

``bench_peers.py`` writes ``benchmarks/results/grid.json`` (``{"runs": [...], "cells": [...]}``,
each cell naming its named grid, ``family``, and the ``run`` that measured it, each run its
environment stamp). This module turns that file into

* ``<stem>.md`` and plots next to it (:func:`write_outputs`): every family's table, then every
  cell's per-method table;
* the report of ``multiscale-jac bench`` (:func:`write_report`: ``report.md``,
  ``results.json``, plots);
* the blocks of README.md and the docs pages between ``<!-- figures: NAME from PATH -->`` and
  ``<!-- /figures -->`` (:data:`FIGURES`; :func:`update_pages` rewrites them, :func:`stale_blocks`
  lists those that differ from what their results file renders: the test of the published
  figures).

    python benchmarks/render.py                # rewrite README.md's and the docs' blocks
    python benchmarks/render.py --check        # exit 1 where a block differs from its file

Only the standard library at module level (matplotlib inside the plots).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results/grid.json"
PAGES = ("README.md", "docs/**/*.md")
BLOCK = re.compile(
    r"(<!-- figures: (?P<name>[\w-]+) from (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- /figures -->)",
    re.S,
)
MIB = 2**20


# ---------------------------------------------------------------------- formatting
def num(x: float | None, unit: str = "") -> str:
    """A ratio or a size: integers from 100, one decimal from 10, else two (``-``: none)."""
    if x is None:
        return "-"
    return (f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}") + unit


def secs(x: float | None) -> str:
    """Seconds: as :func:`num` from 0.1 s, three significant figures below."""
    return num(x) if x is None or x >= 0.1 else f"{x:.3g}"


def mib(b: float | None) -> str:
    """Bytes in MiB, or GiB from 1024 MiB on (binary units, the unit written)."""
    if b is None:
        return "-"
    return num(b / 2**30, " GiB") if b >= 2**30 else num(b / MIB, " MiB")


def table(headers: list[str], rows: Iterable[list[Any]]) -> str:
    """A markdown table; columns right-aligned where every value is a number."""
    rows = [["-" if c is None else str(c) for c in r] for r in rows]
    right = [
        bool(rows) and all(re.fullmatch(r"-|[\d.,]+x?", r[i]) for r in rows)
        for i in range(len(headers))
    ]
    sep = "|" + "|".join("--:" if ra else "---" for ra in right) + "|"
    return "\n".join(
        ["| " + " | ".join(headers) + " |", sep, *("| " + " | ".join(r) + " |" for r in rows)]
    )


def cells(results: dict[str, Any], family: str) -> list[dict[str, Any]]:
    return [c for c in results["cells"] if c.get("family") == family]


def measured(family: str) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """A family's table, or a line saying that none of its cells has been measured yet."""

    def wrap(fn: Callable[..., str]) -> Callable[..., str]:
        def table_or_line(results: dict[str, Any], *args: Any, **kw: Any) -> str:
            if cells(results, family):
                return fn(results, *args, **kw)
            return f"No cell of this grid measured yet (`bench_peers.py --grid {family}`)."

        return table_or_line

    return wrap


def cell(results: dict[str, Any], family: str, name: str) -> dict[str, Any]:
    found = [c for c in cells(results, family) if c["name"] == name]
    return found[0] if found else {"name": name, "methods": {}}


def method(c: dict[str, Any], name: str | None) -> dict[str, Any]:
    return c.get("methods", {}).get(name or "", {})


def route(name: str | None) -> str:
    """A forced route's name without the ``library_`` prefix."""
    return (name or "-").removeprefix("library_")


def steps(r: dict[str, Any]) -> str:
    return num(r.get("ratio_to_train_step"))


def why_not(r: dict[str, Any]) -> str:
    """A method that did not run: its estimate, or the reason in short."""
    if r.get("estimated_bytes") and "estimated" in str(r.get("skipped", "")):
        return f"est. {mib(r['estimated_bytes'])}, not run"
    return str(r.get("skipped") or r.get("error") or "not run")[:80]


# ---------------------------------------------------------------------- the family tables
def main_table(
    results: dict[str, Any], family: str = "main", notes: bool = False, routes: bool = True
) -> str:
    """Per cell: auto and the best other method in training steps; ``routes``: also the best
    forced route (the benchmark page leaves it to the route-choice table, to fit the column)."""
    head = ["cell", "auto x step", "best other", "other x step", "auto / best other"]
    head += (["best route", "auto / best route"] if routes else []) + (["note"] if notes else [])
    rows = []
    for c in cells(results, family):
        auto, other = method(c, "library_auto"), method(c, c.get("best_other"))
        row = [c["name"], steps(auto), c.get("best_other") or "-", steps(other)]
        row.append(num(c.get("library_over_best_other")))
        if routes:
            row += [route(c.get("best_route")), num(c.get("auto_over_best_route"))]
        if notes:
            problem = c.get("error") or c.get("auto_problem") or c.get("note") or ""
            row.append(str(problem)[:160])
        rows.append(row)
    return table(head, rows)


def _memory_pair(c: dict[str, Any]) -> str:
    """auto's peak memory over its route forced, with both (a ratio of rises near zero says
    little on its own)."""
    ratio = c.get("auto_memory_over_chosen_route")
    if ratio is None:
        return "-"
    auto = method(c, "library_auto")
    ours = auto.get("peak_memory_median_bytes", auto.get("peak_memory_bytes"))
    forced = (auto.get("chosen_route_memory") or {}).get("peak_memory_bytes")
    return f"{num(ratio)} ({mib(ours)} / {mib(forced)})"


def choice_table(results: dict[str, Any]) -> str:
    """auto (the cost model's choice: nothing timed) against the fastest forced route per
    cell: the choice family's cell where one was measured, else the main family's (both time
    auto and every forced route)."""
    chosen = {c["name"]: c for c in cells(results, "main")}
    chosen.update({c["name"]: c for c in cells(results, "choice")})
    rows = [
        [
            c["name"],
            secs(method(c, "library_auto").get("seconds")),
            route(c.get("best_route")),
            secs(c.get("best_route_seconds")),
            num(c.get("auto_over_best_route")),
            c.get("run"),
        ]
        for c in chosen.values()
    ]
    ratios = [c["auto_over_best_route"] for c in chosen.values() if c.get("auto_over_best_route")]
    head = ["cell", "auto s", "fastest forced route", "route s", "auto / route", "run"]
    fams = sorted({c["family"] for c in chosen.values()})
    summary = (
        f"{len(ratios)} cells of the {' and '.join(f'`{f}`' for f in fams)} grids; auto (the "
        f"estimate) / the fastest forced route: median {num(median(ratios))}, largest "
        f"{num(max(ratios))}."
        if ratios
        else "No cells measured."
    )
    return table(head, rows) + "\n\n" + summary


def _priced(c: dict[str, Any]) -> list[tuple[str, float, float]]:
    """``(route, estimated s, measured s)`` of every forced route of an engine cell whose
    result noted the cost model's price."""
    found = []
    for name, r in c.get("methods", {}).items():
        est = (r.get("library") or {}).get("estimate_s")
        if name.startswith("library_") and name != "library_auto" and est and r.get("seconds"):
            found.append((route(name), float(est), float(r["seconds"])))
    return found


def estimate_error_table(results: dict[str, Any]) -> str:
    """The cost model's error: per cell of the choice grid, every forced route's estimated
    seconds (noted by the engine) against its measured seconds."""
    rows, ratios = [], []
    for c in cells(results, "choice"):
        priced = _priced(c)
        if not priced:
            continue
        off = [t / e for _, e, t in priced]
        ratios += off
        pick = min(priced, key=lambda p: p[1])
        fastest = min(priced, key=lambda p: p[2])
        rows.append(
            [
                c["name"],
                len(priced),
                num(median(off)),
                f"{num(min(off))}-{num(max(off))}",
                pick[0],
                fastest[0],
                num(pick[2] / fastest[2]),
            ]
        )
    head = ["cell", "routes", "measured / estimated: median", "range", "cheapest estimated"]
    head += ["fastest measured", "its time / fastest"]
    summary = (
        f"{len(ratios)} routes in {len(rows)} cells; measured / estimated seconds: median "
        f"{num(median(ratios))}, from {num(min(ratios))} to {num(max(ratios))}."
        if ratios
        else "No priced routes measured."
    )
    return table(head, rows) + "\n\n" + summary


def methods_table(
    results: dict[str, Any], family: str, param: str, workload: str | None = None
) -> str:
    """Per cell and method: seconds, training steps, peak memory (the batch and entries
    sweeps; ``param``: the column of the swept parameter, ``n`` or ``k``)."""
    rows = []
    for c in cells(results, family):
        if workload and c.get("workload") != workload:
            continue
        for name, r in c.get("methods", {}).items():
            if "seconds" not in r and name != "autograd_jacobian":
                continue
            value = c.get("N") if param == "n" else c.get("P")
            if "seconds" not in r:
                rows.append([c["name"].split("@")[0], value, name, why_not(r), "-", "-", "-"])
                continue
            rows.append(
                [
                    c["name"].split("@")[0],
                    value,
                    name,
                    secs(r["seconds"]),
                    steps(r),
                    num(r.get("peak_memory_bytes") and r["peak_memory_bytes"] / MIB),
                    num(r.get("memory_ratio_to_train_step")),
                ]
            )
    head = ["cell", param.upper() if param == "n" else "entries", "method", "s", "x step"]
    return table([*head, "peak MiB", "x step memory"], rows)


@measured("dense")
def dense_table(results: dict[str, Any]) -> str:
    rows = []
    for c in cells(results, "dense"):
        un, sl = method(c, "library_auto"), method(c, "library_sliced")
        ratio = sl["seconds"] / un["seconds"] if "seconds" in un and "seconds" in sl else None
        rows.append(
            [
                c["name"],
                c.get("O"),
                c.get("P"),
                secs(un.get("seconds")),
                secs(sl.get("seconds")),
                num(ratio),
                "-" if sl.get("float32_rel_diff") is None else f"{sl['float32_rel_diff']:.1e}",
            ]
        )
    head = ["cell", "outputs a sample", "entries", "unsliced s", "sliced s", "sliced / unsliced"]
    return table([*head, "rel diff"], rows)


@measured("laplace_torch")
def laplace_torch_table(results: dict[str, Any]) -> str:
    rows = []
    for c in cells(results, "laplace_torch"):
        for name in ("library_auto", "laplace_torch"):
            r = method(c, name)
            mem = mib(r.get("peak_memory_bytes"))
            run = r.get("run", c.get("run"))
            rows.append(
                [c["name"], name, secs(r.get("seconds")), mem if mem != "-" else why_not(r), run]
            )
    return table(["cell", "method", "s", "peak memory", "run"], rows)


@measured("first_call")
def first_call_table(results: dict[str, Any]) -> str:
    rows = []
    for c in cells(results, "first_call"):
        lib, user, ratio = c.get("library", {}), c.get("user", {}), c.get("ratios", {})
        rows.append(
            [
                c["name"],
                secs(lib.get("first_seconds")),
                secs(user.get("first_seconds")),
                num(ratio.get("first")),
                num(ratio.get("second")),
                num(ratio.get("warm")),
                num(ratio.get("loaded")),
                num(ratio.get("rss")),
                mib(c.get("budget", {}).get("peak_memory_bytes")),
                mib(c.get("overhead", {}).get("peak_memory_bytes")),
                num(ratio.get("budget")),
                ", ".join(c.get("over_target", [])) or "-",
            ]
        )
    head = ["cell", "auto first s", "user first s", "first / user first", "second / warm"]
    head += ["warm / user warm"]
    budget = "(budgeted - overhead) / budget"
    head += ["loaded / allowance", "RSS / tune=False", "budgeted RSS", "overhead", budget]
    return table([*head, "over target"], rows)


def busy(load: list[Any], threads: int) -> str:
    """A note where the machine's load average passed its threads: other work shared the cores
    (times are then noisy; ratios in training steps less so, memory not at all)."""
    peak = max((x[0] for x in load if x), default=0.0)
    return (
        f"; loaded machine (load {peak:.1f} on {threads} threads): times noisy"
        if peak > threads
        else ""
    )


def _runs_used(results: dict[str, Any], families: Iterable[str] | None) -> dict[int, set[str]]:
    """Run id -> the named grids whose cells (or a method kept from an earlier run) it measured."""
    used: dict[int, set[str]] = {}
    for c in results["cells"]:
        if families is None or c.get("family") in families:
            for run in {c.get("run")} | {r.get("run") for r in c.get("methods", {}).values()}:
                if run is not None:  # a method kept from an earlier run names it
                    used.setdefault(run, set()).add(c.get("family"))
    return used


def _run_facts(r: dict[str, Any], grids: set[str]) -> dict[str, str]:
    env = r["env"]
    load = [env.get(f"load_average_at_{k}") for k in ("start", "end")]
    return {
        "run": str(r["id"]),
        "date": env.get("date_utc", "?")[:10],
        "commit": (env.get("git_commit") or "?")[:7] + (" (dirty)" if env.get("git_dirty") else ""),
        "machine": f"{env.get('device')}, {env.get('threads')} threads, torch {env.get('torch')}",
        "load": " / ".join("-" if not x else f"{x[0]:.1f}" for x in load),
        "grids": ", ".join(sorted(grids)),
        "size": "quick" if r["config"].get("quick") else "full",
        "source": r.get("source", "this grid") + busy(load, env.get("threads") or 1),
    }


def runs_table(results: dict[str, Any], families: Iterable[str] | None = None) -> str:
    """Which run measured which cells: its date, commit, machine load, and its source (a run
    converted from an earlier suite's file says so)."""
    used = _runs_used(results, families)
    keys = ["run", "date", "commit", "machine", "load", "grids", "size", "source"]
    rows = [
        [_run_facts(r, used[r["id"]])[k] for k in keys] for r in results["runs"] if r["id"] in used
    ]
    head = ["run", "date", "commit", "machine", "load start / end", "grids", "size", "source"]
    return table(head, rows)


def runs_page(results: dict[str, Any]) -> str:
    """The benchmark page's runs: :func:`runs_table` narrowed to the page's column. The machine
    is a sentence where every run had the same one, and each run's source (often a long line)
    is a list item under the table."""
    used = _runs_used(results, None)
    facts = [_run_facts(r, used[r["id"]]) for r in results["runs"] if r["id"] in used]
    machines = sorted({f["machine"] for f in facts})
    keys = ["run", "date", "commit"] + (["machine"] if len(machines) > 1 else [])
    keys += ["load", "grids", "size"]
    heads = {"load": "load start / end"}
    out = [table([heads.get(k, k) for k in keys], [[f[k] for k in keys] for f in facts])]
    if len(machines) == 1:
        out.append(f"Every run: {machines[0]}.")
    out.append("\n".join(f"- Run {f['run']}: {f['source'].rstrip('.')}." for f in facts))
    return "\n\n".join(out)


def readme_table(results: dict[str, Any]) -> str:
    """README.md's performance table: times from the main grid's cell, memory from the batch
    grid's cell of the same workload and model at the same batch size (the main grid may run
    without memory), each row naming its runs."""

    def both(main: dict[str, Any], batch: dict[str, Any], name: str | None) -> str:
        t, m = method(main, name), method(batch, name)
        mem = m.get("memory_ratio_to_train_step")
        return f"{steps(t)} steps, {num(mem)}x its memory" if mem else f"{steps(t)} steps"

    def today(r: dict[str, Any]) -> str:
        if "seconds" in r:
            return f"{steps(r)} steps, {mib(r.get('peak_memory_bytes'))}"
        return why_not(r)

    rows = []
    for name, n, what in (
        ("fisher/vgg11_bn_q", 128, "diagonal empirical Fisher, VGG-11-BN/4, N=128"),
        ("fisher/resnet8", 128, "same, ResNet-8, N=128"),
        ("jacnorm/cnn8", 128, "gradient of the Jacobian-norm regulariser, 8-layer CNN, n=128"),
    ):
        main, batch = cell(results, "main", name), cell(results, "batch", f"{name}@n={n}")
        if not main.get("methods"):
            continue
        other = main.get("best_other")
        vec = method(batch, "autograd_jacobian") or method(main, "autograd_jacobian")
        runs = sorted({c["run"] for c in (main, batch) if c.get("run")})
        rows.append(
            [
                what,
                both(main, batch, "library_auto"),
                f"`{other}` " + both(main, batch, other),
                "`jacobian(vectorize=True)`: " + today(vec),
                ", ".join(map(str, runs)),
            ]
        )
    for c in cells(results, "laplace_torch"):
        lib, lt = method(c, "library_auto"), method(c, "laplace_torch")
        lt_mem = mib(lt.get("peak_memory_bytes")) if lt.get("peak_memory_bytes") else why_not(lt)
        what = f"subnetwork Laplace fit, `{c['model']}`, B={c.get('N')}, {c.get('P')} entries"
        runs = sorted({r.get("run", c.get("run")) for r in (lib, lt)})
        rows.append(
            [
                what,
                mib(lib.get("peak_memory_bytes")),
                f"laplace-torch `SubnetLaplace`: {lt_mem}",
                "-",
                ", ".join(map(str, runs)),
            ]
        )
    head = ["task", "library", "best other method", "the code users write today", "runs"]
    return table(head, rows)


#: how the pages name the benchmark grid's models
MODELS = {
    "vgg11_bn_q": "VGG-11-BN at quarter width",
    "resnet8": "ResNet-8",
    "cnn3": "the 3-conv CNN",
    "cnn8": "the 8-layer CNN",
}


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def guide_figures(results: dict[str, Any], workload: str, models: Iterable[str], what: str) -> str:
    """A guide's sentence: ``what`` in training steps per model (the main grid's cell, an idle
    run) and its peak memory against a training step's (the batch grid's cell at the same batch
    size), each with its run, as README.md's table takes them."""
    took, memory, runs, machine, batch = [], [], [set(), set()], "", None
    for m in models:
        main = cell(results, "main", f"{workload}/{m}")
        auto = method(main, "library_auto")
        if "seconds" not in auto:
            continue
        name, batch = MODELS.get(m, m), main.get("N")
        took.append(f"{steps(auto)}{' training steps' if not took else ''} on {name}")
        runs[0].add(main["run"])
        env = next(r["env"] for r in results["runs"] if r["id"] == main["run"])
        machine = f"{env.get('device')}, {env.get('threads')} threads"
        other = cell(results, "batch", f"{workload}/{m}@n={batch}")
        ratio = method(other, "library_auto").get("memory_ratio_to_train_step")
        if ratio:
            unit = "x" if memory else "x a training step's"
            memory.append(f"{num(ratio)}{unit} on {name}")
            runs[1].add(other["run"])
    if not took:
        return f"No cell of `--grid main` has measured `{workload}` yet."

    def of(ids: set[int]) -> str:
        return ("run " if len(ids) == 1 else "runs ") + ", ".join(map(str, sorted(ids)))

    text = f"Measured ({machine}, {batch} samples): {what} took {_and(took)} ({of(runs[0])})"
    if memory:
        text += f", with a peak memory of {_and(memory)} ({of(runs[1])})"
    return text + "; the runs are listed on [the benchmark page](benchmarks.md#runs)."


def _span(xs: list[float], fmt: str) -> str:
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo} to {hi}"


def ci_times(results: dict[str, Any]) -> str:
    """``ci.json``: the suite's and the fast tier's times in the CI runs it holds (``.ci/run``
    prints a run's record, ``--ci-run``; the runs kept are clean clones on 2 cores)."""
    runs, last = results["runs"], results["runs"][-1]
    suite = _span([r["suite"]["seconds"] / 60 for r in runs], "{:.1f}")
    fast = _span([r["fast"]["seconds"] for r in runs], "{:.0f}")
    return (
        f"In CI (`bash .ci/run` on a clean clone, 2 CPU cores; "
        f"{len(runs)} run{'s' * (len(runs) > 1)}, the last at "
        f"{last['commit'][:7]}), the whole suite ({last['suite']['tests']:,} tests) took "
        f'{suite} minutes and the fast tier, `python -m pytest -m "not slow"`, '
        f"{last['fast']['tests']:,} of them, {fast} s.\n"
    )


def ci_run(suite_log: str, fast_log: str) -> dict[str, Any]:
    """A CI run's record from pytest's summary lines (``.ci/run``)."""

    def summary(path: str) -> dict[str, Any]:
        line = Path(path).read_text().strip().splitlines()[-1]
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|skipped|xfailed|failed)", line)}
        seconds = float(re.search(r" in ([\d.]+)s", line)[1])  # type: ignore[index]
        ran = sum(v for k, v in counts.items() if k != "skipped")
        return {"seconds": seconds, "tests": ran, **counts}

    git = ["git", "-C", str(ROOT), "log", "-1", "--format=%H %cs"]
    commit, date = subprocess.run(git, capture_output=True, text=True).stdout.split()
    return {"commit": commit, "date": date, "suite": summary(suite_log), "fast": summary(fast_log)}


def laplace_diag_table(results: dict[str, Any]) -> str:
    """``bench_laplace_diag.json`` (the former ``bench_laplace.py --diag``): seconds and
    training steps against the mean of a training step timed before and after."""
    rows = [["training step (mean of before and after)", secs(results["train_step_seconds"])]]
    rows[0].append(num(1.0))
    for name, r in results["methods"].items():
        if name != "train_step":
            rows.append([f"`{name}`", secs(r["seconds"]), steps(r)])
    return table(["method", "s", "x step"], rows)


def packing_table(results: dict[str, Any]) -> str:
    """``bench_multires.json``'s ``map_levels`` part (the former ``bench_multires.py``): the
    work and the times of each packing; stacking every level is computed, not run."""
    m = results["map_levels"]
    work, times = m["work_ratio"], m["packings"]
    names = {
        "canvas": "canvas (gutter 2)",
        "loop": "per-level loop",
        "stack_padded_to_largest": "stack every level padded to the largest (computed, not run)",
    }
    rows = []
    for key, label in names.items():
        t = times.get(key, {})
        rows.append(
            [label, num(work.get(key))]
            + [secs(t.get(k)) for k in ("forward", "train_step", "jacobian")]
        )
    head = ["packing", "work / useful", "forward s", "training step s", "per-sample Jacobian s"]
    return table(head, rows)


#: the published blocks: name -> markdown from the results
def rows_table(results: dict[str, Any], grid: str) -> str:
    """``bench_rows.py``'s table for ``grid`` (``speed``, ``loop``) and what produced it."""
    r = results[grid]
    env = r["env"]
    stamp = (
        f"torch {env['torch']}, {env['torch_threads']} threads, {env['cpu_model']}, "
        f"commit {str(env.get('git_commit'))[:7]}, {env['date_utc'][:10]}"
    )
    if grid == "loop":
        stamp += (
            f"; N={r['N']}, ran {r['strategy']!r}, max relative error {r['max_relative_error']:.1e}"
        )
    return f"{r['table'].rstrip()}\n\n({stamp})\n"


FIGURES: dict[str, Callable[[dict[str, Any]], str]] = {
    "readme": readme_table,
    "runs": runs_page,
    "main": lambda r: main_table(r, routes=False),
    "choice": choice_table,
    "choice-error": estimate_error_table,
    "batch-fisher": lambda r: measured("batch")(methods_table)(r, "batch", "n", "fisher"),
    "batch-jacnorm": lambda r: measured("batch")(methods_table)(r, "batch", "n", "jacnorm"),
    "entries": lambda r: measured("entries")(methods_table)(r, "entries", "k"),
    "dense": dense_table,
    "laplace-torch": laplace_torch_table,
    "first-call": first_call_table,
    "guide-fisher": lambda r: guide_figures(
        r, "fisher", ("vgg11_bn_q", "resnet8"), "`diag_fisher`"
    ),
    "guide-jacnorm": lambda r: guide_figures(
        r, "jacnorm", ("cnn3", "cnn8"), "the value and its gradient"
    ),
    "laplace-diag": laplace_diag_table,
    "ci": ci_times,
    "packing": packing_table,
    "rows-speed": lambda r: rows_table(r, "speed"),
    "rows-loop": lambda r: rows_table(r, "loop"),
}
#: the report's section per named grid
SECTIONS: dict[str, Callable[[dict[str, Any]], str]] = {
    "main": lambda r: main_table(r, "main", notes=True),
    "choice": lambda r: choice_table(r) + "\n\n" + estimate_error_table(r),
    "batch": lambda r: methods_table(r, "batch", "n"),
    "entries": FIGURES["entries"],
    "dense": dense_table,
    "laplace_torch": laplace_torch_table,
    "first_call": first_call_table,
}


# ---------------------------------------------------------------------- plots
def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_main(results: dict[str, Any], path: Path) -> Path | None:
    """auto / best other (green <= 1, red > 1) and auto / best forced route per main cell."""
    plt, cs = _plt(), [c for c in cells(results, "main") if c.get("library_over_best_other")]
    if plt is None or not cs:
        return None
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(cs)), 5))
    x = range(len(cs))
    lob = [c["library_over_best_other"] for c in cs]
    aor = [c.get("auto_over_best_route") or float("nan") for c in cs]
    colors = ["tab:green" if v <= 1 else "tab:red" for v in lob]
    ax.bar([i - 0.2 for i in x], lob, width=0.4, color=colors, label="auto / best other method")
    ax.bar(
        [i + 0.2 for i in x],
        aor,
        width=0.4,
        color="tab:gray",
        alpha=0.6,
        label="auto / best forced route",
    )
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(list(x), [c["name"] for c in cs], rotation=90, fontsize=7)
    ax.set_ylabel("time ratio (log; < 1: the library is faster)")
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_sweep(results: dict[str, Any], family: str, param: str, path: Path) -> Path | None:
    """Seconds and peak memory against the swept parameter, a line per cell and method."""
    plt, cs = _plt(), cells(results, family)
    if plt is None or not cs:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    lines: dict[tuple[str, str], list[tuple[float, float | None, float | None]]] = {}
    for c in cs:
        for name, r in c.get("methods", {}).items():
            if "seconds" in r:
                key = (c["name"].split("@")[0], name)
                lines.setdefault(key, []).append(
                    (c.get(param), r["seconds"], r.get("peak_memory_bytes"))
                )
    for (base, name), pts in sorted(lines.items()):
        pts.sort()
        a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{base} {name}")
        mem = [(p[0], p[2] / MIB) for p in pts if p[2]]
        if mem:
            a2.plot(*zip(*mem), marker="o")
    for ax, ylab in ((a1, "seconds"), (a2, "peak MiB")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("batch size" if param == "N" else "entries")
        ax.set_ylabel(ylab)
    if lines:
        a1.legend(fontsize=6)
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plots(results: dict[str, Any], out: Path, stem: str) -> list[Path]:
    made = [
        plot_main(results, out / f"{stem}_main.png"),
        plot_sweep(results, "batch", "N", out / f"{stem}_batch.png"),
        plot_sweep(results, "entries", "P", out / f"{stem}_entries.png"),
    ]
    return [p for p in made if p is not None]


# ---------------------------------------------------------------------- outputs
def cell_table(c: dict[str, Any]) -> str:
    rows = []
    for name, r in c.get("methods", {}).items():
        note = r.get("skipped") or r.get("error") or r.get("check_error") or ""
        if "seconds" in r and r.get("kind") != "train" and not r.get("valid"):
            note = "INVALID " + str(note)
        rows.append(
            [
                name,
                secs(r.get("seconds")),
                steps(r),
                secs(r.get("first_call_seconds")),
                mib(r.get("peak_memory_bytes")),
                "-" if r.get("checked") is None else f"{r['checked']:.1e}",
                str(note)[:100],
            ]
        )
    return table(["method", "s", "x step", "first call s", "peak memory", "checked", "note"], rows)


def render_all(results: dict[str, Any], images: list[Path] = ()) -> str:
    """Every family's table and every cell's methods (``<stem>.md``, the CLI's report)."""
    out = ["# Benchmark grid", "", runs_table(results), ""]
    out += [f"![{p.stem}]({p.name})" for p in images] + [""]
    present = {c.get("family") for c in results["cells"]}
    for fam, section in SECTIONS.items():
        if fam in present:
            out += [f"## {fam}", "", section(results), ""]
    for c in results["cells"]:
        if c.get("methods"):
            head = (
                f"### {c['family']}: {c['name']} (N={c.get('N')}, O={c.get('O')}, P={c.get('P')})"
            )
            out += [head, "", cell_table(c), ""]
    return "\n".join(out)


def write_outputs(results: dict[str, Any], out: Path, stem: str) -> int:
    """``<stem>.md`` and the plots in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    images = plots(results, out, stem)
    (out / f"{stem}.md").write_text(render_all(results, images))
    print(f"wrote {out / (stem + '.md')}" + "".join(f", {p.name}" for p in images))
    return 0


def report_text(results: dict[str, Any], images: list[Path] = ()) -> str:
    """The text of the report's ``report.md`` (docs/report/report.md is this, whole)."""
    return render_all(results, images).replace(
        "# Benchmark grid", "# multiscale_jac benchmark report", 1
    )


def write_report(results: dict[str, Any], out: Path) -> None:
    """``multiscale-jac bench``'s report: ``report.md``, ``results.json`` and the plots."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    images = plots(results, out, "grid")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "report.md").write_text(report_text(results, images))
    print(f"wrote {out / 'report.md'} and {out / 'results.json'}")


# ---------------------------------------------------------------------- published pages
def pages(root: Path = ROOT) -> list[Path]:
    return [p for pattern in PAGES for p in sorted(root.glob(pattern))]


def _render_block(name: str, path: str, root: Path, cache: dict[str, Any]) -> str:
    if path not in cache:
        cache[path] = json.loads((root / path).read_text())
    return FIGURES[name](cache[path]).rstrip("\n") + "\n"


def stale_blocks(root: Path = ROOT) -> list[str]:
    """``page: block`` for every block whose text differs from what its results file renders
    (or names a figure or file that does not exist)."""
    cache: dict[str, Any] = {}
    bad = []
    for page in pages(root):
        for m in BLOCK.finditer(page.read_text()):
            name, path = m["name"], m["path"]
            where = f"{page.relative_to(root)}: {name} from {path}"
            if name not in FIGURES or not (root / path).exists():
                bad.append(where + " (no such figure or results file)")
                continue
            try:
                rendered = _render_block(name, path, root, cache)
            except (KeyError, TypeError, ValueError, StopIteration) as err:  # another file's shape
                bad.append(where + f" (cannot render it from that file: {err!r})")
                continue
            if m["body"] != rendered:
                bad.append(where)
    return bad


def update_pages(root: Path = ROOT) -> list[Path]:
    """Rewrite every block from its results file; returns the pages changed."""
    cache: dict[str, Any] = {}
    changed = []
    for page in pages(root):
        text = page.read_text()
        new = BLOCK.sub(
            lambda m: m[1] + _render_block(m["name"], m["path"], root, cache) + m[5], text
        )
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ci-run"]:
        print(json.dumps(ci_run(*sys.argv[2:4]), indent=1))
        sys.exit(0)
    if "--check" in sys.argv:
        stale = stale_blocks()
        print("\n".join(stale) or "every block matches its results file")
        sys.exit(1 if stale else 0)
    print("\n".join(str(p) for p in update_pages()) or "no block changed")
