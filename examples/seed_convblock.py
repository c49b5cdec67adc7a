"""A conv block over a list of feature maps, end to end: per-sample Jacobians w.r.t. selected
single weights, with and without an output reduction.

Run: python examples/seed_convblock.py
"""

from __future__ import annotations

import time

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

t0 = time.perf_counter()
res = mj.per_sample_jacobian(model, features, params=subset)
t1 = time.perf_counter()
ref = mj.reference.per_sample_jacobian_loop(model, features, params=subset)
t2 = time.perf_counter()
print(f"{res}: {t1 - t0:.2f}s; loop reference {t2 - t1:.2f}s")
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
