"""Benchmark: is the cost model's choice (``mode="auto"``, ``entries="auto"``) ever the slowest?

For every model of the test zoo (``tests/cases.py``) and two subsets (a few entries of every
tensor; the case's tensors by name), time the four fixed combinations ``mode`` x ``entries``
(``rev``/``fwd`` x ``generic``/``structured``) and the auto path, each the minimum of
``--repeats`` runs after a warm-up, all with the same strategy (``vmap``/``bucketed``), and a
training step on the same batch in the same run (auto's time is also given as a ratio to it). A row
passes when auto is not slower than the slowest fixed combination (with a 10% allowance for
timer noise); it also records auto's rank and its ratio to the fastest. Results:
``benchmarks/results/bench_choice.json`` and a table on stdout.

Usage::

    python benchmarks/bench_choice.py [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from _common import REPO_ROOT, env_stamp, markdown_table, write_json
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(REPO_ROOT / "tests"))

from cases import CASES, make_subset

from multiscale_jac import (
    InputKind,
    Layout,
    PackedBatch,
    ParamSubset,
    pack,
    per_sample_jacobian,
)

COMBOS = [(m, e) for m in ("rev", "fwd") for e in ("generic", "structured")]
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def entries_subset(model: torch.nn.Module) -> ParamSubset:
    g = torch.Generator().manual_seed(0)
    chosen = {}
    for name, p in model.named_parameters():
        n = p.numel()
        chosen[name] = torch.randperm(n, generator=g)[: max(1, min(8, n // 3))]
    return ParamSubset.from_indices(model, chosen)


def training_step(model: torch.nn.Module, case: Any) -> Any:
    """One ordinary training step on the case's batch: forward of every shape bucket (samples
    stacked), the sum of the outputs backward, gradients accumulating over buckets."""
    inputs = case.inputs()
    packed = inputs if isinstance(inputs, PackedBatch) else pack(inputs)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for b in packed.buckets():
            levels = packed.stack(b.indices)
            if packed.layout is Layout.NESTED:  # the model takes tokens (B, positions, C)
                levels = [t.flatten(2).transpose(1, 2) for t in levels]
            out = model(levels[0] if packed.kind is InputKind.TENSOR else levels)
            if case.output_fn is not None:
                out = case.output_fn(out)
            sum(t.sum() for t in tree_leaves(out)).backward()  # tensor, list or dict output

    return step


def best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    rows: list[dict[str, Any]] = []
    for case in CASES:
        model = case.build()
        for kind in ("entries", "names"):
            subset = entries_subset(model) if kind == "entries" else make_subset(model, kind, case)
            inputs = case.inputs()
            strategy = "bucketed" if case.ragged else "vmap"

            def run(
                mode: str,
                entries: str,
                model=model,
                inputs=inputs,
                subset=subset,
                case=case,
                strategy=strategy,
            ) -> Any:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return per_sample_jacobian(
                        model,
                        inputs,
                        params=subset,
                        output_fn=case.output_fn,
                        mode=mode,
                        entries=entries,
                        strategy=strategy,
                    )

            times = {
                f"{m}/{e}": best_time(lambda m=m, e=e: run(m, e), args.repeats) for m, e in COMBOS
            }
            auto_t = best_time(lambda: run("auto", "auto"), args.repeats)
            res = run("auto", "auto")
            train_t = best_time(training_step(model, case), args.repeats)
            model.zero_grad(set_to_none=True)
            slowest, fastest = max(times.values()), min(times.values())
            rows.append(
                {
                    "case": case.id,
                    "subset": kind,
                    "P": subset.numel,
                    "times": times,
                    "auto_seconds": auto_t,
                    "train_step_seconds": train_t,
                    "auto_x_train_step": auto_t / train_t,
                    "auto_ran": f"{res.mode.value}, structured {len(res.structured)}/{len(subset.names)}",
                    "auto_rank": 1 + sum(t < auto_t for t in times.values()),
                    "auto_over_fastest": auto_t / fastest,
                    "passes": auto_t <= 1.1 * slowest,
                }
            )
            print(
                f"{case.id}/{kind}: auto {auto_t * 1e3:.1f} ms, rank {rows[-1]['auto_rank']}",
                file=sys.stderr,
            )
    out = Path(args.out) if args.out else DEFAULT_OUT
    write_json(
        out / "bench_choice.json",
        {"benchmark": "bench_choice", "env": env_stamp("cpu"), "rows": rows},
    )
    print(
        markdown_table(
            [
                "case",
                "subset",
                "P",
                *[f"{m}/{e} ms" for m, e in COMBOS],
                "auto ms",
                "train step ms",
                "auto x train step",
                "auto ran",
                "rank (of 5)",
                "auto / fastest",
                "not slowest",
            ],
            [
                [
                    r["case"],
                    r["subset"],
                    r["P"],
                    *[f"{r['times'][f'{m}/{e}'] * 1e3:.1f}" for m, e in COMBOS],
                    f"{r['auto_seconds'] * 1e3:.1f}",
                    f"{r['train_step_seconds'] * 1e3:.2f}",
                    f"{r['auto_x_train_step']:.0f}",
                    r["auto_ran"],
                    r["auto_rank"],
                    f"{r['auto_over_fastest']:.2f}",
                    "yes" if r["passes"] else "NO",
                ]
                for r in rows
            ],
        )
    )
    failed = [r for r in rows if not r["passes"]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} rows: auto not the slowest")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out")
    sys.exit(main(p.parse_args()))
