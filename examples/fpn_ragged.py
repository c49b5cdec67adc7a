"""A detection-style batch: FPN levels whose sizes differ per sample, per-location outputs,
Jacobians w.r.t. the shared head under a memory budget.

Run: python examples/fpn_ragged.py
"""

from __future__ import annotations

import torch

import multiscale_jac as mj
from multiscale_jac.models import TinyFPN

torch.manual_seed(0)
model = TinyFPN(in_channels=(8, 16), width=16, num_outputs=4).eval()

# backbone features at strides 8 and 16 for images of different aspect ratios
sizes = [(12, 16), (16, 12), (12, 16), (10, 10), (14, 8)]
samples = [[torch.randn(8, h, w), torch.randn(16, (h + 1) // 2, (w + 1) // 2)] for h, w in sizes]
packed = mj.pack(samples)
print(packed)
print(f"padding waste if everything were padded to the largest size: {packed.padding_waste:.0%}")

res = mj.per_sample_jacobian(model, packed, params="head.*", memory_budget=512 * 2**20)
print(res, "samples per call:", res.chunk_size, "rows per step:", res.inner_chunk_size)

# outputs differ per sample (they follow the input size): padded rows are zero and masked
print("outputs per sample:", res.output_sizes)
assert res.output_mask is not None
real_rows = res.jacobian[res.output_mask]  # (sum_i O_i, P)
print("real rows:", tuple(real_rows.shape))

# per-parameter blocks, shaped like the parameters
for name, block in res.as_dict().items():
    print(f"  {name:<16} {tuple(block.shape)}")
