"""Padded execution with tensors made inside the forward (``_sizes`` and the masked rules that
read their operands): each op against the loop reference in float64, strict, or refused with
the op and module named."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import multiscale_jac as mj
from multiscale_jac._sizes import PaddedFloat, PaddedSize, make_number, plain
from multiscale_jac.masked import MaskedMode, UnsupportedOpError
from multiscale_jac.reference import per_sample_jacobian_loop

D = torch.float64
#: heights 4, 3, 4 and widths 4, 5, 4: both spatial dims padded
SAMPLES = [[(2, 4, 4)], [(2, 3, 5)], [(2, 4, 4)]]


class Op(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, y):
        return self.fn(y)


class Net(nn.Module):
    """A conv, then the op in a named submodule (``block.0``), so errors can name its path."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.block = nn.Sequential(Op(fn))

    def forward(self, levels):
        return self.block(torch.tanh(self.conv(levels[0])))


def _hw(y):
    return y.shape[-2], y.shape[-1]


def _samples(seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g, dtype=D) for s in sample] for sample in SAMPLES]


EXACT = {
    "ones_type_as": lambda y: y * torch.ones(1).type_as(y),
    "to_other": lambda y: y * torch.ones(1).to(y),
    "arange_type_as": lambda y: y * torch.arange(y.shape[-1]).type_as(y),
    "arange_normalised": lambda y: y * (torch.arange(y.shape[-1]).type_as(y) / (y.shape[-1] - 1)),
    "arange_start_end": lambda y: y * torch.arange(1, y.shape[-1] + 1, dtype=y.dtype),
    "linspace_width": lambda y: y * torch.linspace(0, 1, y.shape[-1], dtype=y.dtype),
    "linspace_height": lambda y: y * torch.linspace(-1, 1, y.shape[-2], dtype=y.dtype)[:, None],
    "linspace_to_size": lambda y: y * torch.linspace(0, y.shape[-1], 3, dtype=y.dtype).sum(),
    "zeros": lambda y: y + torch.zeros(*_hw(y), dtype=y.dtype),
    "full": lambda y: y * torch.full(_hw(y), 2.0, dtype=y.dtype),
    "new_ones": lambda y: y * y.new_ones(_hw(y)),
    "new_zeros_fixed": lambda y: y + y.new_zeros(1),
    "ones_like": lambda y: y + torch.ones_like(y),
    "expand_as_unpadded_self": lambda y: torch.ones(1, 1, 1, 1, dtype=y.dtype).expand_as(y) * y,
    "view_as_unpadded_self": lambda y: (
        y * torch.ones(2, dtype=y.dtype).view_as(y.sum((2, 3), True))
    ),
    "expand_to_padded_size": lambda y: (
        y + torch.ones(y.shape[-2], 1, dtype=y.dtype).expand(*_hw(y))
    ),
    "sum_of_expanded": lambda y: (
        y.mean((2, 3), keepdim=True) * torch.ones(1, 1, dtype=y.dtype).expand(*_hw(y)).sum()
    ),
    "triu_of_padded_size": lambda y: y * torch.ones(*_hw(y), dtype=y.dtype).triu(),
    "meshgrid": lambda y: (
        y
        * torch.stack(
            torch.meshgrid(torch.arange(y.shape[-2]), torch.arange(y.shape[-1]), indexing="ij")
        ).type_as(y)
    ),
    "meshgrid_xy": lambda y: (
        y
        * torch.stack(
            torch.meshgrid(torch.arange(y.shape[-1]), torch.arange(y.shape[-2]), indexing="xy")
        ).type_as(y)
    ),
    "mean_by_sizes": lambda y: y.sum(dim=(2, 3)) / (y.shape[-2] * y.shape[-1]),
    "mean_by_numel": lambda y: y.sum() / y.numel(),
    "len_of_an_unpadded_dim": lambda y: y * len(y[0]),
    "rounded_half": lambda y: y * round(y.shape[-1] / 2),
    "global_avg_pool_by_shape": lambda y: F.avg_pool2d(y, y.shape[2:]),
    "global_max_pool_by_shape": lambda y: F.max_pool2d(y, y.size()[2:]),
    "comparison_that_agrees": lambda y: y * 2 if y.shape[-1] > 2 else y,
}

REFUSED = {
    "comparison_that_differs": (lambda y: y * 2 if y.shape[-1] > 4 else y, "a comparison (gt)"),
    "truth_test_that_differs": (lambda y: y * bool(y.shape[-1] - 4), "a truth test"),
    "int_of_a_size": (lambda y: y * int(y.shape[-1]), "int()"),
    "len_of_a_padded_dim": (lambda y: y * len(y[0, 0]), "len()"),
    "tensor_of_a_size": (
        lambda y: y * torch.tensor(y.shape[-1], dtype=y.dtype),
        "reaches it as a number",
    ),
    "pad_by_a_size": (lambda y: F.pad(y, (0, 8 - y.shape[-1])), "reaches it as a number"),
    "flat_index_against_positions": (
        lambda y: y * torch.arange(y.numel()).type_as(y).view_as(y),
        "different valid regions",
    ),
    "partial_pool_by_a_size": (
        lambda y: F.avg_pool2d(y, (y.shape[-2] // 2, 1)),
        "reaches it as a number",
    ),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_op_with_a_tensor_made_in_the_forward_matches_the_loop(name: str) -> None:
    torch.manual_seed(0)
    model = Net(EXACT[name]).to(D).eval()
    ref = per_sample_jacobian_loop(model, _samples())
    for mode in ("rev", "fwd"):
        res = mj.per_sample_jacobian(model, _samples(), strategy="padded", mode=mode, strict=True)
        assert res.strategy == "padded"
        assert res.output_sizes == ref.output_sizes
        torch.testing.assert_close(res.outputs, ref.outputs, atol=1e-12, rtol=0)
        torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_size_that_decides_per_sample_is_refused_and_named(name: str) -> None:
    fn, why = REFUSED[name]
    torch.manual_seed(0)
    model = Net(fn).to(D).eval()
    with pytest.raises(UnsupportedOpError, match=why.replace("(", r"\(").replace(")", r"\)")) as e:
        mj.per_sample_jacobian(model, _samples(), strategy="padded", strict=True)
    assert e.value.module == "block.0"
    ref = per_sample_jacobian_loop(model, _samples())
    with pytest.warns(mj.FallbackWarning, match="strategy 'padded' cannot run this model"):
        res = mj.per_sample_jacobian(model, _samples(), strategy="padded")
    assert res.strategy == "bucketed"
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)


def test_the_issue_minimal_case_runs_padded_strict() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)

        def forward(self, levels):
            y = self.conv(levels[0])
            return y * torch.ones(1).type_as(y)

    torch.manual_seed(0)
    model = M().double()
    x = [[torch.randn(2, 4, 4, dtype=D)], [torch.randn(2, 3, 5, dtype=D)]]
    res = mj.per_sample_jacobian(model, x, strategy="padded", strict=True)
    ref = per_sample_jacobian_loop(model, x)
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-12, rtol=0)


def test_a_failing_rule_names_the_op_and_module(monkeypatch) -> None:
    """A planning error always says where it was raised, like ``UnsupportedOpError``."""

    def broken(mode, func, args, kwargs):
        raise RuntimeError("shape '[5]' is invalid for input of size 20")

    monkeypatch.setitem(MaskedMode.rules, torch.sigmoid, broken)
    model = Net(torch.sigmoid).to(D).eval()
    with pytest.raises(RuntimeError, match="strict=True forbids") as e:
        mj.per_sample_jacobian(model, _samples(), strategy="padded", strict=True)
    assert "at torch.sigmoid in module 'block.0'" in str(e.value)
    with pytest.warns(mj.FallbackWarning, match=r"at torch.sigmoid in module 'block.0'"):
        res = mj.per_sample_jacobian(model, _samples(), strategy="padded")
    assert "at torch.sigmoid in module 'block.0'" in res.fallback


# ---------------------------------------------------------------------- the numbers
class _Mode:
    def diverged(self, what: str, reason: str) -> ValueError:
        return ValueError(f"{what}: {reason}")


_OPS = [operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod]


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=2, max_size=5),
    other=st.integers(1, 5) | st.floats(0.5, 3.0),
    op=st.sampled_from([*_OPS, operator.truediv]),
    reflected=st.booleans(),
)
def test_arithmetic_keeps_every_samples_value(sizes, other, op, reflected) -> None:
    # Python asks float first, and it takes the int as it is (docs/padded.md)
    assume(not (reflected and isinstance(other, float)))
    padded = max(sizes)
    w = make_number(padded, torch.tensor(sizes), _Mode())
    got = op(other, w) if reflected else op(w, other)
    want = [op(other, s) if reflected else op(s, other) for s in sizes]
    assert plain(got) == (op(other, padded) if reflected else op(padded, other))
    per = (
        got.per_sample.tolist()
        if isinstance(got, (PaddedSize, PaddedFloat))
        else [got] * len(sizes)
    )
    assert per == pytest.approx(want, rel=1e-15, abs=1e-15)


def test_a_number_every_sample_agrees_on_is_plain() -> None:
    w = make_number(5, torch.tensor([5, 3]), _Mode())
    assert isinstance(w, PaddedSize) and int.__int__(w) == 5
    assert type(w - w) is int  # 0 for every sample
    assert type(w > 2) is bool and (w > 2) is True
    assert str(w) == "5" and f"{w:03d}" == "005"
    with pytest.raises(ValueError, match="a comparison"):
        w > 4  # noqa: B015
    with pytest.raises(ValueError, match=r"int\(\)"):
        int(w)
