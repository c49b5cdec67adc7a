"""Check :class:`multiscale_jac.SubnetLaplace` against laplace-torch's subnetwork Laplace.

laplace-torch (``pip install laplace-torch``; Immer et al., Daxberger et al.) is the reference
implementation our conventions follow (see the docstring of
``multiscale_jac/laplace/__init__.py``). For three small float64 models and a subset of 24-40
entries, given to laplace-torch as ``subnetwork_indices`` (indices into
``parameters_to_vector(model.parameters())``) and to us as ``ParamSubset.from_flat_indices(model,
idx)``, the script fits both on the same ``DataLoader`` (uneven last batch) and compares

* ``H``: the subset GGN (laplace-torch's ``la.H``), the loss, the subset MAP (same order),
  the posterior precision and covariance;
* the log marginal likelihood at several prior precisions (and, for the regression,
  ``sigma_noise`` values), each passed as an argument to both;
* the GLM predictive on held-out inputs: mean, ``(N, C, C)`` covariance, marginal variances,
  and for the classifiers the ``probit`` and ``bridge`` probabilities.

Models: ``mlp_cls`` (MLP, 4 classes), ``cnn_cls`` (two convs and a linear head on ``3x8x8``
inputs, 5 classes), ``mlp_reg`` (MLP regression, 3 outputs, ``sigma_noise = 0.8``).
Each comparison passes when ``max|ours - theirs| <= 1e-6 * max|theirs|``; the script exits 1
if any fails. Results (versions of torch, laplace-torch and its backends; per check the max abs
diff, the relative diff, pass): ``benchmarks/results/compare_laplace_torch.json`` and a table on
stdout.

``--memory`` also measures the peak memory of one subnetwork fit (batch 32, 100 random entries,
float32, 10 classes) on a small CIFAR conv net (``3x32x32``; conv 32/64/64 + max-pool, linear
1024-128-10, ~190k parameters) for laplace-torch and for us, each in a fresh worker process
(peak RSS rise, ``benchmarks/_common.measure_peak_memory``). laplace-torch differentiates every
parameter for every output of the whole batch (``jacrev`` over ``32 x 10`` outputs), which takes
gigabytes; the worker's data segment is capped (``RLIMIT_DATA``) below the free memory so an
allocation failure is reported instead of the machine swapping or the OOM killer stepping in.
The measurement is skipped when less than ``--min-free-gb`` is available. On 2 CPU cores:
laplace-torch ~6.8 GB / 65 s vs ours ~140 MB / 8 s; ``--width 48`` (~324k parameters) takes
laplace-torch to ~10 GB, the scale reported in the issue.

Usage (in a virtual environment of its own, so that this repo's ``.venv`` keeps no
laplace-torch; the constraint keeps pip on the CPU build of torch)::

    python3.11 -m venv /tmp/lt-venv && . /tmp/lt-venv/bin/activate
    pip install torch==2.13.0
    echo torch==2.13.0 > /tmp/lt-c.txt
    pip install -c /tmp/lt-c.txt laplace-torch
    pip uninstall -y torchvision    # see below
    pip install -c /tmp/lt-c.txt -e /path/to/this/repo
    python benchmarks/compare_laplace_torch.py [--backend auto] [--memory] [--out DIR]

laplace-torch 0.3 depends on torchvision, and the one pip finds on PyPI is a CUDA build that
cannot load against the CPU torch (``RuntimeError: operator torchvision::nms does not exist``);
torchmetrics (imported by laplace-torch) imports torchvision when it is installed, so
``import laplace`` fails until it is removed. Nothing used here needs it. Checked with torch
2.13.0+cpu, laplace-torch 0.3, curvlinops-for-pytorch 3.0.1, backpack-for-pytorch 1.7.1,
asdfghjkl 0.1a4 (every backend agrees; the CPU run takes ~15 s, ~2 min with ``--memory``).

``--backend``: laplace-torch's curvature backend for the comparison (``auto``: the library's
default, then ``curvlinops``, ``backpack``, ``asdl``, the first that fits; the one used is
recorded). The memory worker always uses the library's default backend.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import resource
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import (
    MEMORY_CAVEAT_CPU,
    env_stamp,
    fmt_bytes,
    markdown_table,
    measure_peak_memory,
    run_worker,
    write_json,
)
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, TensorDataset

from multiscale_jac import ParamSubset, SubnetLaplace

SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results"
RTOL = 1e-6
BACKENDS = {
    "curvlinops": "CurvlinopsGGN",
    "backpack": "BackPackGGN",
    "asdl": "AsdlGGN",
}
VERSIONED = (
    "laplace-torch",
    "curvlinops-for-pytorch",
    "backpack-for-pytorch",
    "asdfghjkl",
    "asdl",
    "torchmetrics",
)


# ---------------------------------------------------------------------- models and data
def mlp_cls() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 4))


def cnn_cls() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(4, 6, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 3 * 3, 5),
    )


def mlp_reg() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


class CifarNet(nn.Module):
    """A small CIFAR-10 conv net: three 3x3 convs (``w``, ``2w``, ``2w`` channels) each with
    ReLU and 2x2 max-pooling, then ``Linear(2w*16, 128)``, ReLU, ``Linear(128, 10)``."""

    def __init__(self, w: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * w * 16, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


# name: (builder, likelihood, input shape, outputs, subset size, prior precision, sigma_noise)
CASES: dict[str, tuple[Callable[[], nn.Module], str, tuple[int, ...], int, int, float, float]] = {
    "mlp_cls": (mlp_cls, "classification", (6,), 4, 32, 0.5, 1.0),
    "cnn_cls": (cnn_cls, "classification", (3, 8, 8), 5, 40, 0.5, 1.0),
    "mlp_reg": (mlp_reg, "regression", (5,), 3, 24, 0.5, 0.8),
}
N_TRAIN, BATCH, N_TEST = 40, 16, 10
LML_PRIORS = (0.1, 1.0, 7.5)
LML_SIGMAS = (0.3, 1.0, 2.0)


def random_indices(model: nn.Module, k: int, gen: torch.Generator) -> Tensor:
    """``k`` distinct sorted flat indices (int64, CPU), at least one in every tensor."""
    total = sum(p.numel() for p in model.parameters())
    starts, start = [], 0
    for p in model.parameters():
        starts.append(start + int(torch.randint(p.numel(), (1,), generator=gen)))
        start += p.numel()
    rest = torch.randperm(total, generator=gen)
    chosen = list(dict.fromkeys(starts + rest.tolist()))[:k]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def make_data(case: str, gen: torch.Generator) -> tuple[nn.Module, DataLoader, Tensor, Tensor]:
    """Model (float64, eval), training loader, test inputs and subset indices of ``case``."""
    build, likelihood, shape, outputs, k, _, _ = CASES[case]
    model = build().double().eval()
    x = torch.randn(N_TRAIN, *shape, generator=gen, dtype=torch.float64)
    if likelihood == "classification":
        y = torch.randint(outputs, (N_TRAIN,), generator=gen)
    else:
        with torch.no_grad():
            y = model(x) + 0.3 * torch.randn(N_TRAIN, outputs, generator=gen, dtype=torch.float64)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    x_test = torch.randn(N_TEST, *shape, generator=gen, dtype=torch.float64)
    return model, loader, x_test, random_indices(model, k, gen)


# ---------------------------------------------------------------------- laplace-torch side
def laplace_backend(name: str) -> type | None:
    """The laplace-torch backend class for ``name`` (``None`` for the library's default)."""
    if name == "default":
        return None
    import laplace.curvature as curv

    cls = getattr(curv, BACKENDS[name], None)
    if cls is None:
        raise ImportError(f"laplace.curvature has no {BACKENDS[name]} (backend not installed?)")
    return cls


def make_theirs(
    model: nn.Module, case: str, idx: Tensor, backend: str, loader: DataLoader
) -> tuple[Any, str]:
    """laplace-torch's full subnetwork Laplace, fitted; ``(la, backend class name)``."""
    from laplace import Laplace

    _, likelihood, _, _, _, prior, sigma = CASES[case]
    kwargs: dict[str, Any] = {
        "subset_of_weights": "subnetwork",
        "hessian_structure": "full",
        "subnetwork_indices": idx.clone(),
        "prior_precision": prior,
        "sigma_noise": sigma,
    }
    cls = laplace_backend(backend)
    if cls is not None:
        kwargs["backend"] = cls
    la = Laplace(model, likelihood, **kwargs)
    la.fit(loader)
    used = getattr(la, "_backend_cls", None) or type(la.backend)
    return la, used.__name__


def fit_theirs(
    model: nn.Module, case: str, idx: Tensor, loader: DataLoader, choice: str
) -> tuple[Any, str, list[str]]:
    """Fit laplace-torch with the chosen backend (``auto``: the first that works)."""
    order = ["default", *BACKENDS] if choice == "auto" else [choice]
    failures: list[str] = []
    for name in order:
        try:
            la, used = make_theirs(model, case, idx, name, loader)
        except Exception as exc:  # a backend that cannot do this model: try the next
            failures.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
            continue
        return la, used, failures
    raise RuntimeError("no laplace-torch backend could fit: " + " | ".join(failures))


def glm_theirs(la: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """laplace-torch's GLM predictive ``(f_mu (N, C), f_var (N, C, C))``."""
    out = la._glm_predictive_distribution(x)
    return out[0].detach().clone(), out[1].detach().clone()


# ---------------------------------------------------------------------- comparison
def compare(name: str, ours: Any, theirs: Any) -> dict[str, Any]:
    a = torch.as_tensor(ours, dtype=torch.float64).detach().cpu()
    b = torch.as_tensor(theirs, dtype=torch.float64).detach().cpu()
    rec: dict[str, Any] = {"check": name, "shape": list(b.shape)}
    if a.shape != b.shape:
        rec.update(
            max_abs_diff=None,
            rel_diff=None,
            passed=False,
            note=f"shape mismatch: ours {tuple(a.shape)}, laplace-torch {tuple(b.shape)}",
        )
        return rec
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    finite = bool(torch.isfinite(a).all() and torch.isfinite(b).all())
    rec.update(max_abs_diff=diff, rel_diff=rel, passed=finite and rel <= RTOL)
    if b.numel() == 1:
        rec.update(ours=float(a.reshape(())), laplace_torch=float(b.reshape(())))
    return rec


def run_case(case: str, backend: str, seed: int) -> dict[str, Any]:
    _, likelihood, _, _, _, prior, sigma = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    model, loader, x_test, idx = make_data(case, gen)
    n_total = sum(p.numel() for p in model.parameters())

    t0 = time.perf_counter()
    theirs, used, failures = fit_theirs(model, case, idx, loader, backend)
    t_theirs = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = SubnetLaplace(
        model,
        likelihood,
        ParamSubset.from_flat_indices(model, idx),
        prior_precision=prior,
        sigma_noise=sigma,
    ).fit(loader, progress=False)
    t_ours = time.perf_counter() - t0

    theta = parameters_to_vector(model.parameters()).detach()[idx]
    checks = [
        compare("theta_MAP (subset order)", ours.mean, theta),
        compare("H (GGN)", ours.H, theirs.H),
        compare("loss", ours.loss, theirs.loss),
        compare("posterior_precision", ours.posterior_precision, theirs.posterior_precision),
        compare("posterior_covariance", ours.posterior_covariance, theirs.posterior_covariance),
    ]

    # the predictive at the fitted prior (before the marglik calls change laplace-torch's state)
    f_mu, f_var = glm_theirs(theirs, x_test)
    if likelihood == "classification":
        pred = ours.predictive(x_test, link_approx="probit")
        bridge = ours.predictive(x_test, link_approx="bridge")
        probit_t = theirs(x_test, pred_type="glm", link_approx="probit")
        bridge_t = theirs(x_test, pred_type="glm", link_approx="bridge")
    else:
        pred = ours.predictive(x_test)
        mean_t, var_t = theirs(x_test, pred_type="glm")
        checks += [
            compare("predictive mean (la(x) regression)", pred.mean, mean_t),
            compare("predictive covariance (la(x) regression)", pred.covariance, var_t),
        ]
    checks += [
        compare("glm mean f_mu", pred.mean, f_mu),
        compare("glm covariance f_var (N,C,C)", pred.covariance, f_var),
        compare("glm variance diag(f_var)", pred.variance, f_var.diagonal(dim1=1, dim2=2)),
    ]
    if likelihood == "classification":
        checks += [
            compare("probs probit", pred.probs, probit_t),
            compare("probs bridge", bridge.probs, bridge_t),
        ]

    # log marginal likelihood at given prior precisions (and noise), passed to both
    checks.append(
        compare(f"log_marglik (prior {prior:g})", ours.log_marginal_likelihood(), _lml(theirs))
    )
    sigmas = LML_SIGMAS if likelihood == "regression" else (None,)
    for p0 in LML_PRIORS:
        for s in sigmas:
            what = f"log_marglik (prior {p0:g}" + (f", sigma {s:g})" if s is not None else ")")
            kw_t: dict[str, Any] = {"prior_precision": torch.tensor(p0, dtype=torch.float64)}
            kw_o: dict[str, Any] = {"prior_precision": p0}
            if s is not None:
                kw_t["sigma_noise"] = torch.tensor(s, dtype=torch.float64)
                kw_o["sigma_noise"] = s
            checks.append(compare(what, ours.log_marginal_likelihood(**kw_o), _lml(theirs, **kw_t)))
    return {
        "case": case,
        "likelihood": likelihood,
        "model": repr(model),
        "n_params_total": n_total,
        "n_params_subnet": int(idx.numel()),
        "subnetwork_indices": idx.tolist(),
        "n_train": N_TRAIN,
        "batch_size": BATCH,
        "n_test": N_TEST,
        "prior_precision": prior,
        "sigma_noise": sigma,
        "laplace_torch_backend": used,
        "laplace_torch_class": type(theirs).__name__,
        "backend_failures": failures,
        "fit_seconds": {"laplace_torch": t_theirs, "ours": t_ours},
        "checks": checks,
        "passed": all(c["passed"] for c in checks),
    }


def _lml(la: Any, **kwargs: Any) -> Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.tensor(tensor) in laplace-torch's log_likelihood
        return la.log_marginal_likelihood(**kwargs).detach()


# ---------------------------------------------------------------------- memory
def mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_worker(args: argparse.Namespace) -> int:
    """One fit in this fresh process; prints one JSON line."""
    if args.limit_bytes:
        resource.setrlimit(resource.RLIMIT_DATA, (args.limit_bytes, args.limit_bytes))
    torch.manual_seed(args.seed)
    model = CifarNet(args.width).eval()
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch, 3, 32, 32, generator=gen)
    y = torch.randint(10, (args.batch,), generator=gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch)
    total = sum(p.numel() for p in model.parameters())
    idx = torch.randperm(total, generator=gen)[: args.entries].sort().values
    rec: dict[str, Any] = {
        "impl": args.worker,
        "n_params_total": total,
        "n_params_subnet": int(idx.numel()),
        "batch": args.batch,
        "limit_bytes": args.limit_bytes,
    }
    if args.worker == "laplace_torch":
        from laplace import Laplace

        la = Laplace(
            model,
            "classification",
            subset_of_weights="subnetwork",
            hessian_structure="full",
            subnetwork_indices=idx,
        )
        rec["backend"] = getattr(la, "_backend_cls", type(la.backend)).__name__

        def fit() -> Any:
            la.fit(loader)
            return la.H
    else:
        la = SubnetLaplace(model, "classification", ParamSubset.from_flat_indices(model, idx))
        rec["backend"] = "multiscale_jac"

        def fit() -> Any:
            return la.fit(loader, progress=False).H

    try:
        rec.update(measure_peak_memory(fit, "cpu"))
    except (RuntimeError, MemoryError) as exc:  # the data-segment cap was hit
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rec["ru_maxrss_after_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    else:
        h = la.H.detach().double()
        rec["H_fro"] = float(h.norm())
        rec["H_trace"] = float(h.trace())
    print(json.dumps(rec))
    return 0


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    avail = mem_available_bytes()
    gb = 2**30
    out: dict[str, Any] = {
        "setting": (
            f"CifarNet(w={args.width}) float32, batch {args.batch}, {args.entries} random "
            "entries, one fit of the full subnetwork GGN"
        ),
        "caveat": MEMORY_CAVEAT_CPU,
        "mem_available_bytes": avail,
    }
    if avail is None or avail < args.min_free_gb * gb:
        out["skipped"] = f"MemAvailable {avail} bytes < --min-free-gb {args.min_free_gb} GiB"
        return out
    limit = int(min(args.max_gb * gb, avail - 1.5 * gb))
    out["worker_data_limit_bytes"] = limit
    results = {}
    for impl in ("ours", "laplace_torch"):
        cmd = [
            str(SCRIPT),
            "--worker",
            impl,
            "--batch",
            str(args.batch),
            "--entries",
            str(args.entries),
            "--width",
            str(args.width),
            "--limit-bytes",
            str(limit),
            "--seed",
            str(args.seed),
        ]
        results[impl] = run_worker(cmd, timeout_s=args.timeout)
    out["results"] = results
    a, b = results["ours"], results["laplace_torch"]
    if "H_fro" in a and "H_fro" in b and b["H_fro"]:
        out["H_fro_rel_diff_float32"] = abs(a["H_fro"] - b["H_fro"]) / abs(b["H_fro"])
    if a.get("peak_memory_bytes") and b.get("peak_memory_bytes"):
        out["ratio_laplace_torch_over_ours"] = b["peak_memory_bytes"] / a["peak_memory_bytes"]
    return out


# ---------------------------------------------------------------------- main
def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"torch": torch.__version__}
    for dist in VERSIONED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def main(args: argparse.Namespace) -> int:
    try:
        import laplace  # noqa: F401
    except ImportError as exc:
        print(
            f"laplace-torch is not importable ({exc}); run this script in a virtual environment "
            "with laplace-torch installed (see the module docstring). Nothing written.",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    env = env_stamp("cpu")
    memory = run_memory(args) if args.memory else None  # workers first, while this is small

    torch.set_default_dtype(torch.float64)  # laplace-torch builds H and priors in the default
    cases: list[dict[str, Any]] = []
    for case in args.cases:
        try:
            cases.append(run_case(case, args.backend, args.seed))
        except Exception as exc:
            traceback.print_exc()
            cases.append({"case": case, "error": f"{type(exc).__name__}: {exc}", "passed": False})
    torch.set_default_dtype(torch.float32)

    all_pass = all(c["passed"] for c in cases)
    result = {
        "status": "ok" if all_pass else "disagreement",
        "what": __doc__.split("\n\n")[0],
        "tolerance_rel": RTOL,
        "rel_diff": "max|ours - laplace_torch| / max|laplace_torch| (per check)",
        "versions": versions(),
        "env": env,
        "cases": cases,
        "memory": memory,
        "all_pass": all_pass,
    }
    out = Path(args.out) if args.out else DEFAULT_OUT
    path = write_json(out / "compare_laplace_torch.json", result)

    rows = []
    for c in cases:
        if "checks" not in c:
            rows.append([c["case"], "ERROR", "-", "-", c["error"][:60]])
            continue
        for chk in c["checks"]:
            rows.append(
                [
                    c["case"],
                    chk["check"],
                    _e(chk["max_abs_diff"]),
                    _e(chk["rel_diff"]),
                    "pass" if chk["passed"] else "FAIL " + chk.get("note", ""),
                ]
            )
    vers = result["versions"]
    print(
        f"torch {vers['torch']}, laplace-torch {vers['laplace-torch']}; backends used: "
        + ", ".join(f"{c['case']}={c.get('laplace_torch_backend')}" for c in cases)
    )
    print(markdown_table(["case", "check", "max abs diff", "rel diff", f"<= {RTOL:g}"], rows))
    if memory is not None:
        print()
        if "skipped" in memory:
            print(f"memory: skipped ({memory['skipped']})")
        else:
            mrows = []
            for impl, r in memory["results"].items():
                mrows.append(
                    [
                        impl,
                        r.get("backend", "-"),
                        fmt_bytes(r.get("peak_memory_bytes")),
                        f"{r['seconds_in_worker']:.2f}" if "seconds_in_worker" in r else "-",
                        r.get("error", "")[:80],
                    ]
                )
            print(memory["setting"])
            print(markdown_table(["impl", "backend", "peak MiB", "fit s", "error"], mrows))
    print(f"wrote {path}")
    if not all_pass:
        print("FAILED: some checks disagree beyond the tolerance", file=sys.stderr)
        return 1
    return 0


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "default", *BACKENDS])
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--memory", action="store_true", help="also measure the fits' peak memory")
    p.add_argument("--batch", type=int, default=32, help="memory: batch size")
    p.add_argument("--entries", type=int, default=100, help="memory: subnetwork entries")
    p.add_argument("--width", type=int, default=32, help="memory: CifarNet base channels")
    p.add_argument("--max-gb", type=float, default=16.0, help="memory: worker data-segment cap")
    p.add_argument("--min-free-gb", type=float, default=8.0, help="memory: skip below this")
    p.add_argument("--timeout", type=float, default=1200.0, help="memory: seconds per worker")
    p.add_argument("--out", help="output folder (default: benchmarks/results)")
    p.add_argument("--worker", choices=["ours", "laplace_torch"], help=argparse.SUPPRESS)
    p.add_argument("--limit-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    sys.exit(memory_worker(args) if args.worker else main(args))
