"""The loop reference itself, checked against finite differences and plain batched autograd."""

from __future__ import annotations

import pytest
import torch
from cases import CASES, SLOW_TIER, make_subset
from conftest import zoo_model, zoo_reference

import multiscale_jac as mj
from multiscale_jac.adapter import PerSampleFunction
from multiscale_jac.reference import per_sample_jacobian_loop


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.id, marks=[pytest.mark.slow] * (c.id in SLOW_TIER)) for c in CASES],
)
def test_reference_matches_central_differences(case) -> None:
    """Each Jacobian column equals (f(theta + h e_j) - f(theta - h e_j)) / 2h per sample."""
    model = zoo_model(case.id)
    subset, ref = zoo_reference(case.id, "elements")
    inputs = case.inputs()
    packed = inputs if isinstance(inputs, mj.PackedBatch) else mj.pack(inputs)
    fn = PerSampleFunction(
        model, subset, packed.kind, case.output_fn, tokens=packed.layout == "nested"
    )
    values = fn.values()
    h = 1e-6
    flat = torch.cat([v.reshape(-1) for v in values])
    for j in range(subset.numel):
        plus, minus = flat.clone(), flat.clone()
        plus[j] += h
        minus[j] -= h
        vp = tuple(subset.split(plus)[n] for n in subset.names)
        vm = tuple(subset.split(minus)[n] for n in subset.names)
        for i in range(packed.num_samples):
            lv = packed.sample(i)
            col = (fn(vp, *lv) - fn(vm, *lv)) / (2 * h)
            torch.testing.assert_close(ref.jacobian[i, : col.numel(), j], col, atol=1e-6, rtol=1e-6)


def test_reference_on_uniform_batch_equals_batched_autograd() -> None:
    """For a model without cross-sample interaction, the per-sample Jacobian equals the
    Jacobian of the batched output w.r.t. the parameters, sample block by sample block."""
    case = next(c for c in CASES if c.id == "seed_convblock_levels")
    model = zoo_model(case.id)
    subset = make_subset(model, "names", case)
    feats = case.inputs()
    ref = per_sample_jacobian_loop(model, feats, params=subset)
    (name,) = [n for n in subset.names if n.endswith("weight")]
    w = dict(model.named_parameters())[name]
    out = model(feats)  # (N, rows, 8)
    n = out.shape[0]
    flat = out.reshape(n, -1)
    for i in range(n):
        for r in range(0, flat.shape[1], 17):
            (g,) = torch.autograd.grad(flat[i, r], w, retain_graph=True)
            lo, hi = subset.offsets[name]
            torch.testing.assert_close(ref.jacobian[i, r, lo:hi], g.reshape(-1), atol=1e-12, rtol=0)


def test_reference_records_loop() -> None:
    case = CASES[0]
    _, ref = zoo_reference(case.id, "all")
    assert ref.strategy == "loop" and ref.mode == "rev" and ref.fallback is None
