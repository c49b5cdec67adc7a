"""Every published figure of the benchmark grid, rendered from its results files (standard
library only at module level; matplotlib inside the plots).

From ``benchmarks/results/grid.json`` (``runs``, ``cells`` naming their ``family`` and ``run``):
``<stem>.md`` and plots (:func:`write_outputs`), ``multiscale-jac bench``'s report
(:func:`write_report`), and the docs' blocks between ``<!-- figures: NAME from PATH -->`` and
``<!-- /figures -->`` (:data:`FIGURES`; :func:`stale_blocks`: the published figures' test).
``python benchmarks/render.py [--check | --outputs FILE]`` rewrites (checks) every block.
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
PAGES = ("README.md", "docs/**/*.md")
_OPEN = r"(<!-- figures: (?P<name>[\w-]+) from (?P<path>\S+) -->\n)"
BLOCK = re.compile(_OPEN + r"(?P<body>.*?)(<!-- /figures -->)", re.S)
MIB = 2**20
Results = dict[str, Any]


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


def table(headers: Iterable[str], rows: Iterable[Iterable[Any]]) -> str:
    """A markdown table; columns right-aligned where every value is a number."""
    headers, rows = list(headers), [["-" if c is None else str(c) for c in r] for r in rows]
    numeric = [all(re.fullmatch(r"-|[\d.,]+x?", r[i]) for r in rows) for i in range(len(headers))]
    sep = "|" + "|".join("--:" if rows and n else "---" for n in numeric) + "|"
    lines = ["| " + " | ".join(r) + " |" for r in [headers, *rows]]
    return "\n".join([lines[0], sep, *lines[1:]])


def bullets(items: dict[str, str], width: int = 300) -> str:
    """``- **key**: value`` lines, each value's first line (notes below a table, not in it)."""
    short = {k: " ".join(v.strip().split("\n")[0].split())[:width] for k, v in items.items()}
    return "\n".join(f"- **{k}**: {v}" for k, v in short.items() if v)


def cells(results: Results, family: str) -> list[dict[str, Any]]:
    return [c for c in results["cells"] if c.get("family") == family]


def cell(results: Results, family: str, name: str) -> dict[str, Any]:
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


def measured(family: str, fn: Callable[..., str]) -> Callable[..., str]:
    """``fn``'s table, or a line saying that no cell of ``family`` has been measured yet."""

    def table_or_line(results: Results, *args: Any) -> str:
        if cells(results, family):
            return fn(results, *args)
        return f"No cell of this grid measured yet (`bench_peers.py --grid {family}`)."

    return table_or_line


# ---------------------------------------------------------------------- the family tables
def main_table(
    results: Results, family: str = "main", notes: bool = False, routes: bool = True
) -> str:
    """Per cell: auto and the best other method in training steps; ``routes``: also the best
    forced route; ``notes``: why auto is slower, where it is, as a list under the table."""
    head = ["cell", "auto x step", "best other", "other x step", "auto / best other"]
    rows, why = [], {}
    for c in cells(results, family):
        auto, other = method(c, "library_auto"), method(c, c.get("best_other"))
        row = [c["name"], steps(auto), c.get("best_other"), steps(other)]
        row.append(num(c.get("library_over_best_other")))
        if routes:
            row += [route(c.get("best_route")), num(c.get("auto_over_best_route"))]
        rows.append(row)
        why[c["name"]] = str(c.get("error") or c.get("auto_problem") or c.get("note") or "")
    head += ["best route", "auto / best route"] if routes else []
    out = table(head, rows)
    return out + "\n\nNotes:\n\n" + bullets(why) if notes and any(why.values()) else out


def choice_table(results: Results) -> str:
    """auto (the cost model's choice: nothing timed) against the fastest forced route per
    cell: the choice family's cell where one was measured, else the main family's."""
    chosen = {c["name"]: c for c in cells(results, "main")}
    chosen.update({c["name"]: c for c in cells(results, "choice")})
    rows = []
    for c in chosen.values():
        row = [
            c["name"],
            secs(method(c, "library_auto").get("seconds")),
            route(c.get("best_route")),
        ]
        row += [secs(c.get("best_route_seconds")), num(c.get("auto_over_best_route")), c.get("run")]
        rows.append(row)
    ratios = [c["auto_over_best_route"] for c in chosen.values() if c.get("auto_over_best_route")]
    head = ["cell", "auto s", "fastest forced route", "route s", "auto / route", "run"]
    fams = " and ".join(f"`{f}`" for f in sorted({c["family"] for c in chosen.values()}))
    summary = (
        f"{len(ratios)} cells of the {fams} grids; auto (the estimate) / the fastest forced "
        f"route: median {num(median(ratios))}, largest {num(max(ratios))}."
        if ratios
        else "No cells measured."
    )
    return table(head, rows) + "\n\n" + summary


def estimate_error_table(results: Results) -> str:
    """The cost model's error: per cell of the choice grid, every forced route's estimated
    seconds (noted by the engine) against its measured seconds."""
    rows, ratios = [], []
    for c in cells(results, "choice"):
        priced = [
            (route(name), float(r["library"]["estimate_s"]), float(r["seconds"]))
            for name, r in c.get("methods", {}).items()
            if name.startswith("library_") and name != "library_auto" and r.get("seconds")
            if (r.get("library") or {}).get("estimate_s")
        ]
        if not priced:
            continue
        off = [t / e for _, e, t in priced]
        ratios += off
        pick, fastest = min(priced, key=lambda p: p[1]), min(priced, key=lambda p: p[2])
        row = [c["name"], len(priced), num(median(off)), f"{num(min(off))}-{num(max(off))}"]
        rows.append([*row, pick[0], fastest[0], num(pick[2] / fastest[2])])
    head = ["cell", "routes", "measured / estimated: median", "range", "cheapest estimated"]
    summary = (
        f"{len(ratios)} routes in {len(rows)} cells; measured / estimated seconds: median "
        f"{num(median(ratios))}, from {num(min(ratios))} to {num(max(ratios))}."
        if ratios
        else "No priced routes measured."
    )
    return table([*head, "fastest measured", "its time / fastest"], rows) + "\n\n" + summary


def methods_table(results: Results, family: str, param: str, workload: str | None = None) -> str:
    """Per cell and method: seconds, training steps, peak memory (the batch and entries
    sweeps; ``param``: the column of the swept parameter, ``n`` or ``k``)."""
    rows = []
    for c in cells(results, family):
        if workload and c.get("workload") != workload:
            continue
        for name, r in c.get("methods", {}).items():
            row = [c["name"].split("@")[0], c.get("N") if param == "n" else c.get("P"), name]
            if "seconds" in r:
                peak = r.get("peak_memory_bytes")
                row += [secs(r["seconds"]), steps(r), num(peak and peak / MIB)]
                rows.append([*row, num(r.get("memory_ratio_to_train_step"))])
            elif name == "autograd_jacobian":
                rows.append([*row, why_not(r), "-", "-", "-"])
    head = ["cell", param.upper() if param == "n" else "entries", "method", "s", "x step"]
    return table([*head, "peak MiB", "x step memory"], rows)


def dense_table(results: Results) -> str:
    rows = []
    for c in cells(results, "dense"):
        un, sl = method(c, "library_auto"), method(c, "library_sliced")
        ratio = sl["seconds"] / un["seconds"] if "seconds" in un and "seconds" in sl else None
        diff = sl.get("float32_rel_diff")
        row = [c["name"], c.get("O"), c.get("P"), secs(un.get("seconds")), secs(sl.get("seconds"))]
        rows.append([*row, num(ratio), "-" if diff is None else f"{diff:.1e}"])
    head = ["cell", "outputs a sample", "entries", "unsliced s", "sliced s", "sliced / unsliced"]
    return table([*head, "rel diff"], rows)


def laplace_torch_table(results: Results) -> str:
    rows = []
    for c in cells(results, "laplace_torch"):
        for name in ("library_auto", "laplace_torch"):
            r = method(c, name)
            mem = mib(r.get("peak_memory_bytes"))
            mem = mem if mem != "-" else why_not(r)
            rows.append([c["name"], name, secs(r.get("seconds")), mem, r.get("run", c.get("run"))])
    return table(["cell", "method", "s", "peak memory", "run"], rows)


def first_call_table(results: Results) -> str:
    """Two tables (time, then memory) and the cells over a target."""
    time_rows, memory_rows, over = [], [], {}
    for c in cells(results, "first_call"):
        lib, user, ratio = c.get("library", {}), c.get("user", {}), c.get("ratios", {})
        time_rows.append(
            [c["name"], secs(lib.get("first_seconds")), secs(user.get("first_seconds"))]
            + [num(ratio.get(k)) for k in ("first", "second", "warm", "loaded")]
        )
        row = [c["name"], num(ratio.get("rss")), mib(c.get("budget", {}).get("peak_memory_bytes"))]
        row += [mib(c.get("overhead", {}).get("peak_memory_bytes")), num(ratio.get("budget"))]
        memory_rows.append(row)
        over[c["name"]] = ", ".join(c.get("over_target", []))
    head = ["cell", "auto first s", "user first s", "first / user first", "second / warm"]
    head += ["warm / user warm", "loaded / allowance"]
    memory = ["cell", "RSS / tune=False", "budgeted RSS", "overhead"]
    memory.append("(budgeted - overhead) / budget")
    missed = "; ".join(f"{k} ({v})" for k, v in over.items() if v) or "none"
    return "\n\n".join(
        [table(head, time_rows), table(memory, memory_rows), f"Over a target: {missed}."]
    )


def runs_page(results: Results) -> str:
    """Which run measured which cells: date, commit, machine load, grids; the machine is a
    sentence where every run had the same one, each run's source a list item under the table."""
    used: dict[int, set[str]] = {}
    for c in results["cells"]:  # a method kept from an earlier run names that run
        for run in {c.get("run")} | {r.get("run") for r in c.get("methods", {}).values()}:
            if run is not None:
                used.setdefault(run, set()).add(c.get("family"))
    facts = []
    for r in (r for r in results["runs"] if r["id"] in used):
        env = r["env"]
        load = [env.get(f"load_average_at_{k}") for k in ("start", "end")]
        commit = (env.get("git_commit") or "?")[:7] + " (dirty)" * bool(env.get("git_dirty"))
        # a load average over the threads: other work shared the cores, times are noisy
        peak, threads = max((x[0] for x in load if x), default=0.0), env.get("threads") or 1
        busy = f"; loaded machine (load {peak:.1f} on {threads} threads): times noisy"
        busy = busy if peak > threads else ""
        facts.append(
            {
                "run": str(r["id"]),
                "date": env.get("date_utc", "?")[:10],
                "commit": commit,
                "machine": f"{env.get('device')}, {env.get('threads')} threads, "
                f"torch {env.get('torch')}",
                "load start / end": " / ".join("-" if not x else f"{x[0]:.1f}" for x in load),
                "grids": ", ".join(sorted(used[r["id"]])),
                "size": "quick" if r["config"].get("quick") else "full",
                "source": r.get("source", "this grid") + busy,
            }
        )
    machines = sorted({f["machine"] for f in facts})
    keys = ["run", "date", "commit"] + ["machine"] * (len(machines) > 1)
    keys += ["load start / end", "grids", "size"]
    out = [table(keys, [[f[k] for k in keys] for f in facts])]
    if len(machines) == 1:
        out.append(f"Every run: {machines[0]}.")
    out.append("\n".join(f"- Run {f['run']}: {f['source'].rstrip('.')}." for f in facts))
    return "\n\n".join(out)


#: how the pages name the benchmark grid's models
MODELS = {
    "vgg11_bn_q": "VGG-11-BN at quarter width",
    "resnet8": "ResNet-8",
    "cnn3": "the 3-conv CNN",
    "cnn8": "the 8-layer CNN",
}


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def guide_figures(results: Results, workload: str, models: Iterable[str], what: str) -> str:
    """A guide's sentence: ``what`` in training steps per model (the main grid's cell, an idle
    run) and its peak memory against a training step's (the batch grid's cell at the same batch
    size), each with its run."""
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


def ci_times(results: Results) -> str:
    """``ci.json``: the suite's and the fast tier's times in the CI runs it holds (``.ci/run``
    prints a run's record, ``--ci-run``; the runs kept are clean clones on 2 cores)."""
    runs, last = results["runs"], results["runs"][-1]

    def span(xs: list[float], fmt: str) -> str:
        lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
        return lo if lo == hi else f"{lo} to {hi}"

    suite = span([r["suite"]["seconds"] / 60 for r in runs], "{:.1f}")
    fast = span([r["fast"]["seconds"] for r in runs], "{:.0f}")
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


def rows_table(results: Results, grid: str) -> str:
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


#: the published blocks: name -> markdown from the results
FIGURES: dict[str, Callable[[Results], str]] = {
    "runs": runs_page,
    "main": lambda r: main_table(r, routes=False),
    "choice": choice_table,
    "choice-error": estimate_error_table,
    "batch-fisher": lambda r: measured("batch", methods_table)(r, "batch", "n", "fisher"),
    "batch-jacnorm": lambda r: measured("batch", methods_table)(r, "batch", "n", "jacnorm"),
    "dense": measured("dense", dense_table),
    "laplace-torch": measured("laplace_torch", laplace_torch_table),
    "first-call": measured("first_call", first_call_table),
    "guide-fisher": lambda r: guide_figures(
        r, "fisher", ("vgg11_bn_q", "resnet8"), "`diag_fisher`"
    ),
    "guide-jacnorm": lambda r: guide_figures(
        r, "jacnorm", ("cnn3", "cnn8"), "the value and its gradient"
    ),
    "ci": ci_times,
    "rows-speed": lambda r: rows_table(r, "speed"),
    "rows-loop": lambda r: rows_table(r, "loop"),
}
#: the report's section per named grid
SECTIONS: dict[str, Callable[[Results], str]] = {
    "main": lambda r: main_table(r, "main", notes=True),
    "choice": lambda r: choice_table(r) + "\n\n" + estimate_error_table(r),
    "batch": lambda r: methods_table(r, "batch", "n"),
    "entries": lambda r: methods_table(r, "entries", "k"),
    "dense": dense_table,
    "laplace_torch": laplace_torch_table,
    "first_call": first_call_table,
}


# ---------------------------------------------------------------------- plots
#: the plots' width in inches: the docs' content column (about 690 pixels at a 1400-pixel
#: window) shows them at about their size, so a point of text is about a point on the page
WIDTH, DPI = 7.0, 200


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "legend.fontsize": 8.5})
    return plt


def plot_main(results: Results, path: Path) -> Path | None:
    """auto / the best other method per main cell: a bar a cell, green where auto is faster."""
    plt, cs = _plt(), [c for c in cells(results, "main") if c.get("library_over_best_other")]
    if plt is None or not cs:
        return None
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(WIDTH, max(2.5, 1.2 + 0.2 * len(cs))), layout="constrained")
    ratios = [c["library_over_best_other"] for c in cs]
    colors = ["tab:green" if v <= 1 else "tab:red" for v in ratios]
    bars = ax.barh(range(len(cs)), ratios, color=colors, height=0.7)
    ax.bar_label(bars, [f"{v:.2f}" for v in ratios], padding=2, fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1, zorder=0)
    ax.set_xscale("log")
    ticks = [t for t in (0.05, 0.1, 0.2, 0.5, 1, 2, 5) if min(ratios) / 2 < t < max(ratios) * 2]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlim(min(ratios) / 1.5, max(max(ratios), 1) * 1.6)
    ax.set_yticks(range(len(cs)), [c["name"] for c in cs], fontsize=9)
    ax.set_ylim(len(cs) - 0.5, -0.5)
    ax.set_xlabel("auto's time / the fastest other method's (log scale; < 1: auto is faster)")
    faster, slower = ("auto faster (ratio <= 1)", "tab:green"), ("auto slower (> 1)", "tab:red")
    handles = [Patch(color=c, label=t) for t, c in (faster, slower)]
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1), ncol=2, frameon=False)
    return _save(fig, plt, path)


def plot_sweep(results: Results, family: str, param: str, path: Path) -> Path | None:
    """Seconds and peak memory against the swept parameter, a line per cell and method that
    was measured at two values or more (a single point answers nothing: no plot then)."""
    lines: dict[str, list[tuple[float, float, float | None]]] = {}
    for c in cells(results, family):
        for name, r in c.get("methods", {}).items():
            if "seconds" in r:
                pts = lines.setdefault(f"{c['name'].split('@')[0]} {name}", [])
                pts.append((c.get(param), r["seconds"], r.get("peak_memory_bytes")))
    lines = {k: sorted(v) for k, v in sorted(lines.items()) if len({p[0] for p in v}) > 1}
    plt = _plt()
    if plt is None or not lines:
        return None
    size = (WIDTH, 3.2 + 0.18 * len(lines))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=size, layout="constrained")
    # a colour per method, a marker and a dash per cell: no two lines look alike
    names = sorted({k.split(" ", 1)[1] for k in lines}), sorted({k.split(" ")[0] for k in lines})
    for label, pts in lines.items():
        cell, name = label.split(" ", 1)
        k = names[1].index(cell)
        look = {"color": f"C{names[0].index(name) % 10}", "marker": "osD^"[k % 4],
                "linestyle": ("-", "--", ":", "-.")[k % 4]}  # fmt: skip
        a1.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **look)
        mem = [(p[0], p[2] / MIB) for p in pts if p[2]]
        if mem:
            a2.plot(*zip(*mem), **look)
    xs = sorted({p[0] for pts in lines.values() for p in pts})
    for ax, ylab in ((a1, "seconds"), (a2, "peak MiB")):
        ax.set(xscale="log", yscale="log", ylabel=ylab)
        ax.set_xticks(xs, [str(x) for x in xs], minor=False)
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        ax.set_xlabel("batch size" if param == "N" else "entries")
    fig.legend(loc="outside lower center", ncol=2, frameon=False)
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plots(results: Results, out: Path, stem: str) -> list[Path]:
    for old in out.glob(f"{stem}_*.png"):
        old.unlink()
    made = [
        plot_main(results, out / f"{stem}_main.png"),
        plot_sweep(results, "batch", "N", out / f"{stem}_batch.png"),
        plot_sweep(results, "entries", "P", out / f"{stem}_entries.png"),
    ]
    return [p for p in made if p is not None]


# ---------------------------------------------------------------------- outputs
def cell_table(c: dict[str, Any]) -> str:
    """A cell's every method; each method's note (why it did not run) in a list below."""
    rows, notes = [], {}
    for name, r in c.get("methods", {}).items():
        note = str(r.get("skipped") or r.get("error") or r.get("check_error") or "")
        if "seconds" in r and r.get("kind") != "train" and not r.get("valid"):
            note = "INVALID " + note
        notes[name] = note
        checked = "-" if r.get("checked") is None else f"{r['checked']:.1e}"
        row = [name, secs(r.get("seconds")), steps(r), secs(r.get("first_call_seconds"))]
        rows.append([*row, mib(r.get("peak_memory_bytes")), checked])
    out = table(["method", "s", "x step", "first call s", "peak memory", "checked"], rows)
    return out + ("\n\n" + bullets(notes, 160) if any(notes.values()) else "")


def render_all(results: Results, images: Iterable[Path] = ()) -> str:
    """The runs, a section per named grid (its plot, its table) and every cell's methods, a
    collapsed block per named grid (``<stem>.md``, the CLI's report)."""
    out = ["# Benchmark grid", "", runs_page(results), ""]
    present, images = [c.get("family") for c in results["cells"]], list(images)
    for fam, section in SECTIONS.items():
        if fam in present:
            pics = [f"![{p.stem}]({p.name})" for p in images if p.stem.endswith("_" + fam)]
            out += [f"## {fam}", "", *pics, "", section(results), ""]
    out += ["## Every method of every cell", ""]
    for fam in dict.fromkeys(present):
        cs = [c for c in cells(results, fam) if c.get("methods")]
        if not cs:
            continue
        summary = f"<summary>{fam}: {len(cs)} cell{'s' * (len(cs) > 1)}</summary>"
        out += ["<details markdown>", summary, ""]
        for c in cs:
            size = ", ".join(f"{k}={c.get(k)}" for k in ("N", "O", "P"))
            out += [f"**{c['name']}** ({size})", "", cell_table(c), ""]
        out += ["</details>", ""]
    return "\n".join(out)


def write_outputs(results: Results, out: Path, stem: str) -> int:
    """``<stem>.md`` and the plots in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    images = plots(results, out, stem)
    (out / f"{stem}.md").write_text(render_all(results, images))
    print(f"wrote {out / (stem + '.md')}" + "".join(f", {p.name}" for p in images))
    return 0


def report_text(results: Results, images: Iterable[Path] = ()) -> str:
    """The text of the report's ``report.md`` (docs/report/report.md is this, whole)."""
    text = render_all(results, images)
    return text.replace("# Benchmark grid", "# multiscale_jac benchmark report", 1)


def write_report(results: Results, out: Path) -> None:
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
    if sys.argv[1:2] == ["--outputs"]:
        path = Path(sys.argv[2])
        sys.exit(write_outputs(json.loads(path.read_text()), path.parent, path.stem))
    if "--check" in sys.argv:
        stale = stale_blocks()
        print("\n".join(stale) or "every block matches its results file")
        sys.exit(1 if stale else 0)
    print("\n".join(str(p) for p in update_pages()) or "no block changed")
