"""Layer-wise closed forms (``multiscale_jac.layerwise``) for diag_fisher against the loop and
the vmap route, float64, 1e-10; plans, fallbacks and edge cases."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
from cases import CASES as ZOO
from cases import DTYPE, SLOW_TIER, make_subset
from conftest import CASE_BY_ID, examples, smallest_budget, zoo_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fisher import as_model_input, batches, loop_fisher, make_targets, samples_of
from torch import nn

import multiscale_jac as mj
from multiscale_jac import layerwise
from multiscale_jac.fisher import diag_fisher
from multiscale_jac.testing import images

TOL = 1e-10


def _tensor_output_cases() -> list[str]:
    out = []
    for case in ZOO:
        if case.id.startswith("transformer") or case.id == "shared_dict_head":
            continue  # dict outputs
        out.append(case.id)
    return out


def _no_output_fn() -> list[str]:
    out = []
    for case_id in ZOO_IDS:
        if CASE_BY_ID[case_id].output_fn is None:
            out.append(case_id)
    return out


ZOO_IDS = _tensor_output_cases()
PLAIN_IDS = _no_output_fn()  # the loop of test_fisher applies no output_fn


def _data(case_id: str, likelihood: str, size: int = 3):
    case = CASE_BY_ID[case_id]
    model = zoo_model(case_id)
    samples, kind_in = samples_of(case_id)
    ofn = case.output_fn

    def run(x):
        out = model(as_model_input(x, kind_in))
        return ofn(out) if ofn is not None else out

    outs = [run(x).detach() for x in samples]
    targets = make_targets(outs, likelihood)
    return model, samples, kind_in, targets, batches(samples, targets, kind_in, size), ofn


def _loop_on_tensor(model, x, y, subset) -> torch.Tensor:
    """The loop oracle's empirical classification Fisher for a plain ``(N, ...)`` batch."""
    samples = [[t] for t in x]
    return loop_fisher(
        model, samples, mj.InputKind.TENSOR, list(y), subset, "classification", "empirical"
    )


def _likelihoods(case_id: str) -> list[str]:
    return ["regression"] if case_id.startswith("fpn") else ["classification", "regression"]


def _zoo_params(case_ids: list[str]) -> list:
    """(case, likelihood) pairs; the SLOW_TIER cases in the slow tier."""
    return [
        pytest.param(c, lk, marks=[pytest.mark.slow] * (c in SLOW_TIER))
        for c in case_ids
        for lk in _likelihoods(c)
    ]


@pytest.mark.parametrize("subset_kind", ["elements", "all"])
@pytest.mark.parametrize("case_id, likelihood", _zoo_params(PLAIN_IDS))
def test_empirical_matches_loop(case_id: str, likelihood: str, subset_kind: str) -> None:
    model, samples, kind_in, targets, data, _ = _data(case_id, likelihood)
    subset = make_subset(model, subset_kind, CASE_BY_ID[case_id])
    ref = loop_fisher(model, samples, kind_in, targets, subset, likelihood, "empirical")
    res = diag_fisher(model, data, params=subset, likelihood=likelihood, progress=False)
    assert any(r != "vmap" for r in res.plan.values()), res.plan
    torch.testing.assert_close(res.flat, ref, atol=TOL, rtol=0)


def _zoo_kind_params() -> list:
    """(case, likelihood, kind): the fast tier runs one kind per case and likelihood, turning
    down the list (each kind on a third of them); the slow tier the rest and SLOW_TIER."""
    pairs = [(c, lk) for c in ZOO_IDS for lk in _likelihoods(c)]
    return [
        pytest.param(
            c,
            lk,
            kind,
            id=f"{c}-{lk}-{kind}",
            marks=[pytest.mark.slow] * (c in SLOW_TIER or (p + k) % 3 != 0),
        )
        for p, (c, lk) in enumerate(pairs)
        for k, kind in enumerate(["empirical", "mc", "exact"])
    ]


@pytest.mark.parametrize("case_id, likelihood, kind", _zoo_kind_params())
def test_layerwise_matches_vmap(case_id: str, likelihood: str, kind: str) -> None:
    """Same drawn labels (same generator and chunks) for ``mc``; vmap is checked against the
    loop in test_fisher."""
    model, _, _, _, data, ofn = _data(case_id, likelihood)
    subset = make_subset(model, "elements", CASE_BY_ID[case_id])

    def run(method: str) -> mj.DiagFisherResult:
        return diag_fisher(
            model,
            data,
            params=subset,
            likelihood=likelihood,
            kind=kind,
            method=method,
            output_fn=ofn,
            chunk_size=3,
            generator=torch.Generator().manual_seed(0),
            progress=False,
        )

    got, ref = run("auto"), run("vmap")
    torch.testing.assert_close(got.flat, ref.flat, atol=TOL, rtol=0)
    assert set(ref.plan.values()) <= {"vmap", "jacobian"}


_GRAM_CONVS = {  # (kernel, stride, padding, dilation, groups, size): small maps run "gram"
    "3x3_pad1_2x2": (3, 1, 1, 1, 1, 2),
    "stride2": (3, 2, 1, 1, 1, 5),
    "dilated_pad2": (3, 1, 2, 2, 1, 3),
    "groups2": (3, 1, 1, 1, 2, 2),
    "no_padding": (2, 1, 0, 1, 1, 3),
    "same": (3, 1, "same", 1, 1, 3),
    "1x3_groups2": ((1, 3), 1, (0, 1), 1, 2, 2),
}


@pytest.mark.parametrize("kind", ["empirical", "exact"])
@pytest.mark.parametrize(
    ("geometry", "conv1d"),
    [(g, d) for g in _GRAM_CONVS for d in (False, True) if not d or g != "1x3_groups2"],
    ids=lambda v: v if isinstance(v, str) else ("conv1d" if v else "conv2d"),
)
def test_gram_skips_padding_pairs_exactly(geometry: str, conv1d: bool, kind: str) -> None:
    """The gram rule sums over pairs of positions per kernel offset, leaving out the pairs
    that meet zero padding: equal to vmap(grad) on every geometry where it is chosen; for the
    exact GGN (one objective per class) the classes' pair products are summed before the one
    matmul."""
    kernel, stride, padding, dilation, groups, size = _GRAM_CONVS[geometry]
    conv = (nn.Conv1d if conv1d else nn.Conv2d)(
        4, 6, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups
    )
    torch.manual_seed(0)
    shape = (5, 4, size) if conv1d else (5, 4, size, size)
    with torch.no_grad():
        width = conv(torch.zeros(1, *shape[1:])).numel()
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(width, 3)).to(DTYPE)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(*shape, generator=g, dtype=DTYPE), torch.randint(0, 3, (5,), generator=g))]
    got = diag_fisher(model, data, method="layerwise", kind=kind)
    ref = diag_fisher(model, data, method="vmap", kind=kind)
    torch.testing.assert_close(got.flat, ref.flat, atol=TOL, rtol=0)
    if geometry not in ("stride2", "same", "1x3_groups2") or conv1d:
        assert got.plan["0.weight"] == "gram"


def test_plan_records_rules_and_reasons() -> None:
    model, *_, data, _ = _data("bn_cnn_multicrop", "classification")
    res = diag_fisher(model, data, progress=False)
    assert res.plan["features.1.weight"] == "norm_affine"
    assert res.plan["features.0.weight"] == "per_sample"  # many positions
    assert set(res.plan) == set(mj.ParamSubset.all(model).names)
    mlp, *_, data, _ = _data("mlp_vectors", "classification")
    assert diag_fisher(mlp, data, progress=False).plan["net.0.weight"] == "gram"  # L = 1
    fpn, *_, data, _ = _data("fpn_ragged", "regression")
    plan = diag_fisher(fpn, data, likelihood="regression", progress=False).plan
    assert plan["head.0.weight"] == "per_sample"  # one head over two levels: summed, then squared
    c3d, *_, data, _ = _data("conv3d", "classification")
    res = diag_fisher(c3d, data, progress=False)
    assert res.plan["c1.weight"] == "vmap"
    assert any("Conv3d" in n for n in res.notes)
    with pytest.raises(ValueError, match=r"c1\.weight.*Conv3d"):
        diag_fisher(c3d, data, method="layerwise", progress=False)
    # a parameter that is no module's weight or bias (as the BiFPN's edge weights): vmap, and why
    free = FreeScale().to(DTYPE)
    x = torch.randn(4, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    res = diag_fisher(free, [(x, torch.tensor([0, 2, 1, 0]))], progress=False)
    assert res.plan["scale"] == "vmap" and res.plan["lin.weight"] != "vmap", res.plan
    assert "scale: not the weight or bias of a module -> vmap" in res.notes, res.notes


class FreeScale(nn.Module):
    """A linear map times a parameter of its own (no module's weight or bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class MixesSamples(nn.Module):
    """Subtracts the batch mean: fine per sample (batch of one), wrong on a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h - h.mean(0, keepdim=True) + h


class ReadsWeightOutside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.lin.weight.sum()


@pytest.mark.parametrize(
    "cls, match", [(MixesSamples, "mixes samples"), (ReadsWeightOutside, "outside")]
)
def test_runtime_fallback_warns_and_strict_raises(cls, match) -> None:
    torch.manual_seed(0)
    model = cls().to(DTYPE)
    x = torch.randn(5, 4, dtype=DTYPE)
    y = torch.randint(3, (5,))
    data = [(x, y)]
    ref = _loop_on_tensor(model, x, y, mj.ParamSubset.all(model))
    with pytest.warns(mj.FallbackWarning, match=match):
        res = diag_fisher(model, data, progress=False)
    assert any(match in n for n in res.notes)
    assert set(res.plan.values()) == {"vmap"}
    torch.testing.assert_close(res.flat, ref, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match=match):
        diag_fisher(model, data, progress=False, strict=True)
    with pytest.raises(ValueError, match=match):
        diag_fisher(model, data, progress=False, method="layerwise")


class NormNet(nn.Module):
    """GroupNorm, LayerNorm, a Linear layer over positions (weight shared over them)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.ln = nn.LayerNorm(4)
        self.tok = nn.Linear(4, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.gn(self.conv(x)))  # (n, 4, H, W)
        t = self.ln(h.flatten(2).transpose(1, 2))  # (n, HW, 4)
        return self.out(torch.tanh(self.tok(t)).mean(1))


@pytest.mark.parametrize("budget", [None, "smallest"])
def test_norm_layers_and_shared_positions(budget) -> None:
    torch.manual_seed(0)
    model = NormNet().to(DTYPE)
    with torch.no_grad():
        for m in (model.gn, model.ln):
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.5, 0.5)
    x = torch.randn(5, 2, 3, 4, dtype=DTYPE)
    y = torch.randint(3, (5,))
    subset = mj.ParamSubset.all(model)
    ref = _loop_on_tensor(model, x, y, subset)

    def run(budget):
        return diag_fisher(
            model, [(x, y)], progress=False, memory_budget=budget, method="layerwise"
        )

    res = run(smallest_budget(run) if budget == "smallest" else None)
    assert res.plan["gn.weight"] == res.plan["ln.bias"] == "norm_affine"
    assert res.plan["tok.weight"] == "per_sample"
    torch.testing.assert_close(res.flat, ref, atol=TOL, rtol=0)


def test_leaves_no_hooks_and_model_unchanged() -> None:
    model, *_, data, _ = _data("bn_cnn_multicrop", "classification")
    before = copy.deepcopy(model.state_dict())
    diag_fisher(model, data, kind="mc", progress=False)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert not torch.overrides._get_current_function_mode_stack()


@st.composite
def conv_configs(draw):
    groups = draw(st.sampled_from([1, 2]))
    cin = groups * draw(st.integers(1, 2))
    cout = groups * draw(st.integers(1, 2))
    k = draw(st.integers(1, 3))
    dilation = draw(st.integers(1, 2))
    padding = draw(st.sampled_from([0, 1, "same", "valid"]))
    stride = 1 if padding == "same" else draw(st.integers(1, 2))
    if padding == "same" and dilation * (k - 1) % 2:
        padding = 0
    conv1d = draw(st.booleans())
    # a batch of 1, 2, 3 or 5 inputs, every side at least the kernel's reach, at most 6
    x = draw(
        images(
            channels=cin,
            min_size=dilation * (k - 1) + 1,
            max_size=6,
            batch_size=draw(st.sampled_from([1, 2, 3, 5])),
            ragged=False,
            spatial_dims=1 if conv1d else 2,
            dtype=DTYPE,
        )
    )
    return {
        "conv": dict(
            in_channels=cin,
            out_channels=cout,
            kernel_size=k,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups,
            bias=draw(st.booleans()),
        ),
        "conv1d": conv1d,
        "x": x,
        "shared": draw(st.booleans()),  # one conv applied to two inputs (a shared head)
        "budget": draw(st.sampled_from([None, 1, 2])),  # times the smallest budget
    }


class ConvStack(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        cls = nn.Conv1d if cfg["conv1d"] else nn.Conv2d
        self.conv = cls(**cfg["conv"])
        self.shared = cfg["shared"]
        self.out = nn.LazyLinear(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        if self.shared:
            h = torch.cat([h, torch.tanh(self.conv(x.flip(-1) * 0.5)).flatten(1)], 1)
        return self.out(h)


@settings(max_examples=examples(ci=25, dev=25), deadline=None)
@given(conv_configs())
def test_conv_configs_match_loop(cfg) -> None:
    torch.manual_seed(0)
    model = ConvStack(cfg).to(DTYPE)
    x = cfg["x"]
    model(x)  # materialise the lazy layer
    y = torch.randint(2, (x.shape[0],))
    subset = mj.ParamSubset.all(model)
    ref = _loop_on_tensor(model, x, y, subset)

    def run(budget):
        return diag_fisher(
            model, [(x, y)], progress=False, memory_budget=budget, method="layerwise"
        )

    res = run(None if cfg["budget"] is None else cfg["budget"] * smallest_budget(run))
    torch.testing.assert_close(res.flat, ref, atol=TOL, rtol=0)


@settings(max_examples=examples(ci=20, dev=10), deadline=None)
@given(conv_configs(), st.sampled_from(["probe", 1, 2, 3]))
def test_conv_kernels_match_loop(cfg, kernel) -> None:
    """Per-sample convolution gradients by grouped convolutions (``kernel`` samples a call)
    equal the loop on every geometry; with ``"probe"`` every candidate runs and one sum is kept
    (the size threshold set to 0 so that these small layers are timed)."""
    torch.manual_seed(0)
    model = ConvStack(cfg).to(DTYPE)
    x = cfg["x"]
    model(x)  # materialise the lazy layer
    y = torch.randint(2, (x.shape[0],))
    ref = _loop_on_tensor(model, x, y, mj.ParamSubset.all(model))
    mj.clear_plan_cache()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(layerwise, "PROBE_MIN_FLOPS", 0.0))
        if kernel != "probe":  # as if tune=True had chosen it
            chosen = (f"grouped/{kernel}", kernel)
            stack.enter_context(mock.patch.object(layerwise, "decided", return_value=chosen))
        tune = "measure" if kernel == "probe" else "auto"
        res = diag_fisher(model, [(x, y)], progress=False, method="layerwise", tune=tune)
    torch.testing.assert_close(res.flat, ref, atol=TOL, rtol=0)
    mj.clear_plan_cache()


def test_conv_kernel_probed_once_per_shape() -> None:
    """Under ``tune=True`` a convolution large enough is timed (columns against grouped
    convolutions) on the first call; the second call with the same shapes reuses the choice:
    no probe."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 16, 3))
    data = [(torch.randn(6, 8, 4, 4), torch.randint(3, (6,)))]
    mj.clear_plan_cache()
    with mock.patch.object(layerwise, "PROBE_MIN_FLOPS", 0.0):
        first = diag_fisher(model, data, progress=False, method="layerwise", tune=True)
        probed = mj.plan_cache_info().probed
        second = diag_fisher(model, data, progress=False, method="layerwise", tune=True)
    assert probed >= 1  # timed (candidates within twice the fastest warm-up run twice)
    assert mj.plan_cache_info().probed == probed
    torch.testing.assert_close(first.flat, second.flat, rtol=1e-5, atol=0)
    mj.clear_plan_cache()


@pytest.mark.parametrize(
    "norm", [lambda: nn.LayerNorm(3), lambda: nn.BatchNorm1d(3).eval()], ids=["layernorm", "bn1d"]
)
def test_a_norm_bias_on_rows_leaves_the_gradient_the_backward_goes_on_with(norm) -> None:
    """A norm's bias on ``(N, C)`` rows: its per-sample gradients are the output gradient
    itself, squared in place; that once squared the gradient every layer before it received
    (found by the drawn folding models, tests/test_folding.py: the Linear before it 5 % off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), norm(), nn.Tanh(), nn.Linear(3, 2)).to(DTYPE).eval()
    x, y = torch.randn(4, 2, dtype=DTYPE), torch.tensor([0, 1, 1, 0])
    got = mj.diag_fisher(model, [(x, y)], method="layerwise").flat
    want = mj.diag_fisher(model, [(x, y)], method="vmap").flat
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-15)
