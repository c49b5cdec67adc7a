"""Benchmark: a ragged multi-resolution batch, per-sample loop vs bucketed vs padded vs auto.

Workload
    ``SharedHeadFPN(in_channels=(8, 8, 8), width=8, num_outputs=4, depth=2)``: per-level 1x1
    laterals, then one conv/GroupNorm/ReLU tower shared by the three levels (through
    :func:`multiscale_jac.map_levels`), dense per-pixel outputs. A batch of 32 samples with
    detection-like aspect ratios, 8 distinct shape signatures (levels at strides 1, 2, 4 of a base
    size, scaled down for CPU); Jacobian w.r.t. the shared head (``"head.*"``). Outputs are ragged
    (``O`` differs per sample).

Methods (Jacobian)
    loop          ``per_sample_jacobian(strategy="loop")``: the reference, one sample and one
                  output row at a time.
    jacrev_loop   What users write today: a Python loop over samples, ``torch.func.jacrev`` of a
                  ``functional_call`` per sample (no vmap across samples).
    bucketed      ``strategy="bucketed"``: one vmap per shape bucket.
    padded        ``strategy="padded"``: one vmap over the padded batch (masked execution).
    auto          ``per_sample_jacobian`` defaults (what it picked is recorded).

    All engine methods use ``mode="auto"``; the mode that ran is recorded.

Level packing
    ``map_levels(head, levels, packing="canvas" | "loop")`` on a uniform batch: forward time,
    a training step (forward + backward) and the per-sample Jacobian through each, plus the
    work wasted by each packing (canvas gutters and free corner; stacking every level padded to
    the largest, computed, not run).

Every time is also reported as a ratio to one training step on the same batch measured in the
same process just before it (forward + ``.mean().backward()`` per shape bucket, summed); peak
memory comes from a fresh worker process per method. Results go to
``benchmarks/results/bench_multires.json`` (``_quick`` with ``--quick``) and a markdown table to
stdout.

Usage::

    python benchmarks/bench_multires.py              # full run (a few minutes on 2 CPU cores)
    python benchmarks/bench_multires.py --quick      # 12 samples, small maps
    python benchmarks/bench_multires.py --device cuda
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import (
    MEMORY_CAVEAT_CPU,
    MEMORY_CAVEAT_CUDA,
    env_stamp,
    fmt_bytes,
    fmt_float,
    fmt_seconds,
    load_average,
    markdown_table,
    measure_peak_memory,
    median,
    run_worker,
    time_method,
    timed_call,
    write_json,
)
from torch.func import functional_call, jacrev

from multiscale_jac import FallbackWarning, JacobianResult, ParamSubset, pack, per_sample_jacobian
from multiscale_jac.levels import canvas_layout, map_levels
from multiscale_jac.models import SharedHeadFPN

METHODS = ("loop", "jacrev_loop", "bucketed", "padded", "auto")
SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results"
CHANNELS = (8, 8, 8)

# (H, W) of the finest level: detection-like aspect ratios 1:1, 4:3, 3:4, 16:9, 9:16, 2:1, 1:2, 3:2
BASE_SIZES = [(12, 12), (12, 16), (16, 12), (9, 16), (16, 9), (8, 16), (16, 8), (12, 18)]
QUICK_SIZES = [(6, 6), (6, 8), (8, 6), (4, 8)]


@dataclass
class Workload:
    model: torch.nn.Module
    samples: list[list[torch.Tensor]]
    subset: ParamSubset
    train_batches: list[list[torch.Tensor]]
    description: str


def level_sizes(h: int, w: int) -> list[tuple[int, int]]:
    return [(math.ceil(h / s), math.ceil(w / s)) for s in (1, 2, 4)]


def build(*, quick: bool, device: torch.device, seed: int) -> Workload:
    n, bases = (12, QUICK_SIZES) if quick else (32, BASE_SIZES)
    torch.manual_seed(seed)
    model = SharedHeadFPN(CHANNELS, width=8, num_outputs=4, depth=2).to(device).eval()
    g = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(n, generator=g).tolist()  # shuffled: buckets are not contiguous
    samples = []
    for i in range(n):
        sizes = level_sizes(*bases[order[i] % len(bases)])
        samples.append(
            [torch.randn(c, h, w, generator=g).to(device) for c, (h, w) in zip(CHANNELS, sizes)]
        )
    packed = pack(samples)
    train = [[t.contiguous() for t in packed.stack(b.indices)] for b in packed.buckets()]
    subset = ParamSubset.from_names(model, "head.*")
    desc = (
        f"SharedHeadFPN(in_channels={CHANNELS}, width=8, num_outputs=4, depth=2) float32, "
        f"{n} samples, levels at strides 1/2/4 of base sizes {bases} "
        f"({len(packed.buckets())} shape signatures); params 'head.*' ({subset.numel} entries)"
    )
    return Workload(model, samples, subset, train, desc)


def jacrev_loop(wl: Workload) -> torch.Tensor:
    """The hand-written loop: one ``jacrev`` per sample; rows padded to the largest sample."""
    params = {k: v.detach() for k, v in wl.model.named_parameters()}
    buffers = dict(wl.model.named_buffers())
    names = wl.subset.names

    def f(sel: dict[str, torch.Tensor], levels: list[torch.Tensor]) -> torch.Tensor:
        out = functional_call(
            wl.model, {**params, **buffers, **sel}, ([x.unsqueeze(0) for x in levels],)
        )
        return out.reshape(-1)

    rows = []
    for sample in wl.samples:
        jac = jacrev(f)({k: params[k] for k in names}, sample)
        rows.append(torch.cat([jac[k].flatten(1) for k in names], dim=1))
    out = rows[0].new_zeros(len(rows), max(r.shape[0] for r in rows), rows[0].shape[1])
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def run_method(wl: Workload, method: str) -> Any:
    if method == "jacrev_loop":
        return jacrev_loop(wl)
    strategy = "auto" if method == "auto" else method
    return per_sample_jacobian(wl.model, wl.samples, params=wl.subset, strategy=strategy)


def train_step(model: torch.nn.Module, batches: list[list[torch.Tensor]]) -> None:
    model.zero_grad(set_to_none=True)
    for batch in batches:
        model(batch).mean().backward()


def measure_train(model, batches, device, repeats: int) -> float:
    timed_call(lambda: train_step(model, batches), device)  # warm-up
    t = median([timed_call(lambda: train_step(model, batches), device)[0] for _ in range(repeats)])
    model.zero_grad(set_to_none=True)
    return t


def compare(jac: torch.Tensor, ref: JacobianResult) -> float:
    mask = ref.output_mask
    a = jac[:, : ref.jacobian.shape[1]]
    return float((a - ref.jacobian)[mask].abs().max())


# ---------------------------------------------------------------------- jacobian methods
def bench_methods(args, device, memory) -> dict[str, Any]:
    wl = build(quick=args.quick, device=device, seed=args.seed)
    packed = pack(wl.samples)
    o = [4 * sum(h * w for h, w in sig) for sig in packed.signatures]
    rec: dict[str, Any] = {
        "description": wl.description,
        "N": len(wl.samples),
        "P": wl.subset.numel,
        "O_per_sample": {"min": min(o), "mean": sum(o) / len(o), "max": max(o)},
        "shape_signatures": len(packed.buckets()),
        "bucket_sizes": [len(b.indices) for b in packed.buckets()],
        "padding_waste": packed.padding_waste,
        "train_step_definition": "model.zero_grad(); for each shape bucket (samples stacked): "
        "model(bucket).mean().backward(); times summed",
        "methods": {},
    }
    ref: JacobianResult | None = None
    train_times = []
    for method in METHODS if args.methods is None else args.methods:
        load = load_average()
        train = measure_train(wl.model, wl.train_batches, device, args.train_repeats)
        train_times.append(train)
        _log(f"{method}: training step {train:.4f} s; running ...")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FallbackWarning)
            t = time_method(
                lambda m=method: run_method(wl, m),
                device,
                warm=method != "loop",
                repeats=args.repeats,
                warm_limit_s=args.warm_limit,
                repeat_budget_s=args.repeat_budget,
                keep=lambda r: r,
            )
        res = t.pop("kept")
        m: dict[str, Any] = {
            **t,
            "train_step_seconds": train,
            "ratio_to_train_step": t["seconds"] / train,
            "fallback_warnings": sorted({str(w.message) for w in caught}),
            "load_average_before": load,
        }
        if isinstance(res, JacobianResult):
            m.update(
                strategy=res.strategy.value,
                mode=res.mode.value,
                chunk_size=res.chunk_size,
                fallback=res.fallback,
                notes=list(res.notes),
            )
            jac = res.jacobian
        else:
            m.update(strategy="python loop of jacrev", mode="rev")
            jac = res
        if method == "loop":
            ref = res
        m["max_abs_diff_vs_loop"] = None if ref is None else compare(jac, ref)
        mem = memory.get(method)
        m["peak_memory_bytes"] = None if mem is None else mem.get("peak_memory_bytes")
        m["memory"] = mem
        rec["methods"][method] = m
        _log(
            f"{method}: {t['seconds']:.3f} s, x{m['ratio_to_train_step']:.0f} train step, "
            f"ran {m['strategy']}/{m['mode']}, diff {fmt_float(m['max_abs_diff_vs_loop'])}"
        )
        del res, jac
        gc.collect()
    rec["train_step_seconds"] = median(train_times)
    ms = rec["methods"]
    if "auto" in ms:
        rec["auto_speedup"] = {
            k: ms[k]["seconds"] / ms["auto"]["seconds"] for k in ms if k != "auto"
        }
    return rec


# ---------------------------------------------------------------------- level packing
def bench_packing(args, device) -> dict[str, Any]:
    """map_levels canvas vs loop on a uniform batch (one shape, so the engine runs vmap)."""
    b, (h, w) = (4, (16, 24)) if args.quick else (8, (32, 48))
    sizes = level_sizes(h, w)
    torch.manual_seed(args.seed)
    models = {
        p: SharedHeadFPN(CHANNELS, 8, 4, 2, packing=p).to(device).eval() for p in ("canvas", "loop")
    }
    models["loop"].load_state_dict(models["canvas"].state_dict())
    g = torch.Generator().manual_seed(args.seed + 2)
    batch = [
        torch.randn(b, c, hh, ww, generator=g).to(device) for c, (hh, ww) in zip(CHANNELS, sizes)
    ]
    jac_samples = [[x[i] for x in batch] for i in range(2 if args.quick else 4)]
    lateral = [torch.randn(b, 8, hh, ww) for hh, ww in sizes]
    packing = map_levels(models["canvas"].head, [x.to(device) for x in lateral], packing="canvas")
    _, ch, cw = canvas_layout(models["canvas"].head, sizes)  # the layout map_levels used
    useful = sum(hh * ww for hh, ww in sizes)
    rec: dict[str, Any] = {
        "description": f"SharedHeadFPN head on a uniform batch B={b}, levels {sizes}; "
        f"Jacobian on {len(jac_samples)} samples w.r.t. 'head.*'",
        "canvas_ran": packing.packing,
        "work_ratio": {
            "loop": 1.0,
            "canvas": ch * cw / useful,
            "stack_padded_to_largest": len(sizes) * max(hh * ww for hh, ww in sizes) / useful,
        },
        "packings": {},
    }
    for p, model in models.items():

        def fwd(model=model):
            with torch.no_grad():
                return model(batch)

        def step(model=model):
            model.zero_grad(set_to_none=True)
            model(batch).mean().backward()

        def jac(model=model):
            return per_sample_jacobian(
                model, jac_samples, params=ParamSubset.from_names(model, "head.*")
            )

        r = {}
        for what, fn in (("forward", fwd), ("train_step", step), ("jacobian", jac)):
            t = time_method(
                fn,
                device,
                warm=True,
                repeats=args.repeats,
                warm_limit_s=args.warm_limit,
                repeat_budget_s=args.repeat_budget,
            )
            r[what] = t["seconds"]
            r[what + "_timing"] = t["timing"]
        rec["packings"][p] = r
        _log(
            f"map_levels {p}: "
            + ", ".join(f"{k} {v:.4f} s" for k, v in r.items() if "timing" not in k)
        )
    return rec


# ---------------------------------------------------------------------- processes
def measure_memory(args, device) -> dict[str, Any]:
    out = {}
    for method in METHODS if args.methods is None else args.methods:
        argv = [str(SCRIPT), "--worker", method, "--device", str(device), "--seed", str(args.seed)]
        argv += ["--threads", str(torch.get_num_threads())] + (["--quick"] if args.quick else [])
        _log(f"{method}: peak memory in a fresh process ...")
        out[method] = run_worker(argv, timeout_s=args.worker_timeout)
        if "error" in out[method]:
            _log(f"{method}: memory worker failed: {out[method]['error']}")
    return out


def worker(args) -> int:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    wl = build(quick=args.quick, device=device, seed=args.seed)
    wl.train_batches = []
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = measure_peak_memory(lambda: run_method(wl, args.worker), device)
    rec["caveat"] = MEMORY_CAVEAT_CUDA if device.type == "cuda" else MEMORY_CAVEAT_CPU
    print(json.dumps(rec))
    return 0


def print_table(results: dict[str, Any]) -> None:
    env, wl = results["env"], results["multires"]
    print(
        f"\n## bench_multires ({'quick' if results['config']['quick'] else 'full'}): torch "
        f"{env['torch']}, {env['device']}, {env['torch_threads']} threads, commit "
        f"{(env['git_commit'] or '?')[:10]}, {env['date_utc']}\n\n{wl['description']}\n"
        f"N={wl['N']}, P={wl['P']}, O per sample {wl['O_per_sample']['min']}.."
        f"{wl['O_per_sample']['max']}, {wl['shape_signatures']} signatures (bucket sizes "
        f"{wl['bucket_sizes']}), padding waste {wl['padding_waste']:.0%}; training step "
        f"{fmt_seconds(wl['train_step_seconds'])} s\n"
    )
    rows = []
    for name, m in wl["methods"].items():
        rows.append(
            [
                name,
                f"{m['strategy']}/{m['mode']}",
                fmt_seconds(m["seconds"]),
                f"{m['ratio_to_train_step']:.0f}x",
                f"{wl.get('auto_speedup', {}).get(name, 1.0):.1f}x" if name != "auto" else "1.0x",
                fmt_bytes(m["peak_memory_bytes"]),
                fmt_float(m["max_abs_diff_vs_loop"]),
            ]
        )
    heads = ["method", "ran", "seconds", "vs train step", "auto faster by", "peak MiB", "max|diff|"]
    print(markdown_table(heads, rows))
    lv = results["map_levels"]
    print(f"\n### map_levels: {lv['description']}\n")
    rows = [
        [
            p,
            f"{lv['work_ratio'][p]:.2f}",
            fmt_seconds(r["forward"]),
            fmt_seconds(r["train_step"]),
            fmt_seconds(r["jacobian"]),
        ]
        for p, r in lv["packings"].items()
    ]
    rows.append(
        ["stack (not run)", f"{lv['work_ratio']['stack_padded_to_largest']:.2f}", "-", "-", "-"]
    )
    print(
        markdown_table(
            ["packing", "work / useful", "forward s", "train step s", "jacobian s"], rows
        )
    )


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="12 samples, 4 signatures, small maps")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None, metavar="DIR", help=f"default {DEFAULT_OUT}")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=None)
    ap.add_argument("--repeats", type=int, default=5, help="max warm runs per timing")
    ap.add_argument("--warm-limit", type=float, default=30.0, metavar="S")
    ap.add_argument("--repeat-budget", type=float, default=30.0, metavar="S")
    ap.add_argument("--train-repeats", type=int, default=5)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory workers")
    ap.add_argument("--no-packing", action="store_true", help="skip the map_levels section")
    ap.add_argument("--worker-timeout", type=float, default=1800.0, metavar="S")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--worker", choices=METHODS, default=None, help="internal: memory worker")
    return ap.parse_args(argv)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker is not None:
        return worker(args)
    device = torch.device(args.device)
    # workers first, while this process is still small (see _common.run_worker)
    memory = {} if args.no_memory else measure_memory(args, device)
    env = env_stamp(device)
    results: dict[str, Any] = {"env": env, "config": vars(args)}
    results["multires"] = bench_methods(args, device, memory)
    results["map_levels"] = None if args.no_packing else bench_packing(args, device)
    env["load_average_at_end"] = load_average()
    name = (
        "bench_multires"
        + ("_quick" if args.quick else "")
        + ("_cuda" if device.type == "cuda" else "")
    )
    out = write_json(Path(args.out or DEFAULT_OUT) / f"{name}.json", results)
    if results["map_levels"] is not None:
        print_table(results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
