"""Masked (padded) execution against the unpadded model and the loop oracle, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import multiscale_jac as mj
from multiscale_jac.adapter import PerSampleFunction
from multiscale_jac.masked import SUPPORTED_OPS, PaddedFunction, UnsupportedOpError
from multiscale_jac.reference import per_sample_jacobian_loop
from multiscale_jac.testing import param_subsets, pyramids

D = torch.float64
EXAMPLES = examples(ci=300, dev=40)


# ---------------------------------------------------------------------- random conv stacks
class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


class Upsample2(nn.Module):
    def forward(self, x):
        return F.interpolate(x, scale_factor=2, mode="nearest")


class StackNet(nn.Module):
    """Per-level 1x1 projections, a body shared by every level, a dense or pooled head."""

    def __init__(self, channels: list[int], width: int, body: list[nn.Module], head: str) -> None:
        super().__init__()
        self.proj = nn.ModuleList(nn.Conv2d(c, width, 1) for c in channels)
        self.body = nn.Sequential(*body)
        self.head_kind = head
        self.head = nn.Conv2d(width, 2, 1) if head == "dense" else nn.Linear(width, 2)

    def forward(self, levels):
        outs = []
        for p, x in zip(self.proj, levels):
            y = self.body(p(x))
            if self.head_kind == "dense":
                outs.append(self.head(y).flatten(1))
            elif self.head_kind == "gap":
                outs.append(self.head(F.adaptive_avg_pool2d(y, 1).flatten(1)))
            else:
                outs.append(self.head(y.amax(dim=(2, 3))))
        return torch.cat(outs, dim=1)


@st.composite
def layers(draw, width: int) -> nn.Module:
    kind = draw(
        st.sampled_from(
            ["conv", "conv", "maxpool", "avgpool", "up", "res", "bn", "gn", "in", "act"]
        )
    )
    if kind == "conv":
        k = draw(st.sampled_from([1, 3, 5]))
        s = draw(st.sampled_from([1, 2]))
        d = draw(st.sampled_from([1, 2])) if k > 1 else 1
        g = draw(st.sampled_from([1, width]))
        pad = draw(st.sampled_from(["half", "same"])) if s == 1 else "half"
        padding = "same" if pad == "same" else d * (k - 1) // 2
        return nn.Conv2d(width, width, k, stride=s, padding=padding, dilation=d, groups=g)
    if kind == "maxpool":
        k, s, p = draw(st.sampled_from([(3, 2, 1), (2, 2, 1), (3, 1, 1), (2, 1, 1)]))
        return nn.MaxPool2d(k, s, p, ceil_mode=draw(st.booleans()))
    if kind == "avgpool":
        k, s, p = draw(st.sampled_from([(3, 2, 1), (2, 2, 1), (3, 1, 1)]))
        return nn.AvgPool2d(
            k, s, p, ceil_mode=draw(st.booleans()), count_include_pad=draw(st.booleans())
        )
    if kind == "up":
        return Upsample2()
    if kind == "res":
        return Residual(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.Tanh()))
    if kind == "bn":
        bn = nn.BatchNorm2d(width)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        return bn
    if kind in ("gn", "in"):
        norm = (
            nn.GroupNorm(draw(st.sampled_from([1, width])), width)
            if kind == "gn"
            else nn.InstanceNorm2d(width, affine=True)
        )
        # PyTorch's initial bias is 0: a group of two normalised values then sums to 0 up to
        # rounding, and an average pool followed by a ReLU sits on its kink, where the padded
        # run and the loop may round to different sides (a tie, not a rule bug).
        norm.weight.data.uniform_(0.5, 1.5)
        norm.bias.data.uniform_(-1, 1)
        return norm
    return draw(st.sampled_from([nn.ReLU(), nn.Tanh(), nn.Sigmoid(), nn.GELU(), nn.LeakyReLU(0.1)]))


@st.composite
def stacks(draw):
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    width = draw(st.sampled_from([1, 2]))
    num_levels = draw(st.integers(1, 3))
    channels = [draw(st.integers(1, 2)) for _ in range(num_levels)]
    body = draw(st.lists(layers(width), min_size=1, max_size=4))
    head = draw(st.sampled_from(["dense", "gap", "max"]))
    model = StackNet(channels, width, body, head).to(D).eval()
    strides = draw(st.lists(st.integers(1, 3), min_size=num_levels, max_size=num_levels))
    samples = draw(
        pyramids(channels=channels, strides=strides, max_size=6, batch_size=(1, 4), dtype=D)
    )
    return model, samples


def _subset(model: nn.Module, data) -> mj.ParamSubset:
    return data.draw(param_subsets(model, kinds=("tensors", "indices"), max_entries=9))


def padded_outputs_match(model: nn.Module, samples) -> bool:
    """Every sample's real padded outputs equal its unpadded outputs and the rest are zero; or
    the unpadded model fails on some sample and the padded run refuses too (returns False)."""
    packed = mj.pack(samples)
    fn = PerSampleFunction(model, mj.ParamSubset.all(model), packed.kind)
    pf = PaddedFunction(fn, packed)
    values = fn.values()
    try:
        expected = [fn(values, *packed.sample(i)) for i in range(packed.num_samples)]
    except (RuntimeError, ValueError):
        # the padded run refuses too: our rule's error, or PyTorch's when nothing is padded
        with pytest.raises(ValueError, match=r"the unpadded model fails too|Expected more than 1"):
            for i in range(packed.num_samples):
                pf(values, *(t[i] for t in packed.levels), torch.tensor(i))
        return False
    for i in range(packed.num_samples):
        out = pf(values, *(t[i] for t in packed.levels), torch.tensor(i))
        real = pf.output_table[i]
        torch.testing.assert_close(out[real], expected[i], atol=1e-10, rtol=0)
        assert torch.all(out[~real] == 0)
    return True


@settings(max_examples=EXAMPLES)
@given(
    problem=stacks(),
    data=st.data(),
    mode=st.sampled_from(["rev", "fwd"]),
    chunk=st.sampled_from([None, 1, 3]),
)
def test_random_stacks_padded_equal_loop(problem, data, mode, chunk) -> None:
    model, samples = problem
    if not padded_outputs_match(model, samples):
        return
    subset = _subset(model, data)
    ref = per_sample_jacobian_loop(model, samples, params=subset)
    res = mj.per_sample_jacobian(
        model, samples, params=subset, strategy="padded", mode=mode, chunk_size=chunk, strict=True
    )
    assert res.strategy == "padded"
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    assert res.output_sizes == ref.output_sizes


# ---------------------------------------------------------------------- unsupported ops
class Op(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.conv(x)).flatten(1)


class Wrapper(nn.Module):
    """Puts the op in a named submodule, so the error can name its path."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.block = nn.Sequential(Op(fn))

    def forward(self, levels):
        return self.block(levels[0])


UNSUPPORTED = [
    (
        "bilinear",
        lambda y: F.interpolate(y, scale_factor=2, mode="bilinear"),
        "F.interpolate",
        "mode='bilinear'",
    ),
    ("interpolate_size", lambda y: F.interpolate(y, size=(5, 5)), "F.interpolate", "size="),
    (
        "view_mixing_channels",
        lambda y: y.reshape(1, -1, 2).sum(1),
        "Tensor.sum",
        "part of a flattened padded group",
    ),
    (
        "data_dependent_index",
        lambda y: y[:, :, torch.tensor([0, 1])],
        "Tensor.__getitem__",
        "advanced indexing",
    ),
    ("reflect_pad", lambda y: F.pad(y, (1, 1, 1, 1), mode="reflect"), "F.pad", "no exact rule"),
    (
        "adaptive_pool_2x2",
        lambda y: F.adaptive_avg_pool2d(y, 2),
        "F.adaptive_avg_pool2d",
        "only output size 1",
    ),
    (
        "max_pool_indices",
        lambda y: F.max_pool2d(y, 2, return_indices=True)[0],
        "F.max_pool2d_with_indices",
        "no exact rule",
    ),
    (
        "inplace_sigmoid",
        lambda y: y.clone().sigmoid_(),
        "Tensor.sigmoid_",
        "backward reads its output",
    ),
    (
        "linear_over_width",  # range() hides that the width is padded (see _sizes)
        lambda y: nn.functional.linear(y, torch.ones(2, len(range(y.shape[-1])), dtype=y.dtype)),
        "F.linear",
        "over a padded dim",
    ),
    (  # a weight made of the padded width is itself padded (each sample its own width)
        "linear_weight_of_padded_width",
        lambda y: nn.functional.linear(y, torch.ones(2, y.shape[-1], dtype=y.dtype)),
        "F.linear",
        "padded tensor as the right operand",
    ),
]


@pytest.mark.parametrize(
    ("fn", "op", "why"), [u[1:] for u in UNSUPPORTED], ids=[u[0] for u in UNSUPPORTED]
)
def test_unsupported_op_is_named_and_falls_back(fn, op, why) -> None:
    torch.manual_seed(0)
    model = Wrapper(fn).to(D).eval()
    samples = [
        [torch.randn(2, 4, 4, dtype=D)],
        [torch.randn(2, 3, 5, dtype=D)],
        [torch.randn(2, 4, 4, dtype=D)],
    ]
    with pytest.raises(UnsupportedOpError, match=why) as info:
        mj.per_sample_jacobian(model, samples, strategy="padded", strict=True)
    assert info.value.op == op
    assert info.value.module == "block.0"
    assert f"{op} in module 'block.0'" in str(info.value)
    ref = per_sample_jacobian_loop(model, samples)
    with pytest.warns(mj.FallbackWarning, match="strategy 'padded' cannot run this model"):
        res = mj.per_sample_jacobian(model, samples, strategy="padded")
    assert res.strategy == "bucketed" and why.split("=")[0] in res.fallback
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)


def test_interpolate_to_a_padded_shape_falls_back_when_its_input_is_unpadded() -> None:
    """An FPN top-down step, ``fine + interpolate(coarse, size=fine.shape[-2:])``, where only
    the fine level is ragged: the size is the fine level's canvas, not each sample's own, so
    padded execution must refuse it (it ran and gave wrong outputs for the narrower samples)."""

    class TopDown(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lateral = nn.Conv2d(3, 2, 1)

        def forward(self, levels):
            fine, coarse = levels
            p = self.lateral(fine) + F.interpolate(coarse, size=fine.shape[-2:], mode="nearest")
            return p.flatten(1)

    torch.manual_seed(0)
    model = TopDown().to(D).eval()
    g = torch.Generator().manual_seed(0)
    samples = [  # the coarse level is (2, 1, 2) in every sample: never padded
        [torch.randn(3, 1, w, generator=g, dtype=D), torch.randn(2, 1, 2, generator=g, dtype=D)]
        for w in (4, 4, 5)
    ]
    with pytest.raises(UnsupportedOpError, match="size=") as info:
        mj.per_sample_jacobian(model, samples, strategy="padded", strict=True)
    assert info.value.op == "F.interpolate"
    ref = per_sample_jacobian_loop(model, samples)
    with pytest.warns(mj.FallbackWarning, match="strategy 'padded' cannot run this model"):
        res = mj.per_sample_jacobian(model, samples, strategy="padded")
    assert res.strategy == "bucketed"
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)


def test_binary_op_on_different_regions_is_unsupported() -> None:
    class TwoLevels(nn.Module):
        def forward(self, levels):
            a, b = levels
            return (a * self.w + b).flatten(1)

    model = TwoLevels().to(D)
    model.w = nn.Parameter(torch.ones(1, dtype=D))
    samples = [
        [torch.randn(1, 3, 3, dtype=D), torch.randn(1, 3, 3, dtype=D)],
        [torch.randn(1, 2, 2, dtype=D), torch.randn(1, 2, 3, dtype=D)],
    ]
    with pytest.raises(UnsupportedOpError, match="different valid regions"):
        mj.per_sample_jacobian(model, samples, strategy="padded", strict=True)


def test_kernel_too_large_for_a_sample_is_a_clear_error() -> None:
    model = Wrapper(lambda y: F.conv2d(y, torch.ones(1, 2, 3, 3, dtype=y.dtype))).to(D)
    samples = [[torch.randn(2, 4, 4, dtype=D)], [torch.randn(2, 2, 5, dtype=D)]]
    with pytest.raises(
        ValueError, match=r"sample 1 has valid size \(2, 5\).*too small for kernel \(3, 3\)"
    ):
        mj.per_sample_jacobian(model, samples, strategy="padded")


def test_supported_ops_catalogue() -> None:
    for name in [
        "F.conv2d",
        "F.max_pool2d",
        "F.avg_pool2d",
        "F.interpolate",
        "F.group_norm",
        "torch.cat",
        "Tensor.flatten",
    ]:
        assert name in SUPPORTED_OPS


@pytest.mark.parametrize(
    "fn",
    [
        lambda y: y / (y * y + 1),
        lambda y: y.clone().div_(y * y + 1),
        lambda y: torch.tanh_(y.clone()) + 1,
        lambda y: y.clone().relu_() - 0.5,
    ],
    ids=["div", "div_inplace", "tanh_inplace", "relu_inplace"],
)
@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_inplace_and_singular_ops_are_exact(fn, mode) -> None:
    torch.manual_seed(0)
    model = Wrapper(fn).to(D).eval()
    samples = [[torch.randn(2, 4, 4, dtype=D)], [torch.randn(2, 3, 5, dtype=D)]]
    ref = per_sample_jacobian_loop(model, samples)
    res = mj.per_sample_jacobian(model, samples, strategy="padded", mode=mode, strict=True)
    assert res.strategy == "padded"
    assert torch.isfinite(res.jacobian).all()
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)


def test_runtime_error_in_padded_planning_falls_back_to_buckets() -> None:
    """A view that only works on the unpadded sizes: PyTorch fails on the padded tensor."""
    model = Wrapper(lambda y: y.reshape(-1)[None, :].reshape(1, -1, 5).sum(-1)).to(D).eval()
    samples = [[torch.randn(2, 5, 5, dtype=D)], [torch.randn(2, 5, 5, dtype=D)]]
    samples.append([torch.randn(2, 5, 3, dtype=D)])  # 30 values; padded to 50: fine; 2x5x6?
    samples.append([torch.randn(2, 6, 5, dtype=D)])  # the padded sample is 2x6x5=60
    ref = per_sample_jacobian_loop(model, samples)
    with pytest.raises((RuntimeError, UnsupportedOpError)):
        mj.per_sample_jacobian(model, samples, strategy="padded", strict=True)
    with pytest.warns(mj.FallbackWarning, match="strategy 'padded'"):
        res = mj.per_sample_jacobian(model, samples, strategy="padded")
    assert res.strategy == "bucketed"
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    auto = mj.per_sample_jacobian(model, samples, tune=True)  # (planned in full)
    assert auto.strategy == "bucketed" and "not possible" in auto.notes[0]
