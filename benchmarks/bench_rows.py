"""What knowing which sample each row belongs to costs, and what the loop costs (docs/
benchmarks.md). Writes ``benchmarks/results/bench_rows.json`` and prints the tables.

``--grid speed --old TREE``: the library's default call on the main grid's fisher and jacnorm
cells at this checkout and at another source tree (``git worktree add``), a fresh worker per
tree and cell in alternating order each round, in training steps. ``--grid loop``: a model that
cannot run vectorised over samples (:class:`RoIHead`), the user's per-sample ``jacrev`` loop
against the library's first, second and warm calls and ``strategy="loop"``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import env_stamp, markdown_table, measure_peak_memory, run_worker, write_json
from torch import Tensor, nn
from torch.func import functional_call, jacrev

HERE = Path(__file__).resolve().parent
_NEW = ("tanh_cnn", "gelu_cnn", "gn_dw", "transformer")
CELLS = [f"fisher/{m}" for m in ("vgg11_bn_q", "resnet8", *_NEW)]
CELLS += [f"jacnorm/{m}" for m in ("cnn3", "cnn8", *_NEW)]


# ---------------------------------------------------------------------- speed: two trees
def speed_worker(cell_id: str, calls: int) -> dict[str, Any]:
    """In a fresh process whose ``multiscale_jac`` is the tree under test."""
    import bench_peers as bp

    import multiscale_jac as mj

    workload, model = cell_id.split("/")
    torch.set_num_threads(2)
    cell = bp.build_cell(workload, model, quick=False)
    run = bp.library()(cell, cell.model)
    step = bp.train_step(cell, cell.model)

    def timed(fn: Any) -> float:
        t = time.perf_counter()
        fn(cell.batch)
        return time.perf_counter() - t

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = timed(run)
        run(cell.batch)
        times, steps = zip(*[(timed(run), timed(step)) for _ in range(calls)])
    return {
        "library": mj.__file__,
        "first_s": first,
        "call_s": statistics.median(times),
        "step_s": statistics.median(steps),
    }


def speed_grid(args: argparse.Namespace) -> dict[str, Any]:
    trees = {"old": Path(args.old).resolve(), "new": HERE.parent}
    cells_run = args.cells.split(",") if args.cells else CELLS
    runs: dict[str, Any] = {c: {"old": [], "new": []} for c in cells_run}
    for r in range(args.rounds):
        for k, cell in enumerate(cells_run):
            order = ["old", "new"] if (r + k) % 2 == 0 else ["new", "old"]
            for tree in order:
                env = {"PYTHONPATH": f"{trees[tree]}:{HERE}"}
                cmd = [str(Path(__file__)), "--worker", cell, "--calls", str(args.calls)]
                rec = run_worker(cmd, timeout_s=1200, env=env)
                runs[cell][tree].append(rec)
                print(f"round {r} {cell} {tree}: {json.dumps(rec)[:160]}", flush=True)
    cells: dict[str, Any] = {}
    for cell, by_tree in runs.items():
        pairs = [
            (o["call_s"] / o["step_s"], n["call_s"] / n["step_s"], n["call_s"] / o["call_s"])
            for o, n in zip(by_tree["old"], by_tree["new"])
            if "call_s" in o and "call_s" in n
        ]
        if not pairs:
            cells[cell] = {"error": [x.get("error") for x in by_tree["old"] + by_tree["new"]]}
            continue
        old = statistics.median(p[0] for p in pairs)
        new = statistics.median(p[1] for p in pairs)
        cells[cell] = {
            "old_steps": old,
            "new_steps": new,
            "ratio": new / old,
            "paired": statistics.median(p[1] / p[0] for p in pairs),
            "seconds": statistics.median(p[2] for p in pairs),
            "rounds": len(pairs),
            "runs": by_tree,
        }
    return {"trees": {k: str(v) for k, v in trees.items()}, "cells": cells}


def speed_table(cells: dict[str, Any]) -> str:
    keys = ("old_steps", "new_steps", "ratio", "paired", "seconds")
    rows = [
        [cell, c["rounds"], *(f"{c[k]:.2f}" for k in keys)]
        for cell, c in cells.items()
        if "ratio" in c
    ]
    heads = ["cell", "rounds", "old (steps)", "new (steps)", "new / old", "paired", "seconds"]
    return markdown_table(heads, rows)


# ---------------------------------------------------------------------- loop: a model that does not vmap
@torch.library.custom_op("mj_bench::level_pool", mutates_args=())
def level_pool(x: Tensor, boxes: Tensor, size: int) -> Tensor:
    """Average of each box's window of ``x`` ``(C, H, W)`` resized to ``size x size``: an op
    with no batching rule (vmap loops over it, as it does over torchvision's RoI ops)."""
    out = [
        F.adaptive_avg_pool2d(x[:, int(b[1]) : int(b[3]), int(b[0]) : int(b[2])], size)
        for b in boxes.tolist()
    ]
    return torch.stack(out)


@level_pool.register_fake
def _(x: Tensor, boxes: Tensor, size: int) -> Tensor:
    return x.new_empty(boxes.shape[0], x.shape[0], size, size)


def _pool_backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
    x_shape, boxes, size = ctx.x_shape, ctx.boxes, ctx.size
    gx = g.new_zeros(x_shape)
    for k, b in enumerate(boxes.tolist()):
        h, w = int(b[3]) - int(b[1]), int(b[2]) - int(b[0])
        win = F.interpolate(g[k : k + 1], size=(h, w), mode="nearest")[0] * (size * size / (h * w))
        gx[:, int(b[1]) : int(b[3]), int(b[0]) : int(b[2])] += win
    return gx, None, None


def _setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    ctx.x_shape, ctx.boxes, ctx.size = inputs[0].shape, inputs[1], inputs[2]


level_pool.register_autograd(_pool_backward, setup_context=_setup)


class RoIHead(nn.Module):
    """Boxes pooled from the level their size picks, written into a buffer made in the
    forward pass (``MultiScaleRoIAlign``'s pattern), then a two-layer box head per box."""

    def __init__(self, channels: int = 16, boxes: int = 8, rep: int = 64, classes: int = 5):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        xy = torch.randint(0, 24, (boxes, 2), generator=g).float()
        wh = torch.randint(4, 16, (boxes, 2), generator=g).float()
        self.register_buffer("boxes", torch.cat([xy, xy + wh], 1))
        self.fc6 = nn.Linear(channels * 16, rep)
        self.fc7 = nn.Linear(rep, rep)
        self.cls = nn.Linear(rep, classes)

    def forward(self, levels: list[Tensor]) -> Tensor:
        p2, p3 = levels
        n, k = p2.shape[0], self.boxes.shape[0]
        big = (self.boxes[:, 2] - self.boxes[:, 0]) > 10
        pooled = torch.zeros(n, k, p2.shape[1], 4, 4, dtype=p2.dtype, device=p2.device)
        for i in range(n):
            pooled[i, ~big] = level_pool(p2[i], self.boxes[~big], 4)
            pooled[i, big] = level_pool(p3[i], self.boxes[big] / 2, 4)
        h = F.relu(self.fc7(F.relu(self.fc6(pooled.flatten(2)))))
        return self.cls(h).flatten(1)


def _loop_setup(n: int) -> tuple[nn.Module, list[Tensor], list[str]]:
    torch.manual_seed(0)
    model = RoIHead().eval()
    g = torch.Generator().manual_seed(1)
    levels = [torch.randn(n, 16, 40, 40, generator=g), torch.randn(n, 16, 20, 20, generator=g)]
    return model, levels, ["fc6.*", "fc7.*", "cls.*"]


def user_jacrev_loop(model: nn.Module, levels: list[Tensor]) -> Tensor:
    """What a user writes: ``jacrev`` of each sample (a batch of one) w.r.t. the head."""
    params = dict(model.named_parameters())
    names = [n for n in params if not n.startswith("boxes")]
    sub = {n: params[n].detach() for n in names}
    rows = []
    for i in range(levels[0].shape[0]):
        x = [t[i : i + 1] for t in levels]

        def f(p: dict[str, Tensor], x: list[Tensor] = x) -> Tensor:
            return functional_call(model, {**params, **p}, (x,)).reshape(-1)

        jac = jacrev(f)(sub)
        rows.append(torch.cat([jac[n].reshape(jac[n].shape[0], -1) for n in names], 1))
    return torch.stack(rows)


def loop_grid(args: argparse.Namespace) -> dict[str, Any]:
    import multiscale_jac as mj

    torch.set_num_threads(2)
    model, levels, params = _loop_setup(args.n)
    step_model = RoIHead().train()
    opt = torch.optim.SGD(step_model.parameters(), lr=1e-4)

    def train_step() -> None:
        opt.zero_grad()
        step_model(levels).square().sum().backward()
        opt.step()

    def library(**kw: Any) -> Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return mj.per_sample_jacobian(model, levels, params=params, **kw).jacobian

    want = user_jacrev_loop(model, levels)
    mj.clear_plan_cache()
    firsts = {}
    for name in ("first", "second"):
        t = time.perf_counter()
        got = library()
        firsts[name] = time.perf_counter() - t
    res = mj.per_sample_jacobian(model, levels, params=params)
    err = float((got - want).abs().max() / want.abs().max())
    methods = {
        "user jacrev loop": lambda: user_jacrev_loop(model, levels),
        "library, auto (warm)": library,
        "library, strategy='loop'": lambda: library(strategy="loop"),
        "training step": train_step,
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(args.rounds):
        for k, f in methods.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    user = med["user jacrev loop"]
    rows = [[f"library, auto: {k} call", firsts[k]] for k in ("first", "second")]
    rows = [[k, f"{v * 1e3:.1f}", f"{v / user:.2f}"] for k, v in [*rows, *med.items()]]
    worker = [str(Path(__file__)), "--n", str(args.n), "--memory"]
    memory = {k: run_worker([*worker, k], timeout_s=600) for k in ("user", "auto", "loop")}
    table = markdown_table(["method", "ms", "/ user's jacrev loop"], rows)
    return {
        "N": args.n,
        "strategy": str(res.strategy),
        "fallback": res.fallback,
        "max_relative_error": err,
        "first_s": firsts,
        "median_s": med,
        "step_ratio": {k: v / med["training step"] for k, v in med.items()},
        "times": times,
        "memory": memory,
        "table": table,
    }


def memory_worker(which: str, n: int) -> dict[str, Any]:
    import multiscale_jac as mj

    torch.set_num_threads(2)
    model, levels, params = _loop_setup(n)
    warnings.simplefilter("ignore")
    calls = {
        "user": lambda: user_jacrev_loop(model, levels),
        "auto": lambda: mj.per_sample_jacobian(model, levels, params=params),
        "loop": lambda: mj.per_sample_jacobian(model, levels, params=params, strategy="loop"),
    }
    return measure_peak_memory(calls[which], "cpu")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grid", choices=("speed", "loop"), default="loop")
    p.add_argument("--old", help="the other source tree (--grid speed)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5, help="warm calls per worker (--grid speed)")
    p.add_argument("--n", type=int, default=16, help="samples (--grid loop)")
    p.add_argument("--cells", help="comma-separated cells (--grid speed; default: all)")
    p.add_argument("--out", default=str(HERE / "results" / "bench_rows.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--memory", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(speed_worker(args.worker, args.calls)))
        return 0
    if args.memory:
        print(json.dumps(memory_worker(args.memory, args.n)))
        return 0
    if args.grid == "speed" and not args.old:
        p.error("--grid speed needs --old PATH (the source tree to compare with)")
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    result = speed_grid(args) if args.grid == "speed" else loop_grid(args)
    if args.grid == "speed":  # a run of some cells replaces those cells only
        kept = results.get("speed", {}).get("cells", {}) if args.cells else {}
        result["cells"] = {**kept, **result["cells"]}
        result["table"] = speed_table(result["cells"])
    results[args.grid] = {"env": env_stamp("cpu"), **result}
    write_json(out, results)
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
