"""The user's model is left exactly as found (``_state``): attributes a module's forward writes
(ultralytics-style anchor caches, an in-place counter) are put back after every entry point, on
every path, and the model's own forward on every shape seen gives what it gave before."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from cases import CASE_IDS, DTYPE, SLOW_TIER, AnchorCacheHead
from conftest import CASE_BY_ID
from torch import Tensor, nn

import multiscale_jac as mj
from multiscale_jac.reference import per_sample_jacobian_loop

CASE = CASE_BY_ID["anchor_cache_head"]


def _logits(out: Tensor) -> Tensor:
    return out.mean(-1)  # (1, 4): per-sample class logits for the curvature entry points


def _attributes(model: nn.Module) -> dict:
    """Every module's instance attributes outside parameters, buffers and submodules: tensors
    by value (and whether functorch wrapped them), the rest by value."""
    out = {}
    for path, m in model.named_modules():
        for k, v in vars(m).items():
            if k in ("_parameters", "_buffers", "_modules") or k.startswith("_forward"):
                continue
            if isinstance(v, Tensor):
                wrapped = torch._C._functorch.is_functorch_wrapped_tensor(v)
                out[path, k] = ("tensor", wrapped, v if wrapped else v.detach().clone())
            elif not k.startswith("_") or isinstance(v, (int, float, str, tuple, type(None))):
                out[path, k] = ("value", copy.deepcopy(v))
    return out


def _outputs(model: nn.Module, shapes: list) -> list[Tensor]:
    """The model's own forward on one batch of every shape signature (from the state the
    call left: the cache of the previous shape is what it meets)."""
    g = torch.Generator().manual_seed(1)
    outs = []
    with torch.no_grad():
        for sig in shapes:
            outs.append(model([torch.randn(2, *s, generator=g, dtype=DTYPE) for s in sig]))
    return outs


def _shapes(case=CASE) -> list:
    packed = mj.pack(case.inputs())
    return [[tuple(t.shape) for t in packed.sample(i)] for i in range(packed.num_samples)]


def _assert_as_found(model: nn.Module, call, case=CASE) -> None:
    shapes = _shapes(case) + _shapes(case)[:1]  # the last shape again: it meets the cache
    _outputs(model, shapes[-1:])  # the user's own call before: its cache is set
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = _attributes(model)
    expected = _outputs(copy.deepcopy(model), shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.ModuleStateWarning)
        call(model)
    after = _attributes(model)
    assert after.keys() == attrs.keys()
    for key, (kind, *value) in attrs.items():
        now = after[key]
        assert now[0] == kind, key
        if kind == "tensor":
            assert not now[1], f"{key} holds a functorch-wrapped tensor"
            assert torch.equal(now[2], value[1]), key
        else:
            assert now[1] == value[0], key
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    for got, want in zip(_outputs(model, shapes), expected):
        assert torch.equal(got, want)


def _targets() -> list[Tensor]:
    return [torch.tensor(k % 4) for k in range(len(CASE.inputs()))]


ENTRY_POINTS = {
    "jacobian-auto": lambda m: mj.per_sample_jacobian(m, CASE.inputs(), params="box.*"),
    "jacobian-bucketed-fwd": lambda m: mj.per_sample_jacobian(
        m, CASE.inputs(), params="box.*", strategy="bucketed", mode="fwd"
    ),
    "jacobian-padded": lambda m: mj.per_sample_jacobian(
        m, CASE.inputs(), params="cls.*", strategy="padded", strict=True
    ),
    "jacobian-loop": lambda m: mj.per_sample_jacobian(
        m, CASE.inputs(), params="box.*", strategy="loop"
    ),
    "jacobian-uniform-vmap": lambda m: mj.per_sample_jacobian(
        m, [torch.randn(3, 2, 4, 4, dtype=DTYPE), torch.randn(3, 3, 2, 2, dtype=DTYPE)]
    ),
    "loop-reference": lambda m: per_sample_jacobian_loop(m, CASE.inputs(), params="box.*"),
    "diag-fisher": lambda m: mj.diag_fisher(
        m, [(CASE.inputs(), _targets())], output_fn=_logits, progress=False
    ),
    "jacobian-sq-norm": lambda m: mj.jacobian_sq_norm(m, CASE.inputs(), params="cls.*"),
    "subnet-laplace": lambda m: mj.SubnetLaplace(
        m, "classification", "cls.0.*", output_fn=_logits
    ).fit([(CASE.inputs(), _targets())], progress=False),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_leaves_the_model_as_found(entry: str) -> None:
    _assert_as_found(CASE.build(), ENTRY_POINTS[entry])


@pytest.mark.parametrize(
    ("strategy", "case_id"),
    [
        # the deep BiFPN (SLOW_TIER) runs padded in the fast tier, its other routes slow
        pytest.param(
            s, c, marks=[pytest.mark.slow] * (c in SLOW_TIER and s != "padded"), id=f"{s}-{c}"
        )
        for s in ("auto", "padded", "bucketed")
        for c in ("anchor_cache_head", "coord_grid", "bifpn_ragged")
    ],
)
def test_library_style_zoo_models_are_left_as_found(case_id: str, strategy: str) -> None:
    """The zoo's models written as detection libraries write them: after a call, state, tensor
    attributes and their own forward on every shape seen are as before."""
    case = CASE_BY_ID[case_id]
    _assert_as_found(
        case.build(),
        lambda m: mj.per_sample_jacobian(
            m, case.inputs(), params=case.glob, strategy=strategy, strict=strategy == "padded"
        ),
        case,
    )


def test_an_error_leaves_the_model_as_found() -> None:
    """The forward writes its cache and counter, then fails: put back all the same."""

    class Failing(AnchorCacheHead):
        def forward(self, levels):
            super().forward(levels)
            raise RuntimeError("the model's own error")

    def call(model: nn.Module) -> None:
        with pytest.raises(RuntimeError, match="the model's own error"):
            mj.per_sample_jacobian(model, CASE.inputs(), strategy="bucketed", strict=True)

    model = Failing().to(DTYPE).eval()
    before = _attributes(model)
    call(model)
    after = _attributes(model)
    assert after.keys() == before.keys()
    assert after["", "shape"] == before["", "shape"]
    assert torch.equal(after["", "calls"][2], before["", "calls"][2])


def test_a_counter_written_in_place_runs_under_vmap_and_keeps_its_value() -> None:
    """``self.calls += 1`` on a tensor captured from outside a transform is refused by
    functorch; the run's fresh copy may be written, and the user's counter is untouched."""
    model = CASE.build()
    counter = model.calls
    res = mj.per_sample_jacobian(
        model, [torch.randn(3, 2, 4, 4, dtype=DTYPE), torch.randn(3, 3, 2, 2, dtype=DTYPE)]
    )
    assert res.strategy == "vmap" and res.fallback is None
    assert model.calls is counter and int(counter) == 0


def test_the_warning_names_the_module_and_what_it_wrote() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = AnchorCacheHead()

        def forward(self, levels):
            return self.head(levels)

    model = Outer().to(DTYPE).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mj.per_sample_jacobian(model, CASE.inputs(), params="head.box.*", strategy="bucketed")
    messages = {str(w.message) for w in caught if w.category is mj.ModuleStateWarning}
    assert len(messages) == 1, messages  # once per module and attributes in a call
    (message,) = messages
    assert "AnchorCacheHead at 'head'" in message
    for name in ("'shape'", "'anchors'", "'calls'"):
        assert name in message
    assert all(w.filename == __file__ for w in caught if w.category is mj.ModuleStateWarning)


@pytest.mark.parametrize(
    "case_id",
    [
        pytest.param(c, marks=[pytest.mark.slow] * (c in SLOW_TIER))
        for c in CASE_IDS
        if c != CASE.id
    ],
)
def test_a_model_that_writes_nothing_does_not_warn(case_id: str) -> None:
    case = CASE_BY_ID[case_id]
    with warnings.catch_warnings():
        warnings.simplefilter("error", mj.ModuleStateWarning)
        mj.per_sample_jacobian(
            case.build(), case.inputs(), params=case.glob, output_fn=case.output_fn
        )


def test_the_results_are_the_loop_references_with_the_cache_set() -> None:
    """The cache the user's own call left (another shape) does not leak into the results."""
    model = CASE.build()
    _outputs(model, [[(2, 8, 8), (3, 4, 4)]])
    ref = per_sample_jacobian_loop(copy.deepcopy(model), CASE.inputs(), params="box.*")
    res = mj.per_sample_jacobian(model, CASE.inputs(), params="box.*", strategy="padded")
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-10, rtol=0)
