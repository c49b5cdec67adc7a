"""Benchmark W2: the gradient of the Jacobian-norm regulariser (seed thread 2).

Target: ``grad_theta S`` with ``S(theta) = sum_i ||d f(x_i) / d theta||^2`` for a network ``f``
with one scalar output per sample, over every parameter, as a flat ``(P,)`` vector in
``named_parameters`` order; float32 on CPU.

Models (defined here; no BatchNorm; input ``(n, 3, 32, 32)`` random from a fixed seed; a
``Linear(..., 1)`` head; about 0.45M parameters each, printed by ``--check``)
    cnn3   3 conv layers (64/128/320 channels, 3x3, ReLU, 2x2 max pooling after each), linear
    cnn8   8 conv layers (32/32/64/64/96/96/128/128 channels, 3x3, ReLU, 2x2 max pooling after
           every second), linear
    n in {10, 128} (``--quick``: n = 4).

Methods (each returns the flat ``(P,)`` gradient of ``S``)
    train_step        the reference: forward, MSE to zero, backward, SGD step, zero_grad (on a
                      copy of the model)
    loop              per sample: ``autograd.grad(f_i, create_graph=True)``, its squared norm,
                      ``autograd.grad`` of that (double backward; the plain-PyTorch baseline
                      and the reference of ``diff`` and ``--check``)
    jacrev_full       ``torch.func.grad`` of ``p -> (jacrev(f)(p) ** 2).sum()`` with ``f`` the
                      ``(n,)`` outputs of the batch (the full ``n x P`` Jacobian, what users
                      write in JAX); not run when its estimated memory exceeds ``--max-gb``
    vmap_grad_chunks  16 samples a chunk: ``torch.func.grad`` of
                      ``p -> (vmap(grad(f_single), in_dims=(None, 0))(p, x_chunk) ** 2).sum()``
    fwd_over_rev      16 samples a chunk: ``g_i = vmap(grad(f_single))``, then
                      ``grad S = 2 sum_i H_i g_i`` with ``jvp(grad(f_single), (p,), (g_i,))``
                      vmapped over the samples
    library           ``multiscale_jac.jacobian_sq_norm_backward(model, x, scale=1.0)`` (adds
                      into ``.grad``; the gradients are cleared first and read back)

Measurement as in ``bench_fisher`` (whose helpers this script uses): one fresh worker process per
(workload, method) cell started before the parent builds anything; a two-sample warm-up, one run
on the batch with its peak RSS rise measured, ``--repeats`` more (``seconds`` = their median),
then the training step timed in the same process (a warm-up, the median of 5) for ``x train
step``; the training step's peak memory from its own cell (``train_step``) for ``x train-step
memory``; ``diff`` against ``loop`` on the first two samples.

``--check`` runs every method on n = 3 for both models in one process and verifies that it
agrees with ``loop`` to ``--check-tol`` (1e-4) relative; the exit status is 1 if one does not.

Results: ``benchmarks/results/bench_jacnorm.json`` (``bench_jacnorm_quick.json``,
``bench_jacnorm_check.json``) and a markdown table on stdout.

Usage::

    python benchmarks/bench_jacnorm.py                 # full run (long on 2 CPU cores)
    python benchmarks/bench_jacnorm.py --quick         # n = 4
    python benchmarks/bench_jacnorm.py --check         # correctness of every method, n = 3
    python benchmarks/bench_jacnorm.py --models cnn8 --sizes 128 --methods train_step library
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import MEMORY_CAVEAT_CPU, env_stamp, write_json
from bench_fisher import (
    ALL,
    WARM_SAMPLES,
    activation_numels,
    check_table,
    grid_table,
    guarded,
    log,
    measure_cell,
    rel_diff,
    run_grid,
)
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, jvp, vmap

MODELS = ("cnn3", "cnn8")
SIZES = (10, 128)
QUICK_SIZES = (4,)
CHECK_N = 3
METHODS = ("train_step", "loop", "jacrev_full", "vmap_grad_chunks", "fwd_over_rev", "library")
WIDTHS = {"cnn3": (64, 128, 320), "cnn8": (32, 32, 64, 64, 96, 96, 128, 128)}
CHUNK = 16
SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results"


# ---------------------------------------------------------------------- models
class PlainCNN(nn.Module):
    """3x3 convolutions with ReLU, 2x2 max pooling every ``pool_every`` layers, a scalar head."""

    def __init__(self, widths: tuple[int, ...], pool_every: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in, size = 3, 32
        for k, c in enumerate(widths, 1):
            layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU()]
            if k % pool_every == 0:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            c_in = c
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in * size * size, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).flatten(1))


def build_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if name not in WIDTHS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return PlainCNN(WIDTHS[name], pool_every=1 if name == "cnn3" else 2).eval()


class Workload:
    """A scalar-output CNN, ``n`` inputs and a training step on a copy of the model."""

    def __init__(self, model_name: str, n: int, seed: int) -> None:
        self.model_name, self.n = model_name, n
        self.model = build_model(model_name, seed)
        self.x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed + 1))
        self.names = [name for name, _ in self.model.named_parameters()]
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.description = (
            f"{model_name} float32, {self.numel} parameters, conv widths "
            f"{list(WIDTHS[model_name])}, batch {n} of (3, 32, 32), scalar output"
        )
        self._train: nn.Module | None = None
        self._opt: torch.optim.Optimizer | None = None

    def params(self) -> dict[str, Tensor]:
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def flat(self, per_tensor: dict[str, Tensor]) -> Tensor:
        return torch.cat([per_tensor[name].reshape(-1) for name in self.names])

    def prepare_train_step(self) -> None:
        self._train = copy.deepcopy(self.model).train()
        self._opt = torch.optim.SGD(self._train.parameters(), lr=1e-3)

    def train_step(self, samples: slice = ALL) -> None:
        """Forward, MSE to zero, backward, SGD step, zero_grad (on a copy)."""
        if self._train is None or self._opt is None:
            self.prepare_train_step()
        assert self._train is not None and self._opt is not None
        out = self._train(self.x[samples])
        F.mse_loss(out, torch.zeros_like(out)).backward()
        self._opt.step()
        self._opt.zero_grad(set_to_none=True)

    def estimate_bytes(self, method: str) -> dict[str, int] | None:
        if method != "jacrev_full":
            return None
        acts = activation_numels(self.model, self.x)
        jac = self.n * self.numel * 4 * 3
        # jacrev vmaps one backward lane per output (n) through the whole batch (n), and the
        # outer grad keeps every layer's lane tensors for its own backward
        backward = self.n * self.n * sum(acts) * 4 * 2
        return {"jacobian": jac, "vectorised_backward": backward, "total": jac + backward}

    # ------------------------------------------------------------------ the scalar output
    def f_single(self, p: dict[str, Tensor], xi: Tensor) -> Tensor:
        return functional_call(self.model, p, (xi.unsqueeze(0),)).reshape(())


# ---------------------------------------------------------------------- methods
def _loop(wl: Workload, samples: slice) -> Tensor:
    params = list(wl.model.parameters())
    acc = [torch.zeros_like(p) for p in params]
    x = wl.x[samples]
    for i in range(x.shape[0]):
        out = wl.model(x[i : i + 1]).reshape(())
        g = torch.autograd.grad(out, params, create_graph=True)
        s = sum((t**2).sum() for t in g)
        hs = torch.autograd.grad(s, params, allow_unused=True)  # the head's bias is unused
        for a, h in zip(acc, hs):
            if h is not None:
                a.add_(h)
    return torch.cat([a.reshape(-1) for a in acc])


def _jacrev_full(wl: Workload, samples: slice) -> Tensor:
    x = wl.x[samples]

    def outputs(p: dict[str, Tensor]) -> Tensor:
        return functional_call(wl.model, p, (x,)).reshape(-1)

    def sq_norm(p: dict[str, Tensor]) -> Tensor:
        return sum((j**2).sum() for j in jacrev(outputs)(p).values())

    return wl.flat(grad(sq_norm)(wl.params()))


def _vmap_grad_chunks(wl: Workload, samples: slice) -> Tensor:
    params, x = wl.params(), wl.x[samples]
    per_sample = vmap(grad(wl.f_single), in_dims=(None, 0))

    def sq_norm(p: dict[str, Tensor], xc: Tensor) -> Tensor:
        return sum((g**2).sum() for g in per_sample(p, xc).values())

    acc = {name: torch.zeros_like(p) for name, p in params.items()}
    for s in range(0, x.shape[0], CHUNK):
        for name, g in grad(sq_norm)(params, x[s : s + CHUNK]).items():
            acc[name] += g
    return wl.flat(acc)


def _fwd_over_rev(wl: Workload, samples: slice) -> Tensor:
    params, x = wl.params(), wl.x[samples]
    g_single = grad(wl.f_single)

    def hvp(xi: Tensor, gi: dict[str, Tensor]) -> dict[str, Tensor]:
        return jvp(lambda p: g_single(p, xi), (params,), (gi,))[1]

    acc = {name: torch.zeros_like(p) for name, p in params.items()}
    for s in range(0, x.shape[0], CHUNK):
        xc = x[s : s + CHUNK]
        g = vmap(g_single, in_dims=(None, 0))(params, xc)
        for name, h in vmap(hvp)(xc, g).items():
            acc[name] += 2 * h.sum(0)
    return wl.flat(acc)


def _prepare_library(wl: Workload, info: dict[str, Any]) -> Callable[[slice], Tensor]:
    from multiscale_jac import jacobian_sq_norm_backward

    def run(samples: slice) -> Tensor:
        wl.model.zero_grad(set_to_none=True)
        s = jacobian_sq_norm_backward(wl.model, wl.x[samples], scale=1.0)
        info["S"] = float(s)
        for attr in ("method", "notes", "plan"):  # should the result ever say how it ran
            if getattr(s, attr, None) is not None:
                info[attr] = str(getattr(s, attr))
        named = dict(wl.model.named_parameters())
        out = wl.flat(
            {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in named.items()}
        )
        wl.model.zero_grad(set_to_none=True)
        return out

    return run


def prepare(wl: Workload, method: str, info: dict[str, Any]) -> Callable[[slice], Any]:
    """The method as a function of a slice of the batch (setup such as copies done here)."""
    if method == "train_step":
        wl.prepare_train_step()
        return wl.train_step
    if method == "library":
        return _prepare_library(wl, info)
    fns = {
        "loop": _loop,
        "jacrev_full": _jacrev_full,
        "vmap_grad_chunks": _vmap_grad_chunks,
        "fwd_over_rev": _fwd_over_rev,
    }
    if method not in fns:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    fn = fns[method]
    return lambda s: fn(wl, s)


# ---------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> int:
    model_name, n, method = args.worker[0], int(args.worker[1]), args.worker[2]
    if args.threads:
        torch.set_num_threads(args.threads)
    wl = Workload(model_name, n, args.seed)
    rec: dict[str, Any] = {"description": wl.description, "params": wl.numel}
    est = wl.estimate_bytes(method)
    if est is not None:
        rec["estimated_bytes"] = est
        if est["total"] > args.max_gb * 2**30:
            rec["skipped"] = (
                f"not run: estimated {est['total'] / 2**30:.1f} GiB (> --max-gb {args.max_gb:g})"
            )
            print(json.dumps(rec))
            return 0
    info: dict[str, Any] = {}
    run = prepare(wl, method, info)
    train = None if method == "train_step" else wl.train_step
    rec.update(measure_cell(run, train, repeats=args.repeats, warm_limit_s=args.warm_limit))
    if method != "train_step":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = run(WARM_SAMPLES)
            ref = _loop(wl, WARM_SAMPLES) if method != "loop" else got
        rec["max_abs_diff_vs_loop"], rec["rel_diff_vs_loop"] = rel_diff(got, ref)
    if method == "library":
        rec["library"] = info
    print(json.dumps(rec))
    return 0


# ---------------------------------------------------------------------- check
def check(args: argparse.Namespace) -> int:
    """Every method on ``--check-n`` samples of every model against ``loop``."""
    models = args.models or list(MODELS)
    rows: list[dict[str, Any]] = []
    failed = False
    counts = {}
    for model_name in models:
        wl = Workload(model_name, args.check_n, args.seed)
        counts[model_name] = wl.numel
        log(f"{model_name}: {wl.numel} parameters")
        ref = _loop(wl, ALL)
        for method in METHODS:
            if method in ("train_step", "loop"):
                continue
            info: dict[str, Any] = {}
            row: dict[str, Any] = {"model": model_name, "n": args.check_n, "method": method}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = prepare(wl, method, info)(ALL)
            except Exception as e:
                failed = True
                row["result"] = f"ERROR: {type(e).__name__}: {e}"[:500]
                rows.append(row)
                log(f"{model_name} / {method}: {row['result']}")
                continue
            row["max_abs_diff"], row["rel_diff"] = rel_diff(got, ref)
            ok = row["rel_diff"] <= args.check_tol
            failed |= not ok
            row["result"] = "ok" if ok else f"FAIL (> {args.check_tol:g})"
            if info:
                row["info"] = info
            rows.append(row)
            log(f"{model_name} / {method}: rel diff {row['rel_diff']:.2e} {row['result']}")
    out_dir = Path(args.out) if args.out else DEFAULT_OUT
    out_path = write_json(
        out_dir / "bench_jacnorm_check.json",
        {
            "benchmark": "bench_jacnorm --check",
            "env": env_stamp("cpu"),
            "config": {"n": args.check_n, "tol": args.check_tol, "seed": args.seed},
            "parameters": counts,
            "notes": {"rel_diff": "max |method - loop| / max |loop| over the flat grad S"},
            "rows": rows,
        },
    )
    print("parameters: " + ", ".join(f"{m} {c}" for m, c in counts.items()))
    print(check_table(rows))
    print(f"\nwrote {out_path}")
    return 1 if failed else 0


# ---------------------------------------------------------------------- main
def main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out) if args.out else DEFAULT_OUT
    out_path = out_dir / ("bench_jacnorm_quick.json" if args.quick else "bench_jacnorm.json")
    models = args.models or list(MODELS)
    sizes = args.sizes or list(QUICK_SIZES if args.quick else SIZES)
    results: dict[str, Any] = {
        "benchmark": "bench_jacnorm",
        "workload": "grad of S = sum_i ||d f(x_i)/d theta||^2, scalar output, all parameters",
        "env": env_stamp("cpu"),
        "config": {
            "quick": args.quick,
            "seed": args.seed,
            "max_gb": args.max_gb,
            "repeats": args.repeats,
            "warm_limit_s": args.warm_limit,
            "threads": args.threads or torch.get_num_threads(),
            "chunk": CHUNK,
        },
        "notes": {
            "seconds": "median of --repeats runs after a warm-up on the batch, fresh process",
            "ratio_to_train_step": (
                "seconds / median of 5 training steps (after a warm-up) in the same process; "
                "the step: forward, MSE to zero, backward, SGD, zero_grad on a copy"
            ),
            "peak_memory_bytes": MEMORY_CAVEAT_CPU,
            "memory_ratio_to_train_step": (
                "peak_memory_bytes / that of the train_step cell (its own fresh worker)"
            ),
            "rel_diff_vs_loop": "max |method - loop| / max |loop| on the first two samples",
            "estimated_bytes": (
                "jacrev_full: n*P*4*3 (the Jacobian) + n^2*sum(layer outputs)*4*2 (the "
                "vectorised backward kept for the outer grad)"
            ),
        },
        "workloads": {},
    }
    grid = [(f"{m}-n{n}", [m, str(n)], {"model": m, "n": n}) for m in models for n in sorted(sizes)]
    run_grid(
        script=SCRIPT,
        results=results,
        workloads=grid,
        methods=args.methods,
        passthrough=_passthrough(args),
        timeout_s=args.timeout,
        out_path=out_path,
    )
    write_json(out_path, results)
    print(grid_table(results, "loop"))
    print(f"\nwrote {out_path}")
    return 0


def _passthrough(args: argparse.Namespace) -> list[str]:
    out = ["--seed", str(args.seed), "--max-gb", str(args.max_gb)]
    out += ["--repeats", str(args.repeats), "--warm-limit", str(args.warm_limit)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="n=4 (seconds per cell)")
    p.add_argument("--check", action="store_true", help="verify every method against loop")
    p.add_argument("--check-n", type=int, default=CHECK_N, help="samples for --check (3)")
    p.add_argument("--check-tol", type=float, default=1e-4, help="relative tolerance (1e-4)")
    p.add_argument("--models", nargs="*", choices=MODELS, help="default: both")
    p.add_argument("--sizes", nargs="*", type=int, help="batch sizes n (default: 10 128)")
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--max-gb", type=float, default=6.0, help="skip jacrev_full above this estimate")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    p.add_argument(
        "--warm-limit", type=float, default=30.0, help="no repeats when one run takes longer (s)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker")
    p.add_argument("--out", help="output folder (default: benchmarks/results)")
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "N", "METHOD"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if args.worker:
        sys.exit(guarded(worker, args))
    sys.exit(check(args) if args.check else main(args))
