"""Benchmark: ``SubnetLaplace.fit`` time and peak memory vs subset size and batch size.

Workload: a small CIFAR-sized CNN (defined here; float32, eval mode, no BatchNorm):
conv3x3(3->16)+ReLU+maxpool2, conv3x3(16->32)+ReLU+maxpool2, conv3x3(32->32)+ReLU, Linear(2048,
10); 34,826 parameters. One batch of ``B`` random ``(3, 32, 32)`` inputs with random labels out
of 10 classes (fixed seeds), ``(B, 10)`` logits. The subset is ``k`` parameter entries chosen by
``ParamSubset.largest_magnitude`` (default) or ``ParamSubset.random`` (``--selection``).

Methods (cells)
    train_step     the reference: forward, CrossEntropy (sum), backward, SGD step, zero_grad on
                   a train-mode copy of the model (one cell per B; its own peak memory)
    library        ``multiscale_jac.SubnetLaplace(model, "classification", subset).fit(
                   [(x, y)], progress=False)``: the ``k x k`` GGN
    laplace_torch  laplace-torch's ``Laplace(model, "classification",
                   subset_of_weights="subnetwork", hessian_structure="full",
                   subnetwork_indices=subset.flat_indices())`` ``.fit(DataLoader)``, when
                   ``import laplace`` works in this interpreter; otherwise recorded as not
                   available, with the figure the issue author measured (10.5 GB at B=32, k=100)

Every cell runs in a fresh worker process (``_common.run_worker``). The worker builds the model,
data and subset, runs the method once on two samples (warm-up), then once on the batch under
``_common.measure_peak_memory`` (peak RSS rise over the post-setup baseline), then
``--repeats`` more times when that took under ``--warm-limit`` s (``seconds``: their median),
then a warm-up and 5 timed training steps in the same process (``ratio_to_train_step``: the ratio
of the medians). ``library`` and ``laplace_torch`` are also checked against a loop reference
(``autograd.grad`` per sample and class, ``J^T (diag p - p p^T) J`` summed) on two samples.

Acceptance: at B=32 with k=100 entries, the ``library`` fit's peak memory must be at most about
200 MiB.

Results: ``benchmarks/results/bench_laplace.json`` (``bench_laplace_quick.json`` with
``--quick``) and a markdown table on stdout.

Dense outputs (``--dense``): a per-pixel classifier (conv3x3(3->16)+ReLU, conv3x3(16->16)+ReLU,
conv1x1(16->C); float32, eval) on four ``S x S`` images, ``k`` entries by magnitude: the fit with
a ``memory_budget`` that would cut each image's Jacobian rows into about 20 slices against the
unsliced fit (``memory_budget=None``), timed in one process, interleaved (median of
``--repeats``; ``ratio`` sliced / unsliced). Defaults: S=48, C=3, k=100 (the workload of the
report that found the fit re-running the model per slice); ``--dense-sizes 32 64 96
--dense-classes 21 --dense-k 1000`` gives the exact-fit times ``docs/laplace.md`` extrapolates.

``DiagLaplace`` (``--diag``): over every weight of bench_fisher's VGG-11-BN/4 at N=128, empirical
Fisher and exact GGN, beside ``diag_fisher``, as ratios to a training step timed in the same
process (before and after); ``bench_laplace_diag.json``.

Usage::

    python benchmarks/bench_laplace.py                  # B in 8 32 128, k in 10 100 1000
    python benchmarks/bench_laplace.py --quick          # B = 8, k in 10 100 (seconds)
    python benchmarks/bench_laplace.py --sizes 32 --subsets 100 --selection random
    python benchmarks/bench_laplace.py --dense           # sliced vs unsliced dense fit
    python benchmarks/bench_laplace.py --diag            # DiagLaplace against a training step
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    MEMORY_CAVEAT_CPU,
    env_stamp,
    fmt_bytes,
    fmt_seconds,
    markdown_table,
    run_worker,
    timed_call,
    timer_median,
    write_json,
)
from bench_fisher import ALL, WARM_SAMPLES, guarded, log, measure_cell, rel_diff
from torch import Tensor, nn

SIZES = (8, 32, 128)
SUBSETS = (10, 100, 1000)
QUICK_SIZES = (8,)
QUICK_SUBSETS = (10, 100)
METHODS = ("train_step", "library", "laplace_torch")
SELECTIONS = ("magnitude", "random")
NUM_CLASSES = 10
SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results"
ACCEPT_B, ACCEPT_K, ACCEPT_BYTES = 32, 100, 200 * 2**20
#: laplace-torch SubnetLaplace.fit at B=32, k=100, as measured by the issue author (not here)
ISSUE_FIGURE = {
    "B": 32,
    "k": 100,
    "peak_memory_bytes": int(10.5e9),
    "source": "measured by the issue author (laplace-torch SubnetLaplace, full-network "
    "Jacobians); not reproduced here",
}


class Skip(Exception):
    """A method that cannot run here (laplace-torch not importable, or failing)."""


# ---------------------------------------------------------------------- workload
class SmallCNN(nn.Module):
    """conv(3->16)+ReLU+pool, conv(16->32)+ReLU+pool, conv(32->32)+ReLU, Linear(32*8*8, 10)."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
        )
        self.classifier = nn.Linear(32 * 8 * 8, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


class Workload:
    """The model (eval mode), ``B`` inputs and labels, a subset of ``k`` entries (``k=0``: no
    subset) and a training step on a copy of the model."""

    def __init__(self, b: int, k: int, selection: str, seed: int) -> None:
        import multiscale_jac as mj

        torch.manual_seed(seed)
        self.model = SmallCNN().eval()
        g = torch.Generator().manual_seed(seed + 1)
        self.x = torch.randn(b, 3, 32, 32, generator=g)
        self.y = torch.randint(0, NUM_CLASSES, (b,), generator=g)
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.subset = None
        if k:
            if selection == "magnitude":
                self.subset = mj.ParamSubset.largest_magnitude(self.model, k)
            elif selection == "random":
                gen = torch.Generator().manual_seed(seed + 2)
                self.subset = mj.ParamSubset.random(self.model, k, generator=gen)
            else:
                raise ValueError(f"unknown selection {selection!r}")
        self.description = (
            f"SmallCNN float32 eval mode, {self.numel} parameters, batch {b} of (3, 32, 32), "
            f"{NUM_CLASSES} classes" + ("" if not k else f", {k} entries by {selection}")
        )
        self._train: nn.Module | None = None
        self._opt: torch.optim.Optimizer | None = None

    def train_step(self, samples: slice = ALL) -> None:
        """Forward, CrossEntropy (sum), backward, SGD step, zero_grad (train-mode copy)."""
        if self._train is None or self._opt is None:
            self._train = copy.deepcopy(self.model).train()
            self._opt = torch.optim.SGD(self._train.parameters(), lr=1e-3)
        out = self._train(self.x[samples])
        F.cross_entropy(out, self.y[samples], reduction="sum").backward()
        self._opt.step()
        self._opt.zero_grad(set_to_none=True)


def reference_ggn(wl: Workload, samples: slice) -> Tensor:
    """``sum_i J_i^T (diag p_i - p_i p_i^T) J_i`` on the subset, one ``autograd.grad`` per
    sample and class."""
    assert wl.subset is not None
    idx = wl.subset.flat_indices()
    params = list(wl.model.parameters())
    k = idx.numel()
    h = torch.zeros(k, k, dtype=torch.float64)
    for xi in wl.x[samples]:
        out = wl.model(xi.unsqueeze(0))[0]
        rows = []
        for c in range(out.shape[0]):
            grads = torch.autograd.grad(out[c], params, retain_graph=True)
            rows.append(torch.cat([g.reshape(-1) for g in grads])[idx])
        jac = torch.stack(rows).double()
        p = torch.softmax(out.detach().double(), dim=0)
        h += jac.T @ (torch.diag(p) - torch.outer(p, p)) @ jac
    return h


# ---------------------------------------------------------------------- methods
def _prepare_library(wl: Workload) -> Callable[[slice], Tensor]:
    import multiscale_jac as mj

    def run(samples: slice) -> Tensor:
        la = mj.SubnetLaplace(wl.model, "classification", wl.subset)
        la.fit([(wl.x[samples], wl.y[samples])], progress=False)
        assert la.H is not None
        return la.H

    return run


def _prepare_laplace_torch(wl: Workload, info: dict[str, Any]) -> Callable[[slice], Tensor]:
    try:
        import laplace
        from laplace import Laplace
    except ImportError as e:
        raise Skip(f"laplace-torch not importable in this interpreter ({e})") from e
    info["laplace_version"] = getattr(laplace, "__version__", None)
    assert wl.subset is not None
    idx = wl.subset.flat_indices()
    from torch.utils.data import DataLoader, TensorDataset

    def run(samples: slice) -> Tensor:
        x, y = wl.x[samples], wl.y[samples]
        la = Laplace(
            wl.model,
            "classification",
            subset_of_weights="subnetwork",
            hessian_structure="full",
            subnetwork_indices=idx,
        )
        la.fit(DataLoader(TensorDataset(x, y), batch_size=x.shape[0]))
        return la.H.detach()

    try:  # a peer that fails on this workload is a skip with its error, not a crash
        run(WARM_SAMPLES)
    except Exception as e:
        raise Skip(f"laplace-torch failed: {type(e).__name__}: {e}"[:500]) from e
    return run


def prepare(wl: Workload, method: str, info: dict[str, Any]) -> Callable[[slice], Any]:
    """The method as a function of a slice of the batch.

    Raises:
        Skip: the method cannot run here.
    """
    if method == "train_step":
        return wl.train_step
    if method == "library":
        return _prepare_library(wl)
    if method == "laplace_torch":
        return _prepare_laplace_torch(wl, info)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


# ---------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> int:
    method, b, k = args.worker[0], int(args.worker[1]), int(args.worker[2])
    if args.threads:
        threads = args.threads or 2
    torch.set_num_threads(threads)
    wl = Workload(b, 0 if method == "train_step" else k, args.selection, args.seed)
    rec: dict[str, Any] = {"description": wl.description, "params": wl.numel}
    info: dict[str, Any] = {}
    try:
        run = prepare(wl, method, info)
    except Skip as e:
        rec["skipped"] = str(e)
        print(json.dumps(rec))
        return 0
    train = None if method == "train_step" else wl.train_step
    rec.update(measure_cell(run, train, repeats=args.repeats, warm_limit_s=args.warm_limit))
    if method != "train_step":
        got = run(WARM_SAMPLES)
        rec["max_abs_diff_vs_loop"], rec["rel_diff_vs_loop"] = rel_diff(
            got, reference_ggn(wl, WARM_SAMPLES)
        )
    if info:
        rec["info"] = info
    print(json.dumps(rec))
    return 0


# ---------------------------------------------------------------------- dense outputs
def dense_cell(size: int, classes: int, k: int, repeats: int, slices: int = 20) -> dict[str, Any]:
    """Sliced (``memory_budget`` for about ``slices`` row slices per image) vs unsliced fit."""
    import time

    import multiscale_jac as mj

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, classes, 1),
    ).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, size, size, generator=g)
    y = torch.randint(0, classes, (4, size, size), generator=g)
    subset = mj.ParamSubset.largest_magnitude(model, k)

    def fit(budget: int | None) -> tuple[float, Tensor]:
        la = mj.SubnetLaplace(model, "classification", subset, memory_budget=budget)
        start = time.perf_counter()
        la.fit([(x, y)])
        assert la.H is not None
        return time.perf_counter() - start, la.H

    try:
        fit(1)
        least = 0
    except mj.MemoryBudgetError as err:
        least = err.minimum
    # rows of one slice: its share of the image's rows; about 6 copies of each (ours, engine's)
    budget = least + classes * size * size // slices * 6 * subset.numel * 4
    times: dict[str, list[float]] = {"unsliced": [], "sliced": []}
    fit(None), fit(budget)  # warm-up (plans cached)
    for _ in range(repeats):
        t, h0 = fit(None)
        times["unsliced"].append(t)
        t, h1 = fit(budget)
        times["sliced"].append(t)
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    return {
        "S": size,
        "C": classes,
        "k": k,
        "memory_budget": budget,
        "unsliced_s": med["unsliced"],
        "sliced_s": med["sliced"],
        "ratio": med["sliced"] / med["unsliced"],
        "rel_diff": float((h1 - h0).abs().max() / h0.abs().max()),
    }


# ---------------------------------------------------------------------- DiagLaplace
def diag_main(args: argparse.Namespace) -> int:
    """``DiagLaplace`` over every weight (laplace-torch's ``Laplace(..., subset_of_weights="all",
    hessian_structure="diag")``) against ``diag_fisher`` and a training step, all timed in
    this process on bench_fisher's workload (N=128 by default)."""
    from bench_fisher import Workload

    import multiscale_jac as mj
    from multiscale_jac.laplace import Laplace

    threads = args.threads or 2
    torch.set_num_threads(threads)
    wl = Workload(args.diag_model, args.diag_n, seed=0)
    data = [(wl.x, wl.y)]

    def fit(hessian: str) -> Callable[[], Any]:
        kw = dict(subset_of_weights="all", hessian_structure="diag", hessian=hessian)
        return lambda: Laplace(wl.model, "classification", **kw).fit(data)

    methods: dict[str, Callable[[], Any]] = {
        "train_step": wl.train_step,
        "diag_fisher": lambda: mj.diag_fisher(wl.model, data),
        "DiagLaplace(hessian='empirical').fit": fit("empirical"),
        "DiagLaplace(hessian='ggn').fit": fit("ggn"),
    }
    rows = {}
    for name, fn in [*methods.items(), ("train_step_again", wl.train_step)]:
        timed_call(fn, "cpu")  # warm-up: plans cached, one-time costs paid
        warm_s, _ = timed_call(fn, "cpu")  # a warm call decides how to time it
        rows[name] = timer_median(fn, threads=threads, min_run_time=0.5, warm_s=warm_s)
        log(f"{name}: {rows[name]['seconds']:.3f} s")
    step = (rows["train_step"]["seconds"] + rows.pop("train_step_again")["seconds"]) / 2
    for r in rows.values():
        r["ratio_to_train_step"] = r["seconds"] / step
    print(
        markdown_table(
            ["method", "seconds", "x train step"],
            [
                [m, fmt_seconds(r["seconds"]), f"{r['ratio_to_train_step']:.2f}"]
                for m, r in rows.items()
            ],
        )
    )
    out = Path(args.out) if args.out else DEFAULT_OUT
    rec = {"env": env_stamp("cpu"), "workload": wl.description, "train_step_seconds": step}
    write_json(out / "bench_laplace_diag.json", {**rec, "methods": rows})
    return 0


def dense_main(args: argparse.Namespace) -> int:
    cells = [
        dense_cell(s, args.dense_classes, args.dense_k, args.repeats)
        for s in (args.dense_sizes or [48])
    ]
    rows = [
        [c["S"], c["C"], c["k"], c["memory_budget"], fmt_seconds(c["unsliced_s"]),
         fmt_seconds(c["sliced_s"]), f"{c['ratio']:.2f}", f"{c['rel_diff']:.1e}"]
        for c in cells
    ]  # fmt: skip
    head = ["S", "C", "k", "budget B", "unsliced s", "sliced s", "sliced / unsliced", "rel diff"]
    table = markdown_table(head, rows)
    print(table)
    out = Path(args.out) if args.out else DEFAULT_OUT
    write_json(out / "bench_laplace_dense.json", {"env": env_stamp("cpu"), "cells": cells})
    (out / "bench_laplace_dense.md").write_text(table + "\n")  # docs/laplace.md includes it
    return 0


# ---------------------------------------------------------------------- main
def _summary(rec: dict[str, Any]) -> str:
    if "seconds" not in rec:
        return str(rec.get("skipped") or rec.get("error"))
    return (
        f"{rec['seconds']:.3g} s = {rec['ratio_to_train_step']:.1f} steps, "
        f"peak {fmt_bytes(rec['peak_memory_bytes'])} MiB"
    )


def table(cells: list[dict[str, Any]]) -> str:
    rows = []
    for c in cells:
        note = c.get("skipped") or c.get("error") or ""
        ratio_mem = c.get("memory_ratio_to_train_step")
        diff = c.get("rel_diff_vs_loop")
        rows.append(
            [
                c["method"],
                c["B"],
                "-" if c["k"] is None else c["k"],
                fmt_seconds(c.get("seconds")),
                "-" if "seconds" not in c else f"{c['ratio_to_train_step']:.1f}",
                fmt_bytes(c.get("peak_memory_bytes")),
                "-" if ratio_mem is None else f"{ratio_mem:.2f}",
                "-" if diff is None else f"{diff:.1e}",
                note[:90],
            ]
        )
    return markdown_table(
        [
            "method",
            "B",
            "k",
            "s",
            "x train step",
            "peak MiB",
            "x train-step memory",
            "rel diff vs loop",
            "note",
        ],
        rows,
    )


def acceptance(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The criterion: the library's fit at B=32, k=100 peaks at most ~200 MiB."""
    rec: dict[str, Any] = {
        "criterion": f"library fit at B={ACCEPT_B}, k={ACCEPT_K}: peak memory <= "
        f"{ACCEPT_BYTES / 2**20:.0f} MiB",
        "limit_bytes": ACCEPT_BYTES,
    }
    cell = next(
        (
            c
            for c in cells
            if c["method"] == "library" and c["B"] == ACCEPT_B and c["k"] == ACCEPT_K
        ),
        None,
    )
    if cell is None or cell.get("peak_memory_bytes") is None:
        rec.update(measured_bytes=None, passed=None, note="cell not run")
    else:
        rec.update(
            measured_bytes=cell["peak_memory_bytes"],
            passed=cell["peak_memory_bytes"] <= ACCEPT_BYTES,
        )
    return rec


def main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out) if args.out else DEFAULT_OUT
    out_path = out_dir / ("bench_laplace_quick.json" if args.quick else "bench_laplace.json")
    sizes = sorted(args.sizes or (QUICK_SIZES if args.quick else SIZES))
    subsets = sorted(args.subsets or (QUICK_SUBSETS if args.quick else SUBSETS))
    methods = ["train_step", *(m for m in args.methods if m != "train_step")]
    have_laplace = importlib.util.find_spec("laplace") is not None
    results: dict[str, Any] = {
        "benchmark": "bench_laplace",
        "workload": "SubnetLaplace.fit (k x k GGN, classification) on one batch of B samples",
        "env": env_stamp("cpu"),
        "config": {
            "quick": args.quick,
            "sizes": sizes,
            "subsets": subsets,
            "selection": args.selection,
            "methods": methods,
            "seed": args.seed,
            "repeats": args.repeats,
            "warm_limit_s": args.warm_limit,
            "threads": args.threads or torch.get_num_threads(),
            "laplace_torch_importable": have_laplace,
        },
        "notes": {
            "seconds": "median of --repeats runs after a warm-up, fresh process per cell",
            "ratio_to_train_step": (
                "seconds / median of 5 training steps (after a warm-up) in the same process; "
                "the step: forward, CrossEntropy(sum), backward, SGD, zero_grad on a train-mode "
                "copy"
            ),
            "peak_memory_bytes": MEMORY_CAVEAT_CPU,
            "memory_ratio_to_train_step": (
                "peak_memory_bytes / that of the train_step cell of the same B"
            ),
            "rel_diff_vs_loop": (
                "max |H - H_loop| / max |H_loop| on the first two samples (H_loop: "
                "autograd.grad per sample and class, J^T (diag p - p p^T) J)"
            ),
            "laplace_torch_issue_figure": ISSUE_FIGURE,
        },
        "cells": [],
    }
    cells: list[dict[str, Any]] = results["cells"]
    passthrough = [
        "--seed",
        str(args.seed),
        "--selection",
        args.selection,
        "--repeats",
        str(args.repeats),
        "--warm-limit",
        str(args.warm_limit),
    ]
    if args.threads:
        passthrough += ["--threads", str(args.threads)]
    for b in sizes:
        step_peak = None
        for method in methods:
            for k in [None] if method == "train_step" else subsets:
                cell: dict[str, Any] = {"method": method, "B": b, "k": k}
                log(f"B={b} k={k} / {method} ...")
                if method == "laplace_torch" and not have_laplace:
                    cell["skipped"] = "not available: laplace-torch is not importable here"
                    if (b, k) == (ISSUE_FIGURE["B"], ISSUE_FIGURE["k"]):
                        cell["skipped"] += (
                            f"; issue author measured {ISSUE_FIGURE['peak_memory_bytes'] / 1e9:.1f}"
                            " GB"
                        )
                        cell["reported_by_issue_author"] = ISSUE_FIGURE
                else:
                    rec = run_worker(
                        [str(SCRIPT), "--worker", method, str(b), str(k or 0), *passthrough],
                        timeout_s=args.timeout,
                    )
                    cell.update(rec)
                if method == "train_step":
                    step_peak = cell.get("peak_memory_bytes")
                elif cell.get("peak_memory_bytes") is not None and step_peak:
                    cell["memory_ratio_to_train_step"] = cell["peak_memory_bytes"] / step_peak
                cells.append(cell)
                log(f"  {_summary(cell)}")
                write_json(out_path, results)
    results["acceptance"] = acceptance(cells)
    write_json(out_path, results)
    print(table(cells))
    acc = results["acceptance"]
    if acc["measured_bytes"] is None:
        print(f"\nacceptance ({acc['criterion']}): not measured ({acc['note']})")
    else:
        verdict = "PASS" if acc["passed"] else "FAIL"
        print(
            f"\nacceptance ({acc['criterion']}): {fmt_bytes(acc['measured_bytes'])} MiB, {verdict}"
        )
    print(f"wrote {out_path}")
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="B=8, k in 10 100 (seconds)")
    p.add_argument("--sizes", nargs="*", type=int, help="batch sizes B (default: 8 32 128)")
    p.add_argument("--subsets", nargs="*", type=int, help="subset sizes k (default: 10 100 1000)")
    p.add_argument("--selection", default="magnitude", choices=SELECTIONS)
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    p.add_argument(
        "--warm-limit", type=float, default=30.0, help="no repeats when one run takes longer (s)"
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per worker")
    p.add_argument("--out", help="output folder (default: benchmarks/results)")
    p.add_argument("--dense", action="store_true", help="the dense-output row only")
    p.add_argument("--dense-sizes", nargs="*", type=int, help="image sizes S (default: 48)")
    p.add_argument("--dense-classes", type=int, default=3)
    p.add_argument("--dense-k", type=int, default=100)
    p.add_argument("--diag", action="store_true", help="the DiagLaplace row only")
    p.add_argument("--diag-model", default="vgg11_bn_q", help="bench_fisher's model (--diag)")
    p.add_argument("--diag-n", type=int, default=128, help="samples (--diag)")
    p.add_argument("--worker", nargs=3, metavar=("METHOD", "B", "K"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if args.worker:
        sys.exit(guarded(worker, args))
    if args.dense:
        sys.exit(dense_main(args))
    if args.diag:
        sys.exit(diag_main(args))
    sys.exit(main(args))
