"""Benchmark: Jacobians w.r.t. a few single weight entries (subnetwork Laplace).

Workloads
    a          The multi-scale ConvBlock as users write it: ``ConvBlock(in_ch=32, out_ch=8)``,
               levels 24x24 and 14x14, batch 16, O=3104, k=500 entries (167/167/166 random flat
               indices of the three conv weights; the same workload as ``bench_jacobian``).
    b-k{K}-o{O}  ``FPNLike``: an FPN-style network with ~1M parameters (laterals, top-down
               pathway, an extra stride-2 level, a 4-conv head shared over the levels, pooled to
               a linear classifier with O outputs), batch 16, K random entries spread over all
               parameters (in proportion to tensor size).

Methods
    full_slice    ``vmap(jacrev)`` w.r.t. every parameter, then the selected columns (what
                  laplace-torch's subnetwork Laplace does).
    jacrev_slice  ``vmap(jacrev)`` w.r.t. the tensors that hold selected entries, then the columns.
    fwd_onehot    forward mode over one-hot tangents of the selected entries, chunked
                  (``per_sample_jacobian(mode="fwd", entries="generic")``).
    auto          ``per_sample_jacobian`` with its defaults (what it picked is recorded).

Every (workload, method) runs in a fresh worker process: it times one training step (median of
5 after a warm-up), warms the method up on one sample, then runs it on the batch once with its
peak RSS rise measured (``_common.measure_peak_memory``), then (if that took under 20 s) twice
more; ``seconds`` is the median. The time is reported as a ratio to that process's training
step. Each result is checked on sample 0 against ``entries="generic", mode="fwd"`` (an
independent path). A method whose result alone would exceed ``--max-gb`` is not run; its
memory is reported as that lower bound. Results: ``benchmarks/results/bench_subset.json``.

Usage::

    python benchmarks/bench_subset.py            # full run (about 15 minutes on 2 CPU cores)
    python benchmarks/bench_subset.py --quick    # small workloads, a few minutes
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    MEMORY_CAVEAT_CPU,
    env_stamp,
    fmt_bytes,
    markdown_table,
    measure_peak_memory,
    median,
    run_worker,
    timed_call,
    write_json,
)
from bench_jacobian import build_workload
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from multiscale_jac import ParamSubset, per_sample_jacobian

METHODS = ("full_slice", "jacrev_slice", "fwd_onehot", "auto")
SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results"


class FPNLike(nn.Module):
    """Laterals (1x1) on two backbone levels, top-down nearest upsampling, an extra stride-2
    level, a 4-conv head (3x3, ReLU) shared over the three pyramid levels, global average
    pooling summed over levels, a linear classifier with ``num_outputs`` outputs."""

    def __init__(self, in_channels=(64, 128), width: int = 128, num_outputs: int = 10) -> None:
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, width, 1) for c in in_channels)
        self.extra = nn.Conv2d(in_channels[-1], width, 3, stride=2, padding=1)
        self.head = nn.Sequential(
            *[m for _ in range(4) for m in (nn.Conv2d(width, width, 3, padding=1), nn.ReLU())]
        )
        self.fc = nn.Linear(width, num_outputs)

    def forward(self, feats: list[Tensor]) -> Tensor:
        lat = [conv(f) for conv, f in zip(self.lateral, feats)]
        top = lat[-1]
        pyramid = [top]
        for lvl in reversed(lat[:-1]):
            top = lvl + F.interpolate(top, size=lvl.shape[-2:], mode="nearest")
            pyramid.insert(0, top)
        pyramid.append(self.extra(feats[-1]))
        pooled = sum(self.head(p).mean(dim=(2, 3)) for p in pyramid)
        return self.fc(pooled)


class Workload:
    def __init__(self, name: str, model: nn.Module, inputs: list[Tensor], subset: ParamSubset):
        self.name, self.model, self.inputs, self.subset = name, model, inputs, subset
        self.description = ""

    def train_step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.model(self.inputs).float().mean().backward()


def build(name: str, *, quick: bool, seed: int) -> Workload:
    if name == "a":
        wl = build_workload("convblock", quick=quick, device=torch.device("cpu"), seed=seed)
        w = Workload("a", wl.model, wl.inputs, wl.subset)
        w.description = wl.description
        return w
    _, k, o = name.split("-")
    k, o = int(k[1:]), int(o[1:])
    torch.manual_seed(seed)
    n, sizes = (4, (8, 4)) if quick else (16, (8, 4))
    model = FPNLike(num_outputs=o).eval()
    g = torch.Generator().manual_seed(seed + 1)
    inputs = [torch.randn(n, c, s, s, generator=g) for c, s in zip((64, 128), sizes)]
    total = sum(p.numel() for p in model.parameters())
    flat = torch.randperm(total, generator=torch.Generator().manual_seed(seed + 2))[:k]
    subset = ParamSubset.from_flat_indices(model, flat)
    w = Workload(name, model, inputs, subset)
    w.description = (
        f"FPNLike(width=128, num_outputs={o}) float32, {total} parameters, batch {n}, levels "
        f"{[tuple(t.shape[1:]) for t in inputs]}; {subset.numel} random entries over "
        f"{len(subset.names)} tensors"
    )
    return w


def workload_names(quick: bool) -> list[str]:
    ks = (100, 1000) if quick else (100, 1000, 10000)
    return ["a"] + [f"b-k{k}-o{o}" for o in (10, 1000) for k in ks]


# ---------------------------------------------------------------------- methods
def _slice_jacobian(wl: Workload, names: list[str], samples: slice) -> Tensor:
    """``vmap(jacrev)`` w.r.t. whole tensors ``names`` for ``samples``; then the columns."""
    params = {n: p.detach() for n, p in wl.model.named_parameters()}
    rest = {n: p for n, p in params.items() if n not in names}

    def f(sel: dict[str, Tensor], *levels: Tensor) -> Tensor:
        out = functional_call(wl.model, {**rest, **sel}, ([lv.unsqueeze(0) for lv in levels],))
        return out.reshape(-1)

    sel = {n: params[n] for n in names}
    levels = [t[samples] for t in wl.inputs]
    full = vmap(jacrev(f), in_dims=(None, *([0] * len(levels))))(sel, *levels)
    cols = []
    for n in wl.subset.names:
        block = full[n].flatten(2)
        idx = wl.subset.indices[n]
        cols.append(block if idx is None else block[:, :, idx])
    return torch.cat(cols, dim=2)


def run_method(wl: Workload, method: str, samples: slice = slice(None)) -> Tensor:
    inputs = [t[samples] for t in wl.inputs]
    if method == "full_slice":
        return _slice_jacobian(wl, [n for n, _ in wl.model.named_parameters()], samples)
    if method == "jacrev_slice":
        return _slice_jacobian(wl, list(wl.subset.names), samples)
    if method == "fwd_onehot":
        return per_sample_jacobian(
            wl.model, inputs, params=wl.subset, mode="fwd", entries="generic"
        ).jacobian
    if method == "auto":
        return per_sample_jacobian(wl.model, inputs, params=wl.subset).jacobian
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def result_bytes(wl: Workload, method: str, outputs: int) -> int:
    n = wl.inputs[0].shape[0]
    if method == "full_slice":
        cols = sum(p.numel() for p in wl.model.parameters())
    elif method == "jacrev_slice":
        params = dict(wl.model.named_parameters())
        cols = sum(params[name].numel() for name in wl.subset.names)
    else:
        cols = wl.subset.numel
    return n * outputs * cols * 4


# ---------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> int:
    name, method = args.worker
    torch.set_num_threads(args.threads or torch.get_num_threads())
    wl = build(name, quick=args.quick, seed=args.seed)
    with torch.no_grad():
        outputs = int(wl.model([t[:1] for t in wl.inputs]).numel())
    need = result_bytes(wl, method, outputs)
    rec: dict[str, Any] = {"outputs": outputs, "result_bytes_of_method": need}
    if need > args.max_gb * 2**30:
        rec["skipped"] = (
            f"not run: its Jacobian alone takes {fmt_bytes(need)} (> --max-gb {args.max_gb})"
        )
        print(json.dumps(rec))
        return 0
    steps = []
    wl.train_step()
    for _ in range(5):
        steps.append(timed_call(wl.train_step, "cpu")[0])
    wl.model.zero_grad(set_to_none=True)
    rec["train_step_seconds"] = median(steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_method(wl, method, slice(0, 1))  # warm-up on one sample
        gc.collect()
        mem = measure_peak_memory(lambda: run_method(wl, method), "cpu")
        times = [mem["seconds_in_worker"]]
        if times[0] < 20:
            for _ in range(2):
                times.append(timed_call(lambda: run_method(wl, method), "cpu")[0])
        jac0 = run_method(wl, method, slice(0, 1))
        ref0 = run_method(wl, "fwd_onehot", slice(0, 1))
    rec["seconds"] = median(times)
    rec["runs"] = times
    rec["ratio_to_train_step"] = rec["seconds"] / rec["train_step_seconds"]
    rec["peak_memory_bytes"] = mem["peak_memory_bytes"]
    rec["memory"] = mem
    rec["jacobian_bytes"] = wl.inputs[0].shape[0] * outputs * wl.subset.numel * 4
    rec["max_abs_diff_sample0_vs_generic_fwd"] = float((jac0 - ref0).abs().max())
    if method == "auto":
        res = per_sample_jacobian(wl.model, [t[:2] for t in wl.inputs], params=wl.subset)
        rec["auto"] = {
            "mode": res.mode.value,
            "strategy": res.strategy.value,
            "structured": list(res.structured),
            "notes": list(res.notes),
        }
    print(json.dumps(rec))
    return 0


# ---------------------------------------------------------------------- main
def main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out) if args.out else DEFAULT_OUT
    out_path = out_dir / ("bench_subset_quick.json" if args.quick else "bench_subset.json")
    names = args.workloads or workload_names(args.quick)
    results: dict[str, Any] = {
        "benchmark": "bench_subset",
        "env": env_stamp("cpu"),
        "config": {"quick": args.quick, "seed": args.seed, "max_gb": args.max_gb},
        "notes": {
            "seconds": "median of up to 3 runs after a one-sample warm-up, in a fresh process",
            "ratio_to_train_step": "seconds / median of 5 training steps in the same process",
            "peak_memory_bytes": MEMORY_CAVEAT_CPU,
            "jacobian_bytes": "N * O * k * 4: the returned (sliced) Jacobian",
        },
        "workloads": {},
    }
    for name in names:
        wl = build(name, quick=args.quick, seed=args.seed)
        entry: dict[str, Any] = {"description": wl.description, "methods": {}}
        results["workloads"][name] = entry
        for method in args.methods:
            _log(f"{name} / {method} ...")
            rec = run_worker(
                [str(SCRIPT), "--worker", name, method, *_passthrough(args)],
                timeout_s=args.timeout,
            )
            entry["methods"][method] = rec
            _log(f"  {_summary(rec)}")
            write_json(out_path, results)
    write_json(out_path, results)
    print(table(results))
    print(f"\nwrote {out_path}")
    return 0


def _passthrough(args: argparse.Namespace) -> list[str]:
    out = ["--seed", str(args.seed), "--max-gb", str(args.max_gb)]
    if args.quick:
        out.append("--quick")
    if args.threads:
        out += ["--threads", str(args.threads)]
    return out


def _summary(rec: dict[str, Any]) -> str:
    if "error" in rec or "skipped" in rec:
        return rec.get("error") or rec["skipped"]
    return (
        f"{rec['seconds']:.3f} s = {rec['ratio_to_train_step']:.1f} steps, "
        f"peak {fmt_bytes(rec['peak_memory_bytes'])}"
    )


def table(results: dict[str, Any]) -> str:
    rows = []
    for name, entry in results["workloads"].items():
        for method, rec in entry["methods"].items():
            if "seconds" in rec:
                jac = rec["jacobian_bytes"]
                rows.append(
                    [
                        name,
                        method,
                        f"{rec['seconds']:.3g}",
                        f"{rec['ratio_to_train_step']:.1f}",
                        fmt_bytes(rec["peak_memory_bytes"]),
                        f"{rec['peak_memory_bytes'] / jac:.2f}",
                        f"{rec['max_abs_diff_sample0_vs_generic_fwd']:.1e}",
                        _picked(rec),
                    ]
                )
            else:
                why = rec.get("skipped") or rec.get("error", "")
                rows.append(
                    [
                        name,
                        method,
                        "",
                        "",
                        f">= {fmt_bytes(rec.get('result_bytes_of_method'))}",
                        "",
                        "",
                        why[:60],
                    ]
                )
    return markdown_table(
        [
            "workload",
            "method",
            "s",
            "x train step",
            "peak RSS rise",
            "peak / Jacobian",
            "diff",
            "ran",
        ],
        rows,
    )


def _picked(rec: dict[str, Any]) -> str:
    a = rec.get("auto")
    if not a:
        return ""
    structured = f", structured {len(a['structured'])} tensors" if a["structured"] else ""
    return f"{a['strategy']}/{a['mode']}{structured}"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small workloads (a few minutes)")
    p.add_argument("--workloads", nargs="*", help="subset of workloads (default: all)")
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--max-gb", type=float, default=8.0, help="skip methods whose result is larger")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker")
    p.add_argument("--out", help="output folder (default: benchmarks/results)")
    p.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "METHOD"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    sys.exit(worker(args) if args.worker else main(args))
