"""A conv block over a list of feature maps, end to end: per-sample Jacobians w.r.t. selected
single weights, with and without an output reduction.

Times the engine's first call (planning and one-off set-up included) separately from warm
calls (the median of three calls after it), and the loop reference warm (one call after a
warm-up call on one sample); the speed-up printed is warm against warm.

Run: python examples/seed_convblock.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import multiscale_jac as mj
from multiscale_jac.models import ConvBlock  # a user's model, unchanged

torch.manual_seed(0)
model = ConvBlock(in_ch=8, out_ch=8).eval()

# 1. uniform levels: a list of batched tensors, exactly what the user passes to the model
features = [torch.randn(4, 8, 16, 16), torch.randn(4, 8, 10, 10)]
n_params = sum(p.numel() for p in model.parameters())
# as in the user's code: indices into the flattened vector of all parameters
subset = mj.ParamSubset.from_flat_indices(model, torch.randperm(n_params)[:300])
print(subset)


def seconds(call: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


t0 = time.perf_counter()
res = mj.per_sample_jacobian(model, features, params=subset)  # the first call plans
first = time.perf_counter() - t0
warm = seconds(lambda: mj.per_sample_jacobian(model, features, params=subset))
one_sample = [f[:1] for f in features]
mj.reference.per_sample_jacobian_loop(model, one_sample, params=subset)  # warm-up
t0 = time.perf_counter()
ref = mj.reference.per_sample_jacobian_loop(model, features, params=subset)
loop = time.perf_counter() - t0
print(res)
print(
    f"engine: first call {first:.3f} s (planning included), warm {warm:.3f} s (median of 3 "
    f"calls after it); loop reference warm {loop:.3f} s (after a one-sample warm-up call); "
    f"warm speed-up {loop / warm:.1f}x"
)
print("max |engine - loop| =", (res.jacobian - ref.jacobian).abs().max().item())

# 2. samples whose levels differ in size from sample to sample, and "another operation to reduce
#    the number of final outputs" (here: sum over positions, keeping the 8 channels of the view)
samples = [
    [torch.randn(8, 16, 16), torch.randn(8, 10, 10)],
    [torch.randn(8, 12, 20), torch.randn(8, 9, 11)],
    [torch.randn(8, 16, 16), torch.randn(8, 10, 10)],
]


def reduce(y: torch.Tensor) -> torch.Tensor:
    return y.sum(dim=1)  # (1, rows, 8) -> (1, 8)


res = mj.per_sample_jacobian(model, samples, params=subset, output_fn=reduce)
ref = mj.reference.per_sample_jacobian_loop(model, samples, params=subset, output_fn=reduce)
print(f"{res}, buckets: {[b.indices for b in mj.pack(samples).buckets()]}")
print("max |engine - loop| =", (res.jacobian - ref.jacobian).abs().max().item())
