"""map_levels: the canvas packing equals the per-level loop, alone and under per_sample_jacobian."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from test_padded import layers
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import multiscale_jac as mj
from multiscale_jac.levels import AUTO_PACKING, LevelOutputs, map_levels
from multiscale_jac.models import SharedHeadFPN
from multiscale_jac.reference import per_sample_jacobian_loop
from multiscale_jac.testing import pyramids

D = torch.float64
EXAMPLES = examples(ci=200, dev=30)
SIZES = [(9, 13), (5, 7), (3, 4), (2, 2)]


def _levels(sizes, channels: int = 3, batch: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, channels, h, w, generator=g, dtype=D) * 2 + 0.5 for h, w in sizes]


def _randomise(module: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module.to(D).eval()


def _assert_equal_to_loop(module, levels, **kwargs) -> LevelOutputs:
    out = map_levels(module, levels, **kwargs)
    expected = [module(x) for x in levels]
    assert isinstance(out, LevelOutputs) and len(out) == len(levels)
    for a, b in zip(out, expected):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0)
    assert not _get_current_function_mode_stack(), "a TorchFunctionMode was left behind"
    return out


class TwoBranch(nn.Module):
    """Concatenation along channels and a residual add on the canvas."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 2, 3, padding=1)
        self.b = nn.Conv2d(3, 2, 1)
        self.out = nn.Conv2d(4, 3, 3, padding=2, dilation=2)

    def forward(self, x):
        y = torch.cat([F.relu(self.a(x)), torch.sigmoid(self.b(x))], dim=1)
        return x + self.out(y)


HEADS = {
    "conv_gn_relu": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)
    ),
    "strided_conv": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Tanh(), nn.Conv2d(4, 2, 3, stride=2, padding=1)
    ),
    "grouped_dilated": lambda: nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=2, dilation=2, groups=3), nn.GELU(), nn.Conv2d(6, 2, 1)
    ),
    "same_padding": lambda: nn.Sequential(nn.Conv2d(3, 3, 5, padding="same"), nn.SiLU()),
    "max_pool_ceil": lambda: nn.Sequential(
        nn.Conv2d(3, 3, 3, padding=1), nn.MaxPool2d(3, 2, 1, ceil_mode=True), nn.Conv2d(3, 2, 1)
    ),
    "avg_pool_excl": lambda: nn.Sequential(
        nn.AvgPool2d(3, 2, 1, count_include_pad=False), nn.Conv2d(3, 2, 3, padding=1)
    ),
    "avg_pool_incl_ceil": lambda: nn.Sequential(
        nn.AvgPool2d(2, 2, 1, ceil_mode=True), nn.Conv2d(3, 2, 1)
    ),
    "upsample_nearest": lambda: nn.Sequential(
        nn.Conv2d(3, 3, 3, padding=1), nn.Upsample(scale_factor=2), nn.Conv2d(3, 2, 3, padding=1)
    ),
    "batchnorm_eval": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)
    ),
    "instance_norm": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True), nn.Conv2d(4, 2, 1)
    ),
    "cat_and_residual": TwoBranch,
    "division": lambda: nn.Sequential(nn.Conv2d(3, 3, 1), _Fn(lambda x: x / (x * x + 1))),
}


class _Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("head", list(HEADS))
def test_canvas_equals_loop(head: str) -> None:
    module = _randomise(HEADS[head]())
    out = _assert_equal_to_loop(module, _levels(SIZES), packing="canvas", strict=True)
    assert out.packing == "canvas" and out.reason is None


@st.composite
def level_lists(draw) -> list[torch.Tensor]:
    """2-5 batched levels ``(1-3, 2, H, W)``: the finest 1-9 per side, the others its floor or
    ceiling over strides 1-4 in any order (so a later level may be the larger); values
    ``2 z + 0.5`` as in :func:`_levels`."""
    num_levels = draw(st.integers(2, 5))
    strides = draw(st.lists(st.integers(1, 4), min_size=num_levels, max_size=num_levels))
    levels = draw(
        pyramids(channels=2, strides=strides, max_size=9, batch_size=(1, 3), ragged=False, dtype=D)
    )
    return [x * 2 + 0.5 for x in levels]


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    body=st.lists(layers(2), min_size=1, max_size=4),
    levels=level_lists(),
    gutter=st.none() | st.integers(0, 4),
)
def test_random_heads_canvas_equals_loop(body, levels, gutter) -> None:
    """Every layer kind of the padded rule set; the canvas either matches the loop exactly or
    falls back to the loop (a gutter too narrow, a level too small for a kernel)."""
    module = nn.Sequential(*body).to(D).eval()
    try:
        expected = [module(x) for x in levels]
    except (RuntimeError, ValueError):  # the plain loop fails on some level: so must we
        with pytest.raises((RuntimeError, ValueError)), warnings.catch_warnings():
            warnings.simplefilter("ignore", mj.FallbackWarning)
            map_levels(module, levels, packing="canvas", gutter=gutter)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", mj.FallbackWarning)
        out = map_levels(module, levels, packing="canvas", gutter=gutter)
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    if gutter is None:  # the default gutter is always wide enough for these layers
        assert out.packing == "canvas", out.reason
    assert (out.packing == "loop") == bool(caught)


@pytest.mark.parametrize(("sizes", "first"), [([(1, 1), (1, 1)], 0), ([(3, 2), (1, 1)], 1)])
def test_instance_norm_of_a_single_pixel_level_raises_like_the_loop(sizes, first) -> None:
    """InstanceNorm with input statistics refuses one spatial element per channel; so does the
    canvas, instead of normalising the level (found by the random heads above)."""
    module = nn.Sequential(nn.InstanceNorm2d(2, affine=True)).to(D).eval()
    levels = _levels(sizes, channels=2, batch=2)
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        [module(x) for x in levels]
    for strict in (False, True):
        with pytest.raises(ValueError, match=f"level {first} normalises a single value"):
            map_levels(module, levels, packing="canvas", strict=strict)
    assert not _get_current_function_mode_stack()


def test_default_gutter_runs_the_canvas_and_zero_gutter_falls_back() -> None:
    module = _randomise(HEADS["conv_gn_relu"]())
    levels = _levels(SIZES)
    with pytest.raises(mj.UnsupportedOpError, match=r"gutter between levels .* narrower"):
        map_levels(module, levels, packing="canvas", gutter=0, strict=True)
    with pytest.warns(mj.FallbackWarning, match="gutter"):
        out = _assert_equal_to_loop(module, levels, packing="canvas", gutter=0)
    assert out.packing == "loop" and "gutter" in out.reason


class Bilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        return F.interpolate(self.conv(x), scale_factor=2, mode="bilinear")


def test_unsupported_op_names_op_and_module_and_falls_back() -> None:
    module = _randomise(nn.Sequential(nn.Conv2d(3, 3, 1), Bilinear()))
    levels = _levels(SIZES)
    with pytest.raises(mj.UnsupportedOpError, match=r"F\.interpolate.*'1'.*nearest") as err:
        map_levels(module, levels, packing="canvas", strict=True)
    assert "map_levels" in str(err.value)
    with pytest.warns(mj.FallbackWarning, match="interpolate"):
        out = _assert_equal_to_loop(module, levels, packing="canvas")
    assert out.packing == "loop" and out.requested == "canvas"
    # the module was not changed and no mode is left behind by the failed canvas run
    assert not _get_current_function_mode_stack()


def test_non_spatial_output_falls_back() -> None:
    module = _randomise(nn.Sequential(nn.Conv2d(3, 2, 3, padding=1), nn.Flatten()))
    with pytest.warns(mj.FallbackWarning):
        out = map_levels(module, _levels(SIZES), packing="canvas")
    assert out.packing == "loop"


def test_auto_packing_is_the_loop_on_cpu_and_records_it() -> None:
    assert AUTO_PACKING["cpu"] == "loop"
    module = _randomise(HEADS["conv_gn_relu"]())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _assert_equal_to_loop(module, _levels(SIZES))
    assert (out.packing, out.requested, out.reason) == ("loop", "auto", "auto on cpu")


def test_loop_packing_and_single_level() -> None:
    module = _randomise(HEADS["strided_conv"]())
    assert _assert_equal_to_loop(module, _levels(SIZES), packing="loop").reason is None
    one = _assert_equal_to_loop(module, _levels(SIZES[:1]), packing="canvas")
    assert one.packing == "loop" and one.reason == "one level"


@pytest.mark.parametrize(
    ("levels", "kwargs", "message"),
    [
        ([], {}, "empty list"),
        ([torch.zeros(1, 3, 4)], {}, r"level 0 must be a \(B, C, H, W\) tensor; got \(1, 3, 4\)"),
        (
            [torch.zeros(1, 3, 4, 4), torch.zeros(1, 2, 2, 2)],
            {},
            r"level 1 has batch/channels \(1, 2\) but level 0 has \(1, 3\)",
        ),
        ([torch.zeros(1, 3, 4, 4)], {"packing": "stack"}, "unknown packing 'stack'"),
        ([torch.zeros(1, 3, 4, 4)], {"gutter": -1}, "gutter must be a non-negative int; got -1"),
    ],
    ids=["empty", "rank", "channels", "packing", "gutter"],
)
def test_bad_input(levels, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        map_levels(nn.Identity(), levels, **kwargs)


@pytest.mark.parametrize(
    ("module", "kwargs", "error", "message"),
    [
        ("conv", {}, TypeError, "module must be callable; got str"),
        (nn.Identity(), {"strict": 1}, TypeError, "strict must be True or False; got 1"),
        (
            nn.Identity(),
            {"gutter": True},
            ValueError,
            "gutter must be a non-negative int; got True",
        ),
    ],
    ids=["module", "strict", "gutter-bool"],
)
def test_bad_argument_types(module, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        map_levels(module, [torch.zeros(1, 3, 4, 4)], **kwargs)


# ---------------------------------------------------------------------- under the engine
def _shared_head_pair():
    torch.manual_seed(0)
    canvas = SharedHeadFPN(in_channels=(2, 3, 2), width=4, num_outputs=2, packing="canvas")
    loop = SharedHeadFPN(in_channels=(2, 3, 2), width=4, num_outputs=2, packing="loop")
    loop.load_state_dict(canvas.state_dict())
    return canvas.to(D).eval(), loop.to(D).eval()


def _shared_head_samples():
    g = torch.Generator().manual_seed(3)
    sizes = [[(8, 6), (4, 3), (2, 2)], [(6, 10), (3, 5), (2, 3)], [(8, 6), (4, 3), (2, 2)]]
    return [
        [torch.randn(c, h, w, generator=g, dtype=D) for c, (h, w) in zip((2, 3, 2), sig)]
        for sig in sizes
    ]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["vmap", "bucketed", "padded", "loop"])
@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_shared_head_jacobian_through_canvas_equals_loop_oracle(strategy, mode) -> None:
    canvas, loop = _shared_head_pair()
    samples = _shared_head_samples()
    if strategy == "vmap":  # one shape signature
        samples = [samples[0], samples[2]]
    subset = mj.ParamSubset.from_names(canvas, "head.*")
    ref = per_sample_jacobian_loop(loop, samples, params=mj.ParamSubset.from_names(loop, "head.*"))
    res = mj.per_sample_jacobian(
        canvas, samples, params=subset, strategy=strategy, mode=mode, strict=True
    )
    assert res.strategy == strategy
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
    assert res.output_sizes == ref.output_sizes


def test_canvas_under_vmap_records_canvas() -> None:
    """Inside vmap(jacrev) the canvas path really runs (it is not silently the loop)."""
    canvas, _ = _shared_head_pair()
    seen = []

    def spy(module, levels, **kw):
        out = map_levels(module, levels, **kw)
        seen.append(out.packing)
        return out

    import multiscale_jac.levels as levels_mod

    original = levels_mod.map_levels
    levels_mod.map_levels = spy
    try:
        mj.per_sample_jacobian(
            canvas, _shared_head_samples()[:1], params=mj.ParamSubset.from_names(canvas, "head.0.*")
        )
    finally:
        levels_mod.map_levels = original
    assert seen and set(seen) == {"canvas"}
