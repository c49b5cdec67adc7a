"""pack / PackedBatch: round trips, masks, buckets, layouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import multiscale_jac as mj
from multiscale_jac.testing import pyramids


def _assert_same_structure(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)
        return
    assert isinstance(b, list) and len(a) == len(b)
    for x, y in zip(a, b):
        _assert_same_structure(x, y)


@st.composite
def ragged_batches(draw):
    """1-6 samples of 1-4 levels, each level of 1-3 channels and 0-3 spatial dims (sizes 1-5),
    drawn per sample by ``multiscale_jac.testing.pyramids``."""
    num_levels = draw(st.integers(1, 4))
    per_level = {"min_size": num_levels, "max_size": num_levels}
    return draw(
        pyramids(
            channels=draw(st.lists(st.integers(1, 3), **per_level)),
            strides=draw(st.lists(st.integers(1, 3), **per_level)),
            spatial_dims=draw(st.lists(st.integers(0, 3), **per_level)),
            min_size=1,
            max_size=5,
            batch_size=(1, 6),
        )
    )


@given(samples=ragged_batches(), layout=st.sampled_from(["padded", "nested"]))
def test_unpack_pack_round_trip_ragged(samples, layout) -> None:
    packed = mj.pack(samples, layout=layout, input_kind="samples")  # one-channel volumes too
    _assert_same_structure(samples, packed.unpack())
    assert packed.kind == "samples" and packed.num_samples == len(samples)
    # padding is exactly zero and masks mark the valid region
    for lvl, (t, mask) in enumerate(zip(packed.levels, packed.masks)):
        assert mask.shape == (t.shape[0], *t.shape[2:])
        assert torch.all(t.masked_select(~mask.unsqueeze(1).expand_as(t)) == 0)
        assert mask.sum().item() == sum(s[lvl][0].numel() for s in samples)
        assert packed.sizes[lvl].tolist() == [list(s[lvl].shape[1:]) for s in samples]
    # buckets partition the samples, in order, and group equal signatures
    seen = []
    for sig, idx in packed.buckets():
        assert idx == sorted(idx)
        assert all(packed.signatures[i] == sig for i in idx)
        seen += idx
    assert sorted(seen) == list(range(len(samples)))
    assert len(packed.buckets()) == len(set(packed.signatures))
    # stacking a bucket gives exactly its samples
    for _, idx in packed.buckets():
        stacked = packed.stack(idx)
        for k, i in enumerate(idx):
            for lvl in range(packed.num_levels):
                assert torch.equal(stacked[lvl][k], samples[i][lvl])


@given(
    n=st.integers(1, 5),
    shapes=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_unpack_pack_round_trip_batched(n, shapes) -> None:
    levels = [torch.randn(n, *s) for s in shapes]
    packed = mj.pack(levels, input_kind="levels")  # rank-2/3 lists read two ways
    assert packed.kind == "levels" and packed.is_uniform and packed.padding_waste == 0
    _assert_same_structure(levels, packed.unpack())
    single = torch.randn(n, *shapes[0])
    packed = mj.pack(single, layout="nested")
    assert packed.kind == "tensor"
    _assert_same_structure(single, packed.unpack())
    assert packed.unpack() is single  # no copy for uniform input


def test_nested_layout_tokens() -> None:
    samples = [[torch.randn(3, 2, 4)], [torch.randn(3, 1, 5)]]
    packed = mj.pack(samples, layout="nested")
    (nt,) = packed.nested
    assert nt.is_nested and nt.size(0) == 2 and nt.size(2) == 3
    tokens = nt.unbind()
    assert tokens[0].shape == (8, 3) and tokens[1].shape == (5, 3)
    # token k of sample i is spatial position k in row-major order
    assert torch.equal(tokens[0][5], samples[0][0][:, 1, 1])
    assert mj.pack(samples).nested[0].size(0) == 2  # available lazily in the padded layout too
    assert mj.pack(packed, layout="padded").layout == "padded"


def test_padding_waste_and_repr() -> None:
    packed = mj.pack([[torch.randn(1, 2, 2)], [torch.randn(1, 4, 4)]])
    assert packed.padding_waste == pytest.approx(1 - 20 / 32)
    assert packed.levels[0].shape == (2, 1, 4, 4)
    text = repr(packed)
    assert "N=2" in text and "buckets=2" in text


def test_to_moves_and_casts() -> None:
    packed = mj.pack([[torch.randn(2, 3, 3)], [torch.randn(2, 2, 2)]])
    assert packed.to(torch.float32) is packed
    p64 = packed.to(torch.float64)
    assert p64.dtype == torch.float64 and p64.signatures == packed.signatures
    _assert_same_structure([[s.double() for s in smp] for smp in packed.unpack()], p64.unpack())
    with pytest.raises(TypeError, match="floating point"):
        packed.to(torch.int64)


def test_sample_and_stack_errors() -> None:
    packed = mj.pack([[torch.randn(2, 3, 3)], [torch.randn(2, 2, 2)]])
    assert packed.sample(-1)[0].shape == (2, 2, 2)
    with pytest.raises(IndexError, match="out of range"):
        packed.sample(2)
    with pytest.raises(ValueError, match="one shape signature"):
        packed.stack([0, 1])
