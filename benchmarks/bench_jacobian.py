"""Benchmark: per-sample Jacobians, loop reference vs the vectorised engine.

Workloads
    convblock  ``ConvBlock(in_ch=32, out_ch=8)`` on two uniform levels ``(16, 32, 24, 24)`` and
               ``(16, 32, 14, 14)``; 500 single weight entries (167/167/166 random flat indices
               of ``conv.{0,1,2}.weight``). N=16, O=3104, P=500.
    fpn        ``TinyFPN(in_channels=(8, 16), width=16, num_outputs=4, extra_levels=1)`` on a
               ragged batch of 16 samples ``[(8, H, W), (16, ceil(H/2), ceil(W/2))]`` with four
               (H, W) sizes (four shape buckets, outputs padded); parameters ``"head.*"``.

Methods
    loop      ``reference.per_sample_jacobian_loop`` (one sample, one output row at a time).
    vmap_rev  ``per_sample_jacobian(strategy="vmap" | "bucketed" for fpn, mode="rev")``.
    vmap_fwd  the same with ``mode="fwd"``.
    auto      ``per_sample_jacobian`` with defaults (what it picked is recorded).

Per method: wall time (also as a ratio to one ordinary training step measured in the same
process just before it), peak memory from a fresh worker process, and the max abs difference of
the Jacobian from the loop's. Results go to ``benchmarks/results/bench_jacobian.json`` and a
markdown table to stdout.

Usage::

    python benchmarks/bench_jacobian.py            # full run (several minutes on 2 CPU cores)
    python benchmarks/bench_jacobian.py --quick    # small workloads, about a minute
    python benchmarks/bench_jacobian.py --device cuda --out /tmp/bench
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
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
from torch import nn

from multiscale_jac import (
    FallbackWarning,
    JacobianResult,
    ParamSubset,
    pack,
    per_sample_jacobian,
)
from multiscale_jac.models import ConvBlock, TinyFPN
from multiscale_jac.reference import per_sample_jacobian_loop

WORKLOADS = ("convblock", "fpn")
METHODS = ("loop", "vmap_rev", "vmap_fwd", "auto")
SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results"


# ---------------------------------------------------------------------- workloads
@dataclass
class Workload:
    name: str
    description: str
    model: nn.Module
    inputs: Any  # what the engine and the loop get (a list of levels or a list of samples)
    subset: ParamSubset
    vmap_strategy: str  # strategy for vmap_rev / vmap_fwd
    train_batches: list[list[torch.Tensor]]  # one batched list of levels per shape bucket
    buckets: list[dict[str, Any]] = field(default_factory=list)
    train_step_definition: str = ""


def build_workload(name: str, *, quick: bool, device: torch.device, seed: int) -> Workload:
    """Model, inputs and parameter subset, deterministic in ``seed`` (worker == main process)."""
    if name == "convblock":
        wl = _convblock(quick=quick, seed=seed)
    elif name == "fpn":
        wl = _fpn(quick=quick, seed=seed)
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    wl.model.to(device)
    if wl.name == "fpn":
        wl.inputs = [[t.to(device) for t in s] for s in wl.inputs]
    else:
        wl.inputs = [t.to(device) for t in wl.inputs]
    # The training-step batches: the library's own shape buckets, each stacked into one
    # contiguous batch (for the uniform convblock this is the whole batch).
    packed = pack(wl.inputs)
    wl.train_batches = []
    wl.buckets = []
    with torch.no_grad():
        for b in packed.buckets():
            batch = [t.contiguous() for t in packed.stack(b.indices)]
            out = wl.model(batch)
            wl.train_batches.append(batch)
            wl.buckets.append(
                {
                    "signature": [list(s) for s in b.signature],
                    "samples": len(b.indices),
                    "outputs_per_sample": int(out[0].numel()),
                }
            )
    return wl


def _convblock(*, quick: bool, seed: int) -> Workload:
    n, sizes, per_tensor = (4, (16, 10), (20, 20, 20)) if quick else (16, (24, 14), (167, 167, 166))
    torch.manual_seed(seed)
    model = ConvBlock(in_ch=32, out_ch=8).float()
    g = torch.Generator().manual_seed(seed + 1)
    inputs = [torch.randn(n, 32, s, s, generator=g) for s in sizes]
    gi = torch.Generator().manual_seed(seed + 2)
    params = dict(model.named_parameters())
    names = ["conv.0.weight", "conv.1.weight", "conv.2.weight"]
    indices = {
        nm: torch.randperm(params[nm].numel(), generator=gi)[:k]
        for nm, k in zip(names, per_tensor, strict=True)
    }
    subset = ParamSubset.from_indices(model, indices)
    return Workload(
        name="convblock",
        description=(
            f"ConvBlock(in_ch=32, out_ch=8) float32 on levels "
            f"{[tuple(t.shape) for t in inputs]}; {subset.numel} single weight entries "
            f"({'/'.join(map(str, per_tensor))} random flat indices of {', '.join(names)})"
        ),
        model=model,
        inputs=inputs,
        subset=subset,
        vmap_strategy="vmap",
        train_batches=[],
        train_step_definition=(
            "model.zero_grad(set_to_none=True); model(whole batch).mean().backward()"
        ),
    )


def _fpn(*, quick: bool, seed: int) -> Workload:
    if quick:
        n, hw = 8, [(8, 8), (8, 12), (12, 12), (12, 8)]
    else:
        n, hw = 16, [(12, 12), (12, 16), (16, 16), (20, 16)]
    torch.manual_seed(seed)
    model = TinyFPN(in_channels=(8, 16), width=16, num_outputs=4, extra_levels=1).float()
    g = torch.Generator().manual_seed(seed + 1)
    # Balanced over the sizes, in a shuffled order (buckets are not contiguous in the batch).
    order = torch.randperm(n, generator=g).tolist()
    samples = []
    for i in range(n):
        h, w = hw[order[i] % len(hw)]
        samples.append(
            [
                torch.randn(8, h, w, generator=g),
                torch.randn(16, math.ceil(h / 2), math.ceil(w / 2), generator=g),
            ]
        )
    subset = ParamSubset.from_names(model, "head.*")
    return Workload(
        name="fpn",
        description=(
            f"TinyFPN(in_channels=(8, 16), width=16, num_outputs=4, extra_levels=1) float32 on "
            f"{n} ragged samples [(8, H, W), (16, ceil(H/2), ceil(W/2))], (H, W) in {hw}; "
            f"params 'head.*' ({subset.numel} entries)"
        ),
        model=model,
        inputs=samples,
        subset=subset,
        vmap_strategy="bucketed",
        train_batches=[],
        # The ragged batch cannot go through the model as one tensor, so one training step is
        # one forward + .mean().backward() per shape bucket (the samples of a bucket stacked
        # into one batch), the bucket times summed (timed together as one call), with the
        # gradients accumulating across buckets as in gradient accumulation. This is the same
        # grouping the bucketed engine uses.
        train_step_definition=(
            "model.zero_grad(set_to_none=True); for each shape bucket (samples stacked): "
            "model(bucket).mean().backward(); times of all buckets summed"
        ),
    )


def run_method(wl: Workload, method: str) -> JacobianResult:
    if method == "loop":
        return per_sample_jacobian_loop(wl.model, wl.inputs, params=wl.subset)
    if method == "vmap_rev":
        return per_sample_jacobian(
            wl.model, wl.inputs, params=wl.subset, strategy=wl.vmap_strategy, mode="rev"
        )
    if method == "vmap_fwd":
        return per_sample_jacobian(
            wl.model, wl.inputs, params=wl.subset, strategy=wl.vmap_strategy, mode="fwd"
        )
    if method == "auto":
        return per_sample_jacobian(wl.model, wl.inputs, params=wl.subset)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def training_step(wl: Workload) -> Callable[[], None]:
    def step() -> None:
        wl.model.zero_grad(set_to_none=True)
        for batch in wl.train_batches:
            wl.model(batch).mean().backward()

    return step


def measure_training_step(wl: Workload, device: torch.device, repeats: int) -> dict[str, Any]:
    """One warm-up, then the median of ``repeats`` training steps; gradients dropped after."""
    step = training_step(wl)
    timed_call(step, device)  # warm-up
    times = [timed_call(step, device)[0] for _ in range(repeats)]
    wl.model.zero_grad(set_to_none=True)
    return {"seconds": median(times), "runs": times}


# ---------------------------------------------------------------------- correctness
def compare(res: JacobianResult, ref: JacobianResult | None) -> dict[str, Any]:
    """Max abs difference from the loop's Jacobian over real output rows; padded rows checked
    to be zero (``output_mask`` semantics)."""
    if ref is None:
        return {"max_abs_diff_vs_loop": None, "note": "loop not run: no reference"}
    a, b = res.jacobian, ref.jacobian
    if a.shape != b.shape or tuple(res.output_sizes) != tuple(ref.output_sizes):
        return {
            "max_abs_diff_vs_loop": None,
            "mismatch": f"shape {tuple(a.shape)} vs loop {tuple(b.shape)}, output sizes "
            f"{res.output_sizes} vs {ref.output_sizes}",
        }
    out: dict[str, Any] = {}
    d = (a - b).abs()
    mask = ref.output_mask
    if mask is None:
        out["max_abs_diff_vs_loop"] = float(d.max())
    else:
        if res.output_mask is None or not torch.equal(res.output_mask, mask):
            out["mismatch"] = "output_mask differs from the loop's"
        out["max_abs_diff_vs_loop"] = float(d[mask].max())
        pad = a[~mask]
        out["padded_rows_max_abs"] = float(pad.abs().max()) if pad.numel() else 0.0
    scale = float(b.abs().max())
    out["rel_max_abs_diff_vs_loop"] = out["max_abs_diff_vs_loop"] / scale if scale else None
    return out


def engine_record(res: JacobianResult) -> dict[str, Any]:
    return {
        "strategy": res.strategy.value,
        "mode": res.mode.value,
        "chunk_size": res.chunk_size,
        "inner_chunk_size": res.inner_chunk_size,
        "requested_strategy": res.requested_strategy.value,
        "requested_mode": res.requested_mode.value,
        "fallback": res.fallback,
    }


# ---------------------------------------------------------------------- main process
def bench_workload(
    name: str, args: argparse.Namespace, device: torch.device, memory: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Time every method (main process) and attach the worker's peak-memory records."""
    wl = build_workload(name, quick=args.quick, device=device, seed=args.seed)
    sizes = [bk["outputs_per_sample"] for bk in wl.buckets for _ in range(bk["samples"])]
    n, o, p = len(sizes), max(sizes), wl.subset.numel
    _log(f"[{name}] N={n} O={o} P={p}, {len(wl.buckets)} shape bucket(s)")
    rec: dict[str, Any] = {
        "description": wl.description,
        "N": n,
        "O": o,
        "P": p,
        "O_per_sample": {"min": min(sizes), "mean": sum(sizes) / n, "max": o},
        "shape_buckets": wl.buckets,
        "params": {k: (None if v is None else len(v)) for k, v in wl.subset.indices.items()},
        "vmap_strategy": wl.vmap_strategy,
        "train_step_definition": wl.train_step_definition,
        "methods": {},
    }
    methods = sorted(args.methods, key=METHODS.index)  # loop first: it is the reference
    ref: JacobianResult | None = None
    train_times = []
    for method in methods:
        load = load_average()
        train = measure_training_step(wl, device, args.train_repeats)
        train_times.append(train["seconds"])
        _log(f"[{name}] {method}: training step {train['seconds']:.3f} s; running ...")
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
        res: JacobianResult = t.pop("kept")
        m: dict[str, Any] = {
            **t,
            "train_step_seconds": train["seconds"],
            "train_step_runs": train["runs"],
            "ratio_to_train_step": t["seconds"] / train["seconds"],
            **engine_record(res),
            "fallback_warnings": sorted(
                {str(w.message) for w in caught if issubclass(w.category, FallbackWarning)}
            ),
            "load_average_before": load,
        }
        if method == "loop":
            ref = res
            m.update({"max_abs_diff_vs_loop": 0.0, "note": "the reference itself"})
        else:
            m.update(compare(res, ref))
        del res
        gc.collect()
        _log(
            f"[{name}] {method}: {t['seconds']:.3f} s ({t['timing']}), "
            f"x{m['ratio_to_train_step']:.1f} training step, "
            f"max|diff| {fmt_float(m.get('max_abs_diff_vs_loop'))}"
        )
        rec["methods"][method] = m
    rec["max_abs_loop"] = float(ref.jacobian.abs().max()) if ref is not None else None
    del ref
    gc.collect()
    rec["train_step_seconds"] = median(train_times)

    for method in methods:
        mem = memory.get(method)
        rec["methods"][method]["peak_memory_bytes"] = (
            None if mem is None else mem.get("peak_memory_bytes")
        )
        rec["methods"][method]["memory"] = mem
    return rec


def measure_memory(
    name: str, args: argparse.Namespace, device: torch.device
) -> dict[str, dict[str, Any]]:
    """Peak memory of every method, each from a fresh worker process (run once there)."""
    out = {}
    for method in sorted(args.methods, key=METHODS.index):
        _log(f"[{name}] {method}: peak memory in a fresh process ...")
        mem = run_worker(worker_argv(name, method, args, device), timeout_s=args.worker_timeout)
        if "error" in mem:
            _log(f"[{name}] {method}: memory worker failed: {mem['error']}")
        elif mem.get("ru_maxrss_inherited"):
            _log(f"[{name}] {method}: ru_maxrss inherited from this process; used VmHWM")
        out[method] = mem
    return out


def worker_argv(name: str, method: str, args: argparse.Namespace, device: torch.device) -> list:
    argv = [str(SCRIPT), "--worker", name, method, "--device", str(device)]
    argv += ["--seed", str(args.seed), "--threads", str(torch.get_num_threads())]
    return [*argv, "--quick"] if args.quick else argv


def print_table(results: dict[str, Any]) -> None:
    env = results["env"]
    print(
        f"\n## bench_jacobian ({'quick' if results['config']['quick'] else 'full'}): "
        f"torch {env['torch']}, python {env['python']}, {env['device']}"
        f"{' (' + env['cuda_device_name'] + ')' if env['cuda_device_name'] else ''}, "
        f"{env['torch_threads']} threads, {env['cpu_count']} CPUs, "
        f"commit {(env['git_commit'] or '?')[:10]}{' (dirty)' if env['git_dirty'] else ''}, "
        f"{env['date_utc']}; load average {env['load_average_at_start']} at start, "
        f"{env.get('load_average_at_end')} at end"
    )
    mem_unit = "peak CUDA MiB" if env["device"].startswith("cuda") else "peak RSS rise MiB"
    for name, wl in results["workloads"].items():
        print(
            f"\n### {name}: N={wl['N']}, O={wl['O']}"
            f"{' (max; ragged)' if wl['O_per_sample']['min'] != wl['O'] else ''}, P={wl['P']}, "
            f"{len(wl['shape_buckets'])} shape bucket(s); training step "
            f"{fmt_seconds(wl['train_step_seconds'])} s (median)\n"
        )
        rows = []
        for method, m in wl["methods"].items():
            ran = f"{m['strategy']}/{m['mode']}/chunk={m['chunk_size']}"
            if m.get("inner_chunk_size") is not None:
                ran += f"/inner={m['inner_chunk_size']}"
            if m.get("fallback"):
                ran += " (fallback)"
            mem = fmt_bytes(m.get("peak_memory_bytes"))
            if (m.get("memory") or {}).get("ru_maxrss_inherited"):
                mem += "*"
            elif m.get("memory") and "error" in m["memory"]:
                mem = "error"
            load = m.get("load_average_before")
            rows.append(
                [
                    method,
                    fmt_ratio(m["ratio_to_train_step"]),
                    fmt_seconds(m["seconds"]),
                    fmt_seconds(m["cold_seconds"]),
                    m["warm_runs"],
                    fmt_seconds(m["train_step_seconds"]),
                    mem,
                    fmt_float(m.get("max_abs_diff_vs_loop")),
                    ran,
                    "-" if load is None else f"{load[0]:.1f}",
                ]
            )
        print(
            markdown_table(
                [
                    "method",
                    "x train step",
                    "seconds",
                    "cold s",
                    "warm runs",
                    "train step s",
                    mem_unit,
                    "max |diff| vs loop",
                    "ran (strategy/mode/chunk)",
                    "load",
                ],
                rows,
            )
        )
    print(
        "\nseconds: median of the warm runs when the cold run was cheap, else the single cold "
        "run (loop: always one cold run); cold s: the first run. x train step: seconds / one "
        "ordinary training step (median) timed in the same process just before the method. "
        "memory: peak RSS rise over the post-setup baseline of a fresh process running the "
        "method once (* = VmHWM, as ru_maxrss was inherited); CUDA: max_memory_allocated rise. "
        "max |diff|: over real output rows (padded rows checked to be 0). load: 1-min load "
        "average before the method."
    )


def fmt_ratio(r: float) -> str:
    if r >= 100:
        return f"{r:.0f}x"
    return f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"


def main_process(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.out) if args.out else DEFAULT_OUT
    out_path = out_dir / ("bench_jacobian_quick.json" if args.quick else "bench_jacobian.json")
    results: dict[str, Any] = {
        "benchmark": "bench_jacobian",
        "env": env_stamp(device),
        "config": {
            "quick": args.quick,
            "device": str(device),
            "seed": args.seed,
            "workloads": args.workloads,
            "methods": args.methods,
            "repeats": args.repeats,
            "warm_limit_s": args.warm_limit,
            "repeat_budget_s": args.repeat_budget,
            "train_repeats": args.train_repeats,
            "memory": not args.no_memory,
        },
        "notes": {
            "seconds": (
                "wall time of one call. The first (cold) run doubles as warm-up; when it took "
                "less than warm_limit_s (and the method is not loop), up to `repeats` warm runs "
                "follow (capped by repeat_budget_s) and seconds is their median; else seconds is "
                "the cold run. cold_seconds is always the first run."
            ),
            "ratio_to_train_step": (
                "seconds / train_step_seconds, the median of train_repeats training steps (after "
                "one warm-up) measured in the same process immediately before the method; see "
                "each workload's train_step_definition"
            ),
            "peak_memory_bytes": MEMORY_CAVEAT_CUDA if device.type == "cuda" else MEMORY_CAVEAT_CPU,
            "max_abs_diff_vs_loop": (
                "max |J_method - J_loop| over real output rows (output_mask of the loop "
                "result); padded_rows_max_abs is the largest |entry| of the method's padded "
                "rows, which must be 0"
            ),
            "O": "largest per-sample output size (ragged batches are padded to it)",
        },
        "workloads": {},
    }
    load = load_average()
    if load is not None and load[0] > (os.cpu_count() or 1):
        _log(
            f"warning: load average {load[0]} exceeds {os.cpu_count()} CPUs; timings will be "
            "noisy (torch's OpenMP threads suffer badly from oversubscription; --threads 1 helps)"
        )
    # Memory first: Linux carries the parent's peak RSS into a child's ru_maxrss at exec, so
    # the workers are started while this process holds nothing but torch.
    memory: dict[str, dict[str, dict[str, Any]]] = {}
    if not args.no_memory:
        for name in args.workloads:
            memory[name] = measure_memory(name, args, device)
    for name in args.workloads:
        results["workloads"][name] = bench_workload(name, args, device, memory.get(name, {}))
        write_json(out_path, results)  # partial results survive an interrupted run
    results["env"]["load_average_at_end"] = load_average()
    write_json(out_path, results)
    print_table(results)
    print(f"\nwrote {out_path}")
    return 0


# ---------------------------------------------------------------------- worker process
def worker_process(args: argparse.Namespace) -> int:
    name, method = args.worker
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    wl = build_workload(name, quick=args.quick, device=device, seed=args.seed)
    wl.train_batches = []  # not needed here
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = measure_peak_memory(lambda: run_method(wl, method), device)
    rec.update({"workload": name, "method": method, "torch_threads": torch.get_num_threads()})
    rec["caveat"] = MEMORY_CAVEAT_CUDA if device.type == "cuda" else MEMORY_CAVEAT_CPU
    print(json.dumps(rec))
    return 0


# ---------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(
            "Per-sample Jacobian benchmark: loop reference vs vmap rev/fwd vs auto on a uniform "
            "ConvBlock and a ragged TinyFPN workload. Reports time (absolute and as a ratio to "
            "one training step), peak memory (fresh subprocess per method) and max abs "
            "difference from the loop."
        ),
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small workloads (convblock N=4, O=928, P=60; fpn N=8 with smaller maps); writes "
        "bench_jacobian_quick.json instead of bench_jacobian.json",
    )
    ap.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where to run (default: cpu)"
    )
    ap.add_argument(
        "--out", default=None, help=f"output directory (default: {DEFAULT_OUT})", metavar="DIR"
    )
    ap.add_argument(
        "--workloads",
        nargs="+",
        default=list(WORKLOADS),
        choices=WORKLOADS,
        metavar="W",
        help=f"workloads to run, from {', '.join(WORKLOADS)} (default: all)",
    )
    ap.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        metavar="M",
        help=f"methods to run, from {', '.join(METHODS)} (default: all; without loop: no max-diff check)",
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="max warm runs per method (default 5, --quick 3)"
    )
    ap.add_argument(
        "--warm-limit",
        type=float,
        default=10.0,
        metavar="S",
        help="warm repeats only when the cold run took less than S seconds (default: 10)",
    )
    ap.add_argument(
        "--repeat-budget",
        type=float,
        default=20.0,
        metavar="S",
        help="stop warm repeats once they have used S seconds; at least one runs (default: 20)",
    )
    ap.add_argument(
        "--train-repeats",
        type=int,
        default=None,
        help="timed training steps per measurement, after one warm-up (default 5, --quick 3)",
    )
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory workers")
    ap.add_argument(
        "--worker-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="per memory worker (default: 1800)",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seed for model, inputs and indices (default: 0)"
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    ap.add_argument(
        "--worker",
        nargs=2,
        metavar=("WORKLOAD", "METHOD"),
        default=None,
        help="internal: run one method once in this (fresh) process and print its peak memory "
        "as one JSON line",
    )
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.train_repeats is None:
        args.train_repeats = 3 if args.quick else 5
    if args.worker is not None:
        wl_name, method = args.worker
        if wl_name not in WORKLOADS or method not in METHODS:
            ap.error(f"--worker needs a workload in {WORKLOADS} and a method in {METHODS}")
    return args


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_process(args)
    return main_process(args)


if __name__ == "__main__":
    sys.exit(main())
