"""The ``demo`` command: the engine against the loop reference on a built-in FPN."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .engine import per_sample_jacobian
from .models import TinyFPN
from .packing import pack
from .reference import per_sample_jacobian_loop
from .subset import ParamSubset

__all__ = ["DemoRow", "run_demo"]

#: Spatial sizes (H, W) of the finest level; the second level is half that (rounded up).
_SIZES = [(10, 10), (8, 12), (10, 10), (12, 8), (8, 8), (8, 12), (10, 10), (9, 7)]


@dataclass(frozen=True)
class DemoRow:
    subset: str
    numel: int
    strategy: str
    mode: str
    shape: tuple[int, ...]
    engine_s: float
    loop_s: float
    max_abs_diff: float


def run_demo(
    *,
    samples: int = 8,
    entries: int = 500,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float64,
) -> list[DemoRow]:
    """Per-sample Jacobians of :class:`TinyFPN` on mixed-size samples, engine vs loop.

    Returns one row per subset (the head, and ``entries`` random single weight entries).
    """
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyFPN(in_channels=(8, 16), width=16, num_outputs=4)
    model = model.to(device=device, dtype=dtype).eval()
    batch = []
    for k in range(samples):
        h, w = _SIZES[k % len(_SIZES)]
        shapes = [(8, h, w), (16, (h + 1) // 2, (w + 1) // 2)]
        batch.append([torch.randn(s, generator=g, dtype=dtype).to(device) for s in shapes])
    packed = pack(batch)
    total = sum(p.numel() for p in model.parameters())
    subsets = {
        "head.*": ParamSubset.from_names(model, "head.*"),
        f"{entries} entries": ParamSubset.from_flat_indices(
            model, torch.randperm(total, generator=g)[:entries]
        ),
    }
    # warm-up on one sample: the first torch.func call in a process pays one-off set-up costs
    for subset in subsets.values():
        for mode in ("rev", "fwd"):
            per_sample_jacobian(model, batch[:1], params=subset, mode=mode)
    rows = []
    for label, subset in subsets.items():
        t0 = time.perf_counter()
        res = per_sample_jacobian(model, packed, params=subset, strategy="auto")
        _sync(device)
        t1 = time.perf_counter()
        ref = per_sample_jacobian_loop(model, packed, params=subset)
        _sync(device)
        t2 = time.perf_counter()
        diff = (res.jacobian - ref.jacobian).abs().max().item()
        ran, shape = (res.strategy.value, res.mode.value), tuple(res.jacobian.shape)
        rows.append(DemoRow(label, subset.numel, *ran, shape, t1 - t0, t2 - t1, diff))
    return rows


def format_rows(rows: list[DemoRow], header: str) -> str:
    lines = [
        header,
        "",
        f"{'subset':<14} {'P':>6} {'strategy':<9} {'mode':<4} {'jacobian (N, O, P)':<20} "
        f"{'engine s':>9} {'loop s':>8} {'speed-up':>8} {'max |diff|':>11}",
    ]
    for r in rows:
        lines.append(
            f"{r.subset:<14} {r.numel:>6} {r.strategy:<9} {r.mode:<4} {r.shape!s:<20} "
            f"{r.engine_s:>9.3f} {r.loop_s:>8.3f} {r.loop_s / r.engine_s:>7.1f}x {r.max_abs_diff:>11.2e}"
        )
    return "\n".join(lines)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
