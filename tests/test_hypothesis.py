"""Property tests: random level counts, shapes, batch sizes, subsets, modes and chunking."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import multiscale_jac as mj
from multiscale_jac.reference import per_sample_jacobian_loop
from multiscale_jac.testing import param_subsets, pyramids


class RandomPyramid(nn.Module):
    """Per-level 1x1 projections, a 3x3 head shared by all levels, dense per-level outputs."""

    def __init__(self, channels: list[int], width: int, stride: int) -> None:
        super().__init__()
        self.proj = nn.ModuleList(nn.Conv2d(c, width, 1) for c in channels)
        self.shared = nn.Conv2d(width, 2, 3, padding=1, stride=stride)

    def forward(self, levels):
        outs = [
            torch.tanh(self.shared(torch.relu(p(x)))).flatten(1) for p, x in zip(self.proj, levels)
        ]
        return torch.cat(outs, dim=1)


@st.composite
def problems(draw):
    """A random pyramid model with its inputs (one shape per batch, or ragged samples), a
    subset (whole tensors by name or glob, entries, mixtures) and an optional output_fn."""
    num_levels = draw(st.integers(1, 4))
    channels = [draw(st.integers(1, 3)) for _ in range(num_levels)]
    width = draw(st.integers(1, 3))
    stride = draw(st.sampled_from([1, 2]))
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    model = RandomPyramid(channels, width, stride).double().eval()
    # level sizes 1..5 (the finest level) and its floor/ceil over the level strides
    strides = draw(st.lists(st.sampled_from([1, 2, 3]), min_size=num_levels, max_size=num_levels))
    inputs = draw(
        pyramids(
            channels=channels,
            strides=strides,
            min_size=1,
            max_size=5,
            batch_size=(1, 6),
            ragged=draw(st.booleans()),
        )
    )
    subset = draw(param_subsets(model, max_entries=8, max_tensors=3))
    output_fn = draw(st.sampled_from([None, "sum"]))
    fn = (lambda y: y.sum(dim=1, keepdim=True)) if output_fn == "sum" else None
    return model, inputs, subset, fn


@given(
    problem=problems(),
    mode=st.sampled_from(["auto", "rev", "fwd"]),
    strategy=st.sampled_from(["auto", "bucketed"]),
    chunk_size=st.sampled_from([None, 1, 2, 5]),
)
def test_engine_equals_loop_on_random_pyramids(problem, mode, strategy, chunk_size) -> None:
    model, inputs, subset, output_fn = problem
    ref = per_sample_jacobian_loop(model, inputs, params=subset, output_fn=output_fn)
    res = mj.per_sample_jacobian(
        model,
        inputs,
        params=subset,
        output_fn=output_fn,
        mode=mode,
        strategy=strategy,
        chunk_size=chunk_size,
    )
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    assert res.output_sizes == ref.output_sizes
    assert (res.output_mask is None) == (ref.output_mask is None)
    if ref.output_mask is not None:
        assert torch.equal(res.output_mask, ref.output_mask)


@given(problem=problems(), data=st.data())
def test_bucketed_results_come_back_in_input_order(problem, data) -> None:
    """Permuting the samples permutes the per-sample Jacobians the same way."""
    model, inputs, subset, output_fn = problem
    packed = mj.pack(inputs)
    samples = [packed.sample(i) for i in range(packed.num_samples)]
    perm = data.draw(st.permutations(range(len(samples))))
    res = mj.per_sample_jacobian(
        model, [samples[i] for i in perm], params=subset, output_fn=output_fn
    )
    base = mj.per_sample_jacobian(model, samples, params=subset, output_fn=output_fn)
    for k, i in enumerate(perm):
        o = base.output_sizes[i]
        assert res.output_sizes[k] == o
        torch.testing.assert_close(res.jacobian[k, :o], base.jacobian[i, :o], atol=1e-12, rtol=0)
