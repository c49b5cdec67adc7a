"""Benchmark: the diagonal empirical Fisher (EWC) on CIFAR-sized CNNs.

Target: ``F = 1/N sum_i (grad_theta log p(y_i | x_i))^2`` over every parameter, as a flat
``(P,)`` vector in ``named_parameters`` order; float32 on CPU.

Models (defined here; float32, eval mode; the BatchNorm running statistics are set by a few
seeded forward passes in train mode at build time; random CIFAR-shaped data ``(N, 3, 32, 32)``
with 10 classes from a fixed seed)
    vgg11_bn_q   CIFAR VGG11 with BatchNorm (cfg 64,M,128,M,256,256,M,512,512,M,512,512,M, then
                 Linear(512 w, 10)), channels x 1/4
    vgg11_bn_h   the same, channels x 1/2
    resnet8      CIFAR ResNet-8: conv3x3(16)+BN+ReLU, one BasicBlock per stage (16/32/64
                 channels, strides 1/2/2, 1x1 conv+BN shortcut when the shape changes), global
                 average pooling, Linear(64, 10)
    N in {64, 128} (``--quick``: N = 8, vgg11_bn_q and resnet8 only).

Methods (each returns the flat ``(P,)`` diagonal)
    train_step          the reference, not a Fisher: forward, CrossEntropy (sum), backward, SGD
                        step, zero_grad, on a copy of the model in train mode
    loop                one ``autograd.grad`` per sample, squared and summed
    jacobian_vectorize  the EWC code users write today (``_update_fisher_params``):
                        ``torch.autograd.functional.jacobian(f, params, vectorize=True)`` with
                        ``f(*params)`` the ``(N,)`` log-likelihoods via ``functional_call``; not
                        run when its estimated memory exceeds ``--max-gb``
    vmap_grad           ``torch.func`` ``vmap(grad(loss), in_dims=(None, 0, 0))`` over
                        ``functional_call``, 32 samples a chunk
    backpack            BackPACK ``SumGradSquared`` on an extended copy (when installed)
    opacus              Opacus ``GradSampleModule`` per-sample gradients (when installed)
    library             ``multiscale_jac.diag_fisher(kind="empirical")``

Every (workload, method) cell runs in a fresh worker process started before the parent builds
anything. The worker builds the model and data, warms the method up on two samples, runs it once
on the batch with its peak RSS rise measured (``_common.measure_peak_memory``; this run is also
the warm-up for timing), then ``--repeats`` more times (``seconds`` is their median), then times
the training step in the same process (a warm-up, then the median of 5): ``x train step`` is the
ratio of the two. The training step's own peak memory comes from its own cell (``train_step``),
measured the same way; ``x train-step memory`` is a method's peak over that one. Each method is
also compared with ``loop`` on two samples (``diff``: max abs difference over max abs value).

``--check`` runs every method on N = 4 for every model in one process and verifies that it
agrees with ``loop`` to ``--check-tol`` (1e-4) relative; the exit status is 1 if one does not.

Results: ``benchmarks/results/bench_fisher.json`` (``bench_fisher_quick.json``,
``bench_fisher_check.json``) and a markdown table on stdout.

Usage::

    python benchmarks/bench_fisher.py                  # full run (long on 2 CPU cores)
    python benchmarks/bench_fisher.py --quick          # N = 8, two models, well under a minute
    python benchmarks/bench_fisher.py --check          # correctness of every method, N = 4
    python benchmarks/bench_fisher.py --models resnet8 --sizes 64 --methods train_step library
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
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
    measure_peak_memory,
    median,
    run_worker,
    timed_call,
    write_json,
)
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

MODELS = ("vgg11_bn_q", "vgg11_bn_h", "resnet8")
SIZES = (64, 128)
QUICK_MODELS = ("vgg11_bn_q", "resnet8")
QUICK_SIZES = (8,)
CHECK_N = 4
METHODS = (
    "train_step",
    "loop",
    "jacobian_vectorize",
    "vmap_grad",
    "backpack",
    "opacus",
    "library",
)
VGG11_CFG: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]
VMAP_CHUNK = 32
TRAIN_STEP_REPEATS = 5
WARM_SAMPLES = slice(0, 2)
ALL = slice(None)
SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results"


class Skip(Exception):
    """A method that cannot run here (a peer library not installed, or one that fails)."""


# ---------------------------------------------------------------------- models
class VGG(nn.Module):
    """CIFAR VGG11 with BatchNorm, every width multiplied by ``scale``."""

    def __init__(self, scale: float, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for v in VGG11_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                c = int(int(v) * scale)
                layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()]
                c_in = c
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c_in, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu2 = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet8(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.layer1 = BasicBlock(16, 16, 1)
        self.layer2 = BasicBlock(16, 32, 2)
        self.layer3 = BasicBlock(32, 64, 2)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn(self.conv(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.fc(out.mean(dim=(2, 3)))


def build_model(name: str, seed: int) -> nn.Module:
    """The named model in eval mode, its BatchNorm running statistics set by three seeded
    forward passes in train mode (so that eval-mode BatchNorm is not the identity)."""
    torch.manual_seed(seed)
    if name == "vgg11_bn_q":
        model: nn.Module = VGG(0.25)
    elif name == "vgg11_bn_h":
        model = VGG(0.5)
    elif name == "resnet8":
        model = ResNet8()
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    g = torch.Generator().manual_seed(seed + 100)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(1.5 * torch.randn(32, 3, 32, 32, generator=g) + 0.2)
    return model.eval()


def activation_numels(model: nn.Module, x: Tensor) -> list[int]:
    """Per-sample output sizes of every leaf module on one sample (for memory estimates)."""
    sizes: list[int] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel()))
        for m in model.modules()
        if not list(m.children())
    ]
    try:
        with torch.no_grad():
            model(x[:1])
    finally:
        for h in hooks:
            h.remove()
    return sizes


class Workload:
    """A model, ``n`` inputs and class labels, and a training step on a copy of the model."""

    def __init__(self, model_name: str, n: int, seed: int) -> None:
        self.model_name, self.n = model_name, n
        self.model = build_model(model_name, seed)
        g = torch.Generator().manual_seed(seed + 1)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.names = [name for name, _ in self.model.named_parameters()]
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.description = (
            f"{model_name} float32 eval mode, {self.numel} parameters, batch {n} of "
            f"(3, 32, 32), 10 classes"
        )
        self._train: nn.Module | None = None
        self._opt: torch.optim.Optimizer | None = None

    def flat(self, per_tensor: dict[str, Tensor]) -> Tensor:
        """Concatenate per-tensor values in ``named_parameters`` order."""
        return torch.cat([per_tensor[name].reshape(-1) for name in self.names])

    def prepare_train_step(self) -> None:
        self._train = copy.deepcopy(self.model).train()
        self._opt = torch.optim.SGD(self._train.parameters(), lr=1e-3)

    def train_step(self, samples: slice = ALL) -> None:
        """Forward, CrossEntropy (sum), backward, SGD step, zero_grad (train-mode copy)."""
        if self._train is None or self._opt is None:
            self.prepare_train_step()
        assert self._train is not None and self._opt is not None
        out = self._train(self.x[samples])
        F.cross_entropy(out, self.y[samples], reduction="sum").backward()
        self._opt.step()
        self._opt.zero_grad(set_to_none=True)

    def estimate_bytes(self, method: str) -> dict[str, int] | None:
        """Memory estimate of the methods that hold ``N x P`` (or ``N^2 x activations``)."""
        if method != "jacobian_vectorize":
            return None
        acts = activation_numels(self.model, self.x)
        jac = self.n * self.numel * 4 * 3
        # the vectorised backward carries one lane per output (N) through the whole batch (N);
        # about six of the largest layer's (N, N, ...) tensors are alive at once (measured at
        # N = 32: 336 MiB for resnet8, 319 MiB for vgg11_bn_q)
        backward = self.n * self.n * max(acts) * 4 * 6
        return {"jacobian": jac, "vectorised_backward": backward, "total": jac + backward}


# ---------------------------------------------------------------------- methods
def _loop(wl: Workload, samples: slice) -> Tensor:
    params = list(wl.model.parameters())
    x, y = wl.x[samples], wl.y[samples]
    acc = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        logp = torch.log_softmax(wl.model(x[i : i + 1]), dim=1)[0, y[i]]
        for a, g in zip(acc, torch.autograd.grad(logp, params)):
            a.add_(g * g)
    return torch.cat([a.reshape(-1) for a in acc]) / x.shape[0]


def _jacobian_vectorize(wl: Workload, samples: slice) -> Tensor:
    """Today's EWC code: the Jacobian of the (N,) log-likelihoods w.r.t. every parameter."""
    names, params_actual = zip(*wl.model.named_parameters())
    x, y = wl.x[samples], wl.y[samples]

    def func(*params_formal: Tensor) -> Tensor:
        out = functional_call(wl.model, dict(zip(names, params_formal)), (x,))
        return torch.log_softmax(out, dim=1).gather(1, y.unsqueeze(-1)).squeeze(1)

    jac = torch.autograd.functional.jacobian(func, params_actual, vectorize=True)
    return torch.cat([(j.detach() ** 2).sum(0).reshape(-1) for j in jac]) / x.shape[0]


def _vmap_grad(wl: Workload, samples: slice) -> Tensor:
    params = {name: p.detach() for name, p in wl.model.named_parameters()}
    x, y = wl.x[samples], wl.y[samples]

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(wl.model, p, (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0), reduction="sum")

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    acc = {name: torch.zeros_like(p) for name, p in params.items()}
    for s in range(0, x.shape[0], VMAP_CHUNK):
        g = per_sample(params, x[s : s + VMAP_CHUNK], y[s : s + VMAP_CHUNK])
        for name, t in g.items():
            acc[name] += (t**2).sum(0)
    return wl.flat(acc) / x.shape[0]


def _prepare_backpack(wl: Workload) -> Callable[[slice], Tensor]:
    try:
        from backpack import backpack, extend
        from backpack.extensions import SumGradSquared
    except ImportError as e:
        raise Skip(f"backpack not installed ({e})") from e
    model = extend(copy.deepcopy(wl.model).eval())
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    named = dict(model.named_parameters())

    def run(samples: slice) -> Tensor:
        model.zero_grad(set_to_none=True)
        x, y = wl.x[samples], wl.y[samples]
        loss = lossfunc(model(x), y)
        with backpack(SumGradSquared()):
            loss.backward()
        out = wl.flat({name: p.sum_grad_squared for name, p in named.items()}) / x.shape[0]
        for p in named.values():
            del p.sum_grad_squared
        return out

    return run


def _prepare_opacus(wl: Workload) -> tuple[Callable[[slice], Tensor], str]:
    try:
        from opacus import GradSampleModule
    except ImportError as e:
        raise Skip(f"opacus not installed ({e})") from e
    note = "GradSampleModule(strict=True)"
    try:
        gsm = GradSampleModule(copy.deepcopy(wl.model).eval(), loss_reduction="sum")
    except Exception as e:  # BatchNorm is refused for training with DP; retry without checks
        first = f"{type(e).__name__}: {e}"[:300]
        try:
            gsm = GradSampleModule(
                copy.deepcopy(wl.model).eval(), loss_reduction="sum", strict=False
            )
        except Exception as e2:
            raise Skip(f"opacus: {first}; with strict=False: {type(e2).__name__}: {e2}") from e2
        note = f"strict=True refused ({first[:200]}); ran with strict=False"
    prefix = "_module."
    named = {
        (name[len(prefix) :] if name.startswith(prefix) else name): p
        for name, p in gsm.named_parameters()
    }

    def run(samples: slice) -> Tensor:
        gsm.zero_grad(set_to_none=True)
        for p in named.values():
            p.grad_sample = None
            p.grad = None
        x, y = wl.x[samples], wl.y[samples]
        F.cross_entropy(gsm(x), y, reduction="sum").backward()
        missing = [name for name, p in named.items() if getattr(p, "grad_sample", None) is None]
        if missing:
            raise RuntimeError(f"opacus left no grad_sample for {missing[:3]}")
        out = wl.flat({name: (p.grad_sample**2).sum(0) for name, p in named.items()})
        return out / x.shape[0]

    return run, note


def _prepare_library(wl: Workload, info: dict[str, Any]) -> Callable[[slice], Tensor]:
    from multiscale_jac import diag_fisher

    def run(samples: slice) -> Tensor:
        res = diag_fisher(
            wl.model,
            [(wl.x[samples], wl.y[samples])],
            kind="empirical",
            likelihood="classification",
            progress=False,
        )
        info.update(library_info(res))
        try:
            return wl.flat(res.as_dict())
        except (AttributeError, KeyError, RuntimeError):
            return res.flat

    return run


def library_info(res: Any) -> dict[str, Any]:
    """What the library says it did (attributes that may not exist yet read as ``None``)."""
    notes = getattr(res, "notes", None)
    methods = getattr(res, "methods", None)
    plan = getattr(res, "plan", None)
    return {
        "method": getattr(res, "method", None),
        "notes": None if notes is None else [str(n) for n in notes],
        "methods": None if methods is None else str(methods),
        "plan": None if plan is None else str(plan),
    }


def prepare(wl: Workload, method: str, info: dict[str, Any]) -> Callable[[slice], Any]:
    """The method as a function of a slice of the batch (setup such as copies done here).

    Raises:
        Skip: the method cannot run here (``info`` may hold notes).
    """
    if method == "train_step":
        wl.prepare_train_step()
        return wl.train_step
    if method == "loop":
        return lambda s: _loop(wl, s)
    if method == "jacobian_vectorize":
        return lambda s: _jacobian_vectorize(wl, s)
    if method == "vmap_grad":
        return lambda s: _vmap_grad(wl, s)
    if method == "backpack":
        run = _prepare_backpack(wl)
    elif method == "opacus":
        run, info["opacus"] = _prepare_opacus(wl)
    elif method == "library":
        return _prepare_library(wl, info)
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    try:  # a peer library that fails on this model is a skip with its error, not a crash
        run(WARM_SAMPLES)
    except Exception as e:
        raise Skip(f"{method} failed: {type(e).__name__}: {e}"[:500]) from e
    return run


# ---------------------------------------------------------------------- shared measurement
def rel_diff(a: Tensor, ref: Tensor) -> tuple[float, float]:
    """``(max |a - ref|, max |a - ref| / max |ref|)``."""
    diff = float((a.double() - ref.double()).abs().max())
    scale = float(ref.double().abs().max())
    return diff, diff / scale if scale > 0 else diff


def measure_cell(
    run: Callable[[slice], Any],
    train_step: Callable[[slice], Any] | None,
    *,
    repeats: int,
    warm_limit_s: float,
) -> dict[str, Any]:
    """Time and measure one cell in this (fresh) process.

    ``run`` is warmed up on two samples, then called on the batch once under
    :func:`measure_peak_memory` (also the warm-up for timing), then ``repeats`` more times when
    that took under ``warm_limit_s``; ``seconds`` is the median of those (else the single run).
    Then ``train_step`` (``None`` when ``run`` is the training step) gets a warm-up and
    :data:`TRAIN_STEP_REPEATS` timed runs; ``ratio_to_train_step`` divides the two medians.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(WARM_SAMPLES)
        gc.collect()
        mem = measure_peak_memory(lambda: run(ALL), "cpu")
        cold = mem["seconds_in_worker"]
        n_rep = max(repeats, TRAIN_STEP_REPEATS) if train_step is None else repeats
        times = []
        if cold < warm_limit_s:
            for _ in range(n_rep):
                times.append(timed_call(lambda: run(ALL), "cpu")[0])
        seconds = median(times) if times else cold
        if train_step is None:
            steps = times or [cold]
        else:
            train_step(ALL)
            steps = [timed_call(lambda: train_step(ALL), "cpu")[0] for _ in range(5)]
    step_seconds = median(steps)
    return {
        "seconds": seconds,
        "cold_seconds": cold,
        "runs": times,
        "timing": (
            f"median of {len(times)} runs after a warm-up on the batch"
            if times
            else f"single run (>= {warm_limit_s:g} s), no repeats"
        ),
        "train_step_seconds": step_seconds,
        "train_step_runs": steps,
        "ratio_to_train_step": seconds / step_seconds,
        "peak_memory_bytes": mem["peak_memory_bytes"],
        "memory": mem,
    }


def run_grid(
    *,
    script: Path,
    results: dict[str, Any],
    workloads: Sequence[tuple[str, list[str], dict[str, Any]]],
    methods: Sequence[str],
    passthrough: list[str],
    timeout_s: float,
    out_path: Path,
) -> None:
    """Run every (workload, method) cell in its own worker (``script --worker *args method``),
    ``train_step`` first; fill ``results["workloads"]`` and rewrite ``out_path`` after each."""
    methods = ["train_step", *(m for m in methods if m != "train_step")]
    for key, worker_args, meta in workloads:
        entry: dict[str, Any] = {**meta, "methods": {}}
        results["workloads"][key] = entry
        for method in methods:
            log(f"{key} / {method} ...")
            rec = run_worker(
                [str(script), "--worker", *worker_args, method, *passthrough], timeout_s=timeout_s
            )
            if "description" in rec:
                entry.setdefault("description", rec.pop("description"))
            base = (rec if method == "train_step" else entry["methods"].get("train_step", {})).get(
                "peak_memory_bytes"
            )
            if rec.get("peak_memory_bytes") is not None and base:
                rec["memory_ratio_to_train_step"] = rec["peak_memory_bytes"] / base
            entry["methods"][method] = rec
            log(f"  {_summary(rec)}")
            write_json(out_path, results)


def _summary(rec: dict[str, Any]) -> str:
    if "seconds" not in rec:
        return str(rec.get("skipped") or rec.get("error"))
    return (
        f"{rec['seconds']:.3g} s = {rec['ratio_to_train_step']:.1f} steps, "
        f"peak {fmt_bytes(rec['peak_memory_bytes'])} MiB"
    )


def grid_table(results: dict[str, Any], diff_ref: str) -> str:
    """workload | N | method | s | x train step | peak MiB | x train-step memory | diff | note."""
    rows = []
    for entry in results["workloads"].values():
        for method, rec in entry["methods"].items():
            note = rec.get("skipped") or rec.get("error") or ""
            lib = rec.get("library")
            if lib:
                note = "; ".join(
                    f"{k}: {v}"
                    for k, v in lib.items()
                    if v not in (None, [], "") and k not in ("S", "plan")
                )
            if rec.get("opacus"):
                note = rec["opacus"]
            ratio_mem = rec.get("memory_ratio_to_train_step")
            diff = rec.get(f"rel_diff_vs_{diff_ref}")
            rows.append(
                [
                    entry["model"],
                    entry["n"],
                    method,
                    fmt_seconds(rec.get("seconds")),
                    "-" if "seconds" not in rec else f"{rec['ratio_to_train_step']:.1f}",
                    fmt_bytes(rec.get("peak_memory_bytes")),
                    "-" if ratio_mem is None else f"{ratio_mem:.2f}",
                    "-" if diff is None else f"{diff:.1e}",
                    note[:90],
                ]
            )
    return markdown_table(
        [
            "workload",
            "N",
            "method",
            "s",
            "x train step",
            "peak MiB",
            "x train-step memory",
            f"diff vs {diff_ref}",
            "note",
        ],
        rows,
    )


def check_table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        ["model", "N", "method", "max abs diff", "rel diff", "result"],
        [
            [
                r["model"],
                r["n"],
                r["method"],
                "-" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.2e}",
                "-" if r.get("rel_diff") is None else f"{r['rel_diff']:.2e}",
                r["result"][:90],
            ]
            for r in rows
        ],
    )


def log(msg: str) -> None:
    """Progress to stderr (stdout carries the workers' JSON)."""
    print(msg, file=sys.stderr, flush=True)


def guarded(worker_fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a worker; an exception becomes a one-line ``{"error": ...}`` JSON record (the
    traceback goes to stderr) so that the parent records what failed and where."""
    try:
        return worker_fn(args)
    except Exception as e:
        traceback.print_exc()
        where = traceback.extract_tb(e.__traceback__)[-1]
        msg = f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})"
        print(json.dumps({"error": msg[:1000]}))
        return 0


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
    try:
        run = prepare(wl, method, info)
    except Skip as e:
        rec["skipped"] = str(e)
        print(json.dumps(rec))
        return 0
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
    if method == "opacus":
        rec["opacus"] = info.get("opacus")
    print(json.dumps(rec))
    return 0


# ---------------------------------------------------------------------- check
def check(args: argparse.Namespace) -> int:
    """Every method on ``--check-n`` samples of every model against ``loop``."""
    models = args.models or list(MODELS)
    rows: list[dict[str, Any]] = []
    failed = False
    for model_name in models:
        wl = Workload(model_name, args.check_n, args.seed)
        ref = _loop(wl, ALL)
        for method in METHODS:
            if method in ("train_step", "loop"):
                continue
            row: dict[str, Any] = {"model": model_name, "n": args.check_n, "method": method}
            info: dict[str, Any] = {}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = prepare(wl, method, info)(ALL)
            except Skip as e:
                row["result"] = f"skipped: {e}"
                rows.append(row)
                log(f"{model_name} / {method}: {row['result']}")
                continue
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
        out_dir / "bench_fisher_check.json",
        {
            "benchmark": "bench_fisher --check",
            "env": env_stamp("cpu"),
            "config": {"n": args.check_n, "tol": args.check_tol, "seed": args.seed},
            "notes": {"rel_diff": "max |method - loop| / max |loop| over the flat diagonal"},
            "rows": rows,
        },
    )
    print(check_table(rows))
    print(f"\nwrote {out_path}")
    return 1 if failed else 0


# ---------------------------------------------------------------------- main
def main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out) if args.out else DEFAULT_OUT
    out_path = out_dir / ("bench_fisher_quick.json" if args.quick else "bench_fisher.json")
    models = args.models or list(QUICK_MODELS if args.quick else MODELS)
    sizes = args.sizes or list(QUICK_SIZES if args.quick else SIZES)
    results: dict[str, Any] = {
        "benchmark": "bench_fisher",
        "workload": "diagonal empirical Fisher over all parameters, classification",
        "env": env_stamp("cpu"),
        "config": {
            "quick": args.quick,
            "seed": args.seed,
            "max_gb": args.max_gb,
            "repeats": args.repeats,
            "warm_limit_s": args.warm_limit,
            "threads": args.threads or torch.get_num_threads(),
            "vmap_chunk": VMAP_CHUNK,
        },
        "notes": {
            "seconds": "median of --repeats runs after a warm-up on the batch, fresh process",
            "ratio_to_train_step": (
                "seconds / median of 5 training steps (after a warm-up) in the same process; "
                "the step: forward, CrossEntropy(sum), backward, SGD, zero_grad on a train-mode "
                "copy"
            ),
            "peak_memory_bytes": MEMORY_CAVEAT_CPU,
            "memory_ratio_to_train_step": (
                "peak_memory_bytes / that of the train_step cell (its own fresh worker)"
            ),
            "rel_diff_vs_loop": "max |method - loop| / max |loop| on the first two samples",
            "estimated_bytes": (
                "jacobian_vectorize: N*P*4*3 (the Jacobians) + N^2*max_layer_output*4*6 (the "
                "vectorised backward: one lane per output through the whole batch)"
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
    out = [
        "--seed",
        str(args.seed),
        "--max-gb",
        str(args.max_gb),
        "--repeats",
        str(args.repeats),
        "--warm-limit",
        str(args.warm_limit),
    ]
    if args.threads:
        out += ["--threads", str(args.threads)]
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="N=8, vgg11_bn_q and resnet8 (seconds)")
    p.add_argument("--check", action="store_true", help="verify every method against loop")
    p.add_argument("--check-n", type=int, default=CHECK_N, help="samples for --check (4)")
    p.add_argument("--check-tol", type=float, default=1e-4, help="relative tolerance (1e-4)")
    p.add_argument("--models", nargs="*", choices=MODELS, help="default: all (quick: two)")
    p.add_argument("--sizes", nargs="*", type=int, help="batch sizes N (default: 64 128)")
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument(
        "--max-gb", type=float, default=6.0, help="skip jacobian_vectorize above this estimate"
    )
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
