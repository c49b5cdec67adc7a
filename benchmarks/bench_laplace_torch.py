"""The library's laplace-torch front door against laplace-torch, and its K-FAC against the
per-sample hook loop a user would write, on the same data (``--rows``; docs/benchmarks.md):
``backprop`` (laplace-torch's bayesopt example: the joint GLM predictive and a backward to its
inputs; target <= 1.1x), ``subnet@k`` (a subnetwork Laplace fit over ``k`` entries of
``_models.CifarNet(32)``; <= 1.0x), ``subnet_fpn@128`` (on the ragged head), ``kron`` (K-FAC of
a head shared by three FPN levels on images of four sizes; <= 1.2x the hook loop). Per row and
method: the median of ``--repeats`` interleaved rounds, in training steps, the results' largest
relative difference and a fresh worker's peak RSS rise. Needs laplace-torch::

    PYTHONPATH=$PWD /tmp/lt/bin/python benchmarks/bench_laplace_torch.py [--rows kron]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import _common as common
import torch
from _common import fmt_bytes, fmt_seconds, median, timed_call
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
            size = math.prod(shape)
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


def flat_batches(flat: Flat, parts: list) -> Any:
    """The buckets as ``(rows, labels)`` batches, ``flat`` set to each bucket's levels."""
    for shapes, rows, y in parts:
        flat.shapes = shapes
        yield rows, y


def train_step(model: nn.Module, batches: Any, loss: Any = nn.functional.cross_entropy) -> None:
    """One training step (forward, summed loss, backward, a step of size 0: the model stays at
    its MAP) over ``batches``: every ratio's unit."""
    model.zero_grad(set_to_none=True)
    for x, y in batches:
        loss(model(x), y, reduction="sum").backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.0 * p.grad
    model.zero_grad(set_to_none=True)


def fit_theirs(flat: Flat, parts: list, cls: Any, **opts: Any) -> Any:
    """laplace-torch on the buckets, one ``fit`` each (``override=False`` after the first)."""
    from torch.utils.data import DataLoader, TensorDataset

    la = cls(flat, "classification", **opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, (rows, y) in enumerate(flat_batches(flat, parts)):
            la.fit(DataLoader(TensorDataset(rows, y), batch_size=len(y)), override=k == 0)
    return la


def hook_kfac(head: nn.Module, samples: list[list[Tensor]]) -> dict[str, Tensor]:
    """The user's K-FAC: hooks on every Linear/Conv2d, one sample at a time (its own shapes),
    one backward pass per class of ``f . sqrt(p_c) (e_c - p)``; ``{name: A_w or G}``."""
    mods = {m: n for n, m in head.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    out: dict[str, Any] = {f"{n}.{f}": 0 for n in mods.values() for f in "AG"}

    def cols(m: nn.Module, t: Tensor) -> Tensor:  # (features, positions) of a batch of one
        return t[0].flatten(1) if isinstance(m, nn.Conv2d) else t.reshape(-1, t.shape[-1]).T

    def fwd(m: nn.Module, args: tuple, _: Tensor) -> None:
        x = args[0]
        if isinstance(m, nn.Conv2d):  # the patches the kernel reads, (1, features, positions)
            x = nn.functional.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride)
        a = cols(m, x)
        out[f"{mods[m]}.A"] += a @ a.T / (a.shape[1] * len(samples))

    def bwd(m: nn.Module, _: tuple, grad_out: tuple) -> None:
        g = cols(m, grad_out[0])
        out[f"{mods[m]}.G"] += g @ g.T

    hooks = [h for m in mods for h in (m.register_forward_hook(fwd),
                                       m.register_full_backward_hook(bwd))]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "firing ... since no inputs require gradients"
        for levels in samples:
            f = head([t.unsqueeze(0) for t in levels])[0]
            p = torch.softmax(f, 0).detach()
            q = (torch.eye(len(p), dtype=p.dtype) - p) * p.sqrt().unsqueeze(1)
            for c in range(len(p)):
                f.backward(q[c], retain_graph=c < len(p) - 1)
    for h in hooks:
        h.remove()
    head.zero_grad(set_to_none=True)
    return out


def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def branin(x: Tensor) -> Tensor:
    x1, x2 = x[..., 0], x[..., 1]
    b, c, t = 5.1 / (4 * torch.pi**2), 5 / torch.pi, 1 / (8 * torch.pi)
    return (x2 - b * x1**2 + c * x1 - 6) ** 2 + 10 * (1 - t) * torch.cos(x1) + 10


def case_backprop(args: argparse.Namespace) -> tuple[dict, list]:
    """The bayesopt example's model and Laplace; its predictive with a backward to ``X``."""
    import laplace
    from torch.utils.data import DataLoader, TensorDataset

    import multiscale_jac.laplace as mjl

    torch.manual_seed(1)
    lo, hi = torch.tensor([-5.0, 0.0]).double(), torch.tensor([10.0, 15.0]).double()
    x = lo + (hi - lo) * torch.rand(30, 2, dtype=torch.float64)
    y = branin(x[:20]).unsqueeze(-1)
    net = nn.Sequential(nn.Linear(2, 50), nn.ReLU(), nn.Linear(50, 50), nn.ReLU(),
                        nn.Linear(50, 1)).double()  # fmt: skip
    opt = torch.optim.Adam(net.parameters(), lr=1e-1, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)
    for _ in range(1000):  # the example's training: 1000 epochs of one batch
        opt.zero_grad()
        nn.functional.mse_loss(net(x[:20]), y).backward()
        opt.step()
        sched.step()
    net.eval()
    query = x[20:].clone().requires_grad_()  # 20 query points, a (4, 5, 2) batch flattened
    las = []
    for cls in (mjl.Laplace, laplace.Laplace):
        la = cls(net, "regression", subset_of_weights="all", hessian_structure="kron",
                 enable_backprop=True)  # fmt: skip
        la.fit(DataLoader(TensorDataset(x[:20], y), batch_size=1024))
        la.optimize_prior_precision(n_steps=50)
        las.append(la)

    def acquire(la: Any) -> tuple[Tensor, ...]:
        mean, cov = la(query, pred_type="glm", joint=True)
        (grad,) = torch.autograd.grad(mean.sum() + cov.diagonal().sum(), query)
        return mean, cov, grad

    def check(r: dict) -> float:
        return max(rel(a, b) for a, b in zip(r[LIB], r["laplace-torch"], strict=True))

    methods = {
        "train_step": lambda: train_step(net, [(x[:20], y)], nn.functional.mse_loss),
        LIB: functools.partial(acquire, las[0]),
        "laplace-torch": functools.partial(acquire, las[1]),
    }
    return methods, [("laplace-torch", 1.1, check)]


def case_subnet(args: argparse.Namespace, k: int, fpn: bool) -> tuple[dict, list]:
    """``Laplace(..., "subnetwork", "full", subnetwork_indices=idx).fit`` on the CIFAR net
    (``fpn``: on the ragged head, laplace-torch per bucket), ``k`` random entries."""
    import laplace
    from _models import CifarNet
    from torch.utils.data import DataLoader, TensorDataset

    import multiscale_jac.laplace as mjl

    if fpn:
        wl = workload(args.n, args.channels, args.classes)
        model, parts, ours = Flat(wl["head"]), buckets(wl), [(wl["samples"], wl["labels"])]
    else:
        torch.manual_seed(0)
        model, n = CifarNet(32).eval(), 32 * args.batches
        data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(10, (n,)))
        ours = DataLoader(data, batch_size=32)
    idx = torch.randperm(sum(p.numel() for p in model.parameters()))[:k].sort().values
    opts = {"subset_of_weights": "subnetwork", "hessian_structure": "full"}

    def fit(cls: Any, model: nn.Module, data: Any) -> Any:
        la = cls(model, "classification", **opts, subnetwork_indices=idx.clone())
        return la.fit(data) or la  # laplace-torch's fit returns None

    theirs = functools.partial(fit, laplace.Laplace, model, ours)
    if fpn:  # per shape bucket
        kw = {**opts, "subnetwork_indices": idx}
        theirs = functools.partial(fit_theirs, model, parts, laplace.Laplace, **kw)
    methods = {
        "train_step": lambda: train_step(model, flat_batches(model, parts) if fpn else ours),
        LIB: lambda: fit(mjl.Laplace, model.head if fpn else model, ours),
        "laplace-torch": theirs,
    }
    return methods, [("laplace-torch", 1.0, lambda r: rel(r[LIB].H, r["laplace-torch"].H))]


def case_kron(args: argparse.Namespace) -> tuple[dict, list]:
    """K-FAC on the ragged pyramids: the library, laplace-torch per bucket, the hook loop."""
    import laplace
    from laplace.curvature import CurvlinopsGGN

    import multiscale_jac as mj

    wl = workload(args.n, args.channels, args.classes)
    head, parts = wl["head"], buckets(wl)
    flat = Flat(head)

    def factors(r: dict) -> float:  # the library's [G, A_w] and [G] against the hooks'
        return max(
            rel(r[HOOKS][f"{b.name.rsplit('.', 1)[0]}.{f}"], t)
            for b in r[LIB].H.blocks
            for f, t in zip("GA", b.factors)
        )

    def precision(r: dict) -> float:
        ours = r[LIB].posterior_precision.to_matrix()
        return rel(ours, r["laplace-torch"].posterior_precision.to_matrix())

    methods = {
        "train_step": lambda: train_step(flat, flat_batches(flat, parts)),
        LIB: lambda: mj.KronLaplace(head, "classification").fit([(wl["samples"], wl["labels"])]),
        HOOKS: lambda: hook_kfac(head, wl["samples"]),
        "laplace-torch": functools.partial(
            fit_theirs, flat, parts, laplace.KronLaplace, backend=CurvlinopsGGN
        ),
    }
    return methods, [(HOOKS, 1.2, factors), ("laplace-torch", None, precision)]


LIB = "library"
HOOKS = "hook loop (per sample)"
CASES = {
    "backprop": case_backprop,
    **{f"subnet@{k}": functools.partial(case_subnet, k=k, fpn=False) for k in (128, 512, 1056)},
    "subnet_fpn@128": functools.partial(case_subnet, k=128, fpn=True),
    "kron": case_kron,
}


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    case, method = args.worker.split(":", 1)
    methods, _ = CASES[case](args)
    rec = common.measure_peak_memory(methods[method], "cpu")
    print(json.dumps({k: v for k, v in rec.items() if k != "result"}, default=str))


def measure(args: argparse.Namespace, case: str) -> dict[str, Any]:
    """One row: memory workers, then warm-up and ``--repeats`` interleaved rounds."""
    methods, refs = CASES[case](args)
    worker = [__file__, *sys.argv[1:], "--worker"]
    memory = {m: common.run_worker([*worker, f"{case}:{m}"], timeout_s=1800) for m in methods}
    names = list(methods)
    first = {m: timed_call(methods[m], "cpu") for m in names}  # the first call, a warm-up
    results = {m: r for m, (_, r) in first.items()}
    times: dict[str, list[float]] = {m: [] for m in names}
    for r in range(args.repeats):
        for m in names[r % len(names) :] + names[: r % len(names)]:
            t, results[m] = timed_call(methods[m], "cpu")
            times[m].append(t)
    recs = []
    for m in names:
        ref = {name: (target, check) for name, target, check in refs}.get(m)
        ratios = [a / b for a, b in zip(times[LIB], times[m], strict=True)]
        recs.append({
            "method": m,
            "seconds": median(times[m]),
            "first_second_seconds": [first[m][0], times[m][0]],  # its first and second calls
            "times": times[m],
            "ratio_to_train_step": median(times[m]) / median(times["train_step"]),
            "library_over_method": median(ratios) if ref else None,
            "target": ref[0] if ref else None,
            "max_rel_diff": ref[1](results) if ref else None,
            "peak_rss_rise_bytes": memory[m].get("peak_memory_bytes"),
            "memory_worker": memory[m],
        })  # fmt: skip
    return {"row": case, "methods": recs, "load_average_after": common.load_average()}


def table(rows: dict[str, Any]) -> str:
    out = []
    for case, row in rows.items():
        for r in row["methods"]:
            ratio, target = r["library_over_method"], r["target"]
            miss = " (miss)" if target and ratio > target else ""
            out.append([
                case, r["method"], *map(fmt_seconds, r.get("first_second_seconds", [None] * 2)),
                fmt_seconds(r["seconds"]), f"{r['ratio_to_train_step']:.2f}",
                "-" if ratio is None else f"{ratio:.3g}", f"<= {target}{miss}" if target else "-",
                "-" if r["max_rel_diff"] is None else f"{r['max_rel_diff']:.1e}",
                fmt_bytes(r["peak_rss_rise_bytes"]),
            ])  # fmt: skip
    heads = ["row", "method", "1st call", "2nd call", "seconds (warm)", "x train step",
             "library / method", "target"]  # fmt: skip
    return common.markdown_table([*heads, "max rel diff", "peak RSS rise (MiB)"], out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="backprop,subnet,subnet_fpn,kron")
    ints = {"--n": 48, "--channels": 32, "--classes": 8, "--batches": 2, "--threads": 1}
    for flag, default in {**ints, "--repeats": 3}.items():
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    torch.set_num_threads(args.threads)
    path = Path(args.out) / "bench_laplace_torch.json"
    old = json.loads(path.read_text()) if path.exists() else {"rows": {}}
    import laplace

    import multiscale_jac

    env = common.env_stamp("cpu")
    env["laplace_torch"] = getattr(laplace, "__version__", "unknown")
    env["multiscale_jac_path"] = multiscale_jac.__file__  # a snapshot may stand in for the tree
    wanted = args.rows.split(",")
    for case in [c for c in CASES if c.split("@")[0] in wanted]:
        row = measure(args, case)
        old["rows"][case] = {**row, "env": env, "config": vars(args)}
        print(f"{case}: done", flush=True)
    text = table(old["rows"])
    print(text)
    common.write_json(path, old)
    (Path(args.out) / "bench_laplace_torch.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
