"""K-FAC Laplace fit of a detection head on ragged pyramids: ``multiscale_jac.KronLaplace`` on
the ragged batch against laplace-torch's ``KronLaplace`` (its default backend,
``CurvlinopsGGN``) on the same samples one shape bucket at a time.

The workload: a RetinaNet-style head shared by three FPN levels (strides 8, 16, 32; two 3x3
convs and a 3x3 classifier conv per level, ``C`` channels), per-image logits (each level's
logits averaged over its positions, summed over levels), on ``N`` images of four sizes (two
heights x two widths), so the pyramids of a batch have four shape signatures. laplace-torch
takes one tensor per batch: it gets, per shape bucket, a loader of the bucket's samples
flattened into one row each and a wrapper that reshapes them into the bucket's levels (the
same parameters), fitted with ``fit(..., override=False)`` after the first bucket (its rule
weights each fit's ``A`` by its share of the samples, so the result is the fit over all of
them). The library takes the ragged list of pyramids in one ``fit``.

Reported per method: the fit's time (median of ``--repeats`` warm calls), its ratio to a
training step of the head on the same ragged batch (forward, cross-entropy, backward; one
bucket at a time) measured in the same run, the peak RSS rise of one fit in a fresh worker
process (setup first: model and data), and the largest relative difference between the two
methods' Kronecker factors (they must agree: the same curvlinops KFAC-expand factors).

Needs laplace-torch (and this repo on ``PYTHONPATH``); run it in the laplace-torch venv::

    PYTHONPATH=$PWD /tmp/lt/bin/python benchmarks/bench_kron.py [--n 48] [--channels 32]

Writes ``benchmarks/results/bench_kron.json`` and the table, also printed, to
``benchmarks/results/bench_kron.md`` (docs/benchmarks.md includes it).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from _common import (
    env_stamp,
    fmt_bytes,
    fmt_seconds,
    markdown_table,
    measure_peak_memory,
    median,
    run_worker,
    timed_call,
    write_json,
)
from torch import Tensor, nn

OUT = Path(__file__).resolve().parent / "results"
SIZES = [(64, 64), (64, 96), (96, 64), (96, 96)]
STRIDES = (8, 16, 32)


class Head(nn.Module):
    """A head shared by every level: conv3x3-ReLU twice, a 3x3 classifier conv; per-image
    logits ``(n, K)``: each level's logits averaged over its positions, summed over levels."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.cls = nn.Conv2d(channels, classes, 3, padding=1)

    def forward(self, levels: list[Tensor]) -> Tensor:
        out = 0
        for x in levels:
            h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
            out = out + self.cls(h).mean((2, 3))
        return out


class Flat(nn.Module):
    """laplace-torch's view of the head: one row per sample, reshaped into the levels of the
    current bucket (``shapes``); the head's parameters are its own (``head.*``)."""

    def __init__(self, head: Head) -> None:
        super().__init__()
        self.head = head
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: Tensor) -> Tensor:
        levels, start = [], 0
        for shape in self.shapes:
            size = 1
            for d in shape:
                size *= d
            levels.append(x[:, start : start + size].reshape(x.shape[0], *shape))
            start += size
        return self.head(levels)


def workload(n: int, channels: int, classes: int, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    head = Head(channels, classes).eval()
    g = torch.Generator().manual_seed(seed + 1)
    samples, labels, sizes = [], [], []
    for i in range(n):
        h, w = SIZES[i % len(SIZES)]
        samples.append([torch.randn(channels, h // s, w // s, generator=g) for s in STRIDES])
        labels.append(int(torch.randint(classes, (1,), generator=g)))
        sizes.append((h, w))
    return {"head": head, "samples": samples, "labels": torch.tensor(labels), "sizes": sizes}


def buckets(wl: dict[str, Any]) -> list[tuple[list[tuple[int, ...]], Tensor, Tensor]]:
    """Per image size: the levels' shapes, the flattened samples ``(n, D)`` and labels."""
    out = []
    for size in SIZES:
        idx = [i for i, s in enumerate(wl["sizes"]) if s == size]
        if not idx:
            continue
        shapes = [tuple(t.shape) for t in wl["samples"][idx[0]]]
        rows = torch.stack([torch.cat([t.reshape(-1) for t in wl["samples"][i]]) for i in idx])
        out.append((shapes, rows, wl["labels"][idx]))
    return out


def fit_ours(wl: dict[str, Any]) -> Any:
    import multiscale_jac as mj

    la = mj.KronLaplace(wl["head"], "classification")
    return la.fit([(wl["samples"], wl["labels"])])


def fit_theirs(wl: dict[str, Any], parts: list) -> Any:
    import laplace
    from laplace.curvature import CurvlinopsGGN
    from torch.utils.data import DataLoader, TensorDataset

    flat = Flat(wl["head"])
    la = laplace.KronLaplace(flat, "classification", backend=CurvlinopsGGN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, (shapes, rows, y) in enumerate(parts):
            flat.shapes = shapes
            loader = DataLoader(TensorDataset(rows, y), batch_size=len(y))
            la.fit(loader, override=k == 0)
    return la


def train_step(wl: dict[str, Any], parts: list) -> None:
    """One training step of the head on the same ragged batch, one bucket at a time."""
    head = wl["head"]
    flat = Flat(head)
    head.zero_grad(set_to_none=True)
    for shapes, rows, y in parts:
        flat.shapes = shapes
        nn.functional.cross_entropy(flat(rows), y, reduction="sum").backward()
    with torch.no_grad():
        for p in head.parameters():
            p -= 0.0 * p.grad  # a step of size 0: the model stays at its MAP
    head.zero_grad(set_to_none=True)


METHODS = {
    "train_step": lambda wl, parts: train_step(wl, parts),
    "multiscale_jac KronLaplace (ragged batch)": lambda wl, parts: fit_ours(wl),
    "laplace-torch KronLaplace (per shape bucket)": fit_theirs,
}


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    wl = workload(args.n, args.channels, args.classes)
    parts = buckets(wl)
    rec = measure_peak_memory(lambda: METHODS[args.worker](wl, parts), "cpu")
    print(json.dumps({k: v for k, v in rec.items() if k != "result"}, default=str))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    torch.set_num_threads(args.threads)
    common = ["--n", str(args.n), "--channels", str(args.channels)]
    common += ["--classes", str(args.classes), "--threads", str(args.threads)]
    memory = {  # fresh workers first, while this process is small
        m: run_worker([__file__, *common, "--worker", m], timeout_s=1800) for m in METHODS
    }
    wl = workload(args.n, args.channels, args.classes)
    parts = buckets(wl)
    seconds: dict[str, float] = {}
    results: dict[str, Any] = {}
    for name, fn in METHODS.items():
        call = functools.partial(fn, wl, parts)
        timed_call(call, "cpu")  # warm-up
        runs = [timed_call(call, "cpu") for _ in range(args.repeats)]
        seconds[name] = median([t for t, _ in runs])
        results[name] = runs[-1][1]
    ours = results["multiscale_jac KronLaplace (ragged batch)"].posterior_precision.to_matrix()
    theirs = results["laplace-torch KronLaplace (per shape bucket)"].posterior_precision
    theirs = theirs.to_matrix()
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    step = seconds["train_step"]
    rows, recs = [], []
    for name in METHODS:
        mem = memory[name].get("peak_rss_rise_bytes")
        rec = {
            "method": name,
            "seconds": seconds[name],
            "ratio_to_train_step": seconds[name] / step,
            "peak_rss_rise_bytes": mem,
            "memory_worker": memory[name],
        }
        recs.append(rec)
        rows.append(
            [name, fmt_seconds(seconds[name]), f"{seconds[name] / step:.2f}", fmt_bytes(mem)]
        )
    table = markdown_table(["method", "seconds", "x train step", "peak RSS rise (MiB)"], rows)
    note = f"posterior precision: largest relative difference {rel:.1e}"
    print(table)
    print(note)
    (Path(args.out) / "bench_kron.md").write_text(f"{table}\n\n{note}\n")
    import laplace

    env = env_stamp("cpu")
    env["laplace_torch"] = getattr(laplace, "__version__", "unknown")
    workload_desc = (
        f"RetinaNet-style head (3 convs, C={args.channels}, K={args.classes}) over 3 levels "
        f"(strides {STRIDES}), N={args.n} images of sizes {SIZES}"
    )
    write_json(
        Path(args.out) / "bench_kron.json",
        {
            "env": env,
            "workload": workload_desc,
            "posterior_precision_rel_diff": rel,
            "methods": recs,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
