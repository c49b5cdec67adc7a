"""The engine against the loop reference on the zoo, in float64."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from cases import (
    CASE_IDS,
    CASES,
    FWD_HEAVY,
    SLOW_TIER,
    SUBSET_KINDS,
    DenseHead,
    batched_tensor,
    make_subset,
)
from conftest import CASE_BY_ID, zoo_model, zoo_reference
from torch import nn

import multiscale_jac as mj
from multiscale_jac.masked import UnsupportedOpError
from multiscale_jac.models import ConvBlock, TinyFPN
from multiscale_jac.reference import per_sample_jacobian_loop

ATOL = 1e-10


def assert_same(res: mj.JacobianResult, ref: mj.JacobianResult) -> None:
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=ATOL, rtol=0)
    assert res.output_sizes == ref.output_sizes
    if ref.output_mask is None:
        assert res.output_mask is None
    else:
        assert torch.equal(res.output_mask, ref.output_mask)
        assert torch.all(res.jacobian[~res.output_mask] == 0)


ROUTES = [(s, m) for s in ("auto", "vmap", "bucketed", "padded") for m in ("rev", "fwd", "auto")]


def _combos() -> list:
    """Every case x subset kind x route. The fast tier runs a sample: half the routes for each
    case (every strategy and every mode among them), one subset kind each, turning with the
    case, so that every case meets every subset kind and every route meets every subset kind;
    the slow tier runs the rest of the product."""
    out = []
    for i, case_id in enumerate(CASE_IDS):
        for j, kind in enumerate(SUBSET_KINDS):
            for k, (strategy, mode) in enumerate(ROUTES):
                # forward mode over most tensors of a deep model: seconds (slow tier)
                heavy = case_id in FWD_HEAVY and kind in ("all", "elements") and mode != "rev"
                # the deep model's fast routes take the small subsets (its loop references
                # over most tensors take seconds)
                heavy |= case_id in SLOW_TIER and kind in ("all", "elements")
                fast = (i + k) % 2 == 0 and (i + k) % len(SUBSET_KINDS) == j and not heavy
                out.append(
                    pytest.param(
                        case_id,
                        strategy,
                        mode,
                        kind,
                        id=f"{case_id}-{strategy}-{mode}-{kind}",
                        marks=[pytest.mark.slow] * (not fast),
                    )
                )
            fast = i % len(SUBSET_KINDS) == j and not (
                case_id in SLOW_TIER and kind in ("all", "elements")
            )
            out.append(
                pytest.param(
                    case_id,
                    "loop",
                    "auto",
                    kind,
                    id=f"{case_id}-loop-{kind}",
                    marks=[pytest.mark.slow] * (not fast),
                )
            )
    return out


@pytest.mark.parametrize(("case_id", "strategy", "mode", "subset_kind"), _combos())
def test_matches_loop_reference(case_id: str, strategy: str, mode: str, subset_kind: str) -> None:
    case = CASE_BY_ID[case_id]
    model = zoo_model(case_id)
    subset, ref = zoo_reference(case_id, subset_kind)
    kwargs = dict(params=subset, output_fn=case.output_fn, mode=mode, strategy=strategy)
    # what must happen: fallbacks warn (and say so on the result), auto decisions are notes
    expected_warnings, expected_strategy = [], {"auto": "vmap"}.get(strategy, strategy)
    if strategy == "vmap" and case.ragged:
        expected_warnings.append("needs one shape signature")
        expected_strategy = "bucketed"
    if strategy == "padded" and case.padded_unsupported:
        expected_warnings.append(
            "strategy 'padded' cannot run this model.*" + case.padded_unsupported
        )
        expected_strategy = "bucketed"
        with pytest.raises(UnsupportedOpError, match=case.padded_unsupported):
            mj.per_sample_jacobian(model, case.inputs(), strict=True, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", mj.FallbackWarning)
        res = mj.per_sample_jacobian(model, case.inputs(), **kwargs)
    # one warning per call, listing every fallback
    warned = [str(w.message) for w in caught if issubclass(w.category, mj.FallbackWarning)]
    assert len(warned) <= 1, warned
    messages = [part for m in warned for part in m.split("; then ")]
    # fwd fails only if the tangents reach an op without a forward-mode derivative
    fwd_failed = [m for m in messages if "mode 'fwd' failed" in m]
    assert not fwd_failed or (case.fwd_unsupported and mode == "fwd"), messages
    messages = [m for m in messages if m not in fwd_failed]
    assert len(messages) == len(expected_warnings), messages
    for pattern, message in zip(expected_warnings, messages):
        assert re.search(pattern, message), (pattern, message)
        assert message in res.fallback
    if not expected_warnings and not fwd_failed:
        assert res.fallback is None
    if strategy == "auto" and case.ragged:
        assert res.strategy in ("bucketed", "padded")
        auto_notes = [n for n in res.notes if n.startswith("auto:")]
        assert auto_notes
        if case.padded_unsupported:
            assert res.strategy == "bucketed"
            assert re.search(r"'padded' not possible|padded at least|a small job", auto_notes[0])
    else:
        assert res.strategy == expected_strategy
    assert res.requested_strategy == strategy and res.requested_mode == mode
    if strategy == "loop":
        expected_mode = "rev"
    elif mode != "auto":
        expected_mode = mode
    else:
        # the cost model's estimate, recorded in the notes (padded: the P < O rule)
        chosen = [re.search(r"chose '(\w+)'", n) for n in res.notes if n.startswith("mode:")]
        small = [re.search(r"a small job .*: mode '(\w+)'", n) for n in res.notes]
        chosen = [c.group(1) for c in chosen + small if c]
        mean_o = sum(res.output_sizes) / len(res.output_sizes)
        expected_mode = chosen[-1] if chosen else ("fwd" if subset.numel < mean_o else "rev")
        assert chosen or res.strategy == "padded", res.notes
    if fwd_failed or (mode == "auto" and any("chose mode 'rev'" in n for n in res.notes)):
        expected_mode = "rev"
    assert res.mode == expected_mode
    assert_same(res, ref)


@pytest.mark.parametrize(
    ("case_id", "mode", "chunk_size"),
    [
        # the fast tier: two of the sizes per case and mode, alternating (each size on three)
        pytest.param(c, m, n, marks=[pytest.mark.slow] * ((i + j + k) % 2))
        for i, c in enumerate(["fpn_ragged", "seed_convblock_levels", "mlp_vectors"])
        for j, m in enumerate(["rev", "fwd"])
        for k, n in enumerate([1, 2, 3, 50])
    ],
)
def test_chunk_size_does_not_change_results(case_id: str, mode: str, chunk_size: int) -> None:
    case = CASE_BY_ID[case_id]
    subset, ref = zoo_reference(case_id, "elements")
    res = mj.per_sample_jacobian(
        zoo_model(case_id),
        case.inputs(),
        params=subset,
        output_fn=case.output_fn,
        mode=mode,
        chunk_size=chunk_size,
    )
    assert res.chunk_size <= chunk_size
    assert_same(res, ref)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_memory_budget_chunks_and_keeps_results(mode: str) -> None:
    case = CASE_BY_ID["fpn_ragged"]
    model = zoo_model(case.id)
    subset, ref = zoo_reference(case.id, "names")
    result_bytes = ref.jacobian.numel() * ref.jacobian.element_size()
    res = mj.per_sample_jacobian(
        model, case.inputs(), params=subset, mode=mode, memory_budget=result_bytes + 10**9
    )
    assert res.inner_chunk_size is None
    assert_same(res, ref)
    with pytest.raises(
        ValueError, match=r"memory_budget=\d+ bytes is below the estimated minimum"
    ) as info:
        mj.per_sample_jacobian(
            model, case.inputs(), params=subset, mode=mode, memory_budget=result_bytes + 10
        )
    minimum = int(re.search(r"minimum of (\d+) bytes", str(info.value)).group(1))
    assert minimum > result_bytes
    # the stated minimum runs one row/tangent at a time (fwd: for the tensor that needs the
    # most; tensors that need less may run more samples per call)
    res = mj.per_sample_jacobian(
        model, case.inputs(), params=subset, mode=mode, memory_budget=minimum
    )
    assert res.inner_chunk_size == 1
    assert res.chunk_size == 1 or mode == "fwd"
    assert_same(res, ref)
    # growing budgets: identical results, rows/tangents per step never shrink, some in between
    inner = []
    for factor in (1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 4.0):
        res = mj.per_sample_jacobian(
            model, case.inputs(), params=subset, mode=mode, memory_budget=int(minimum * factor)
        )
        assert_same(res, ref)
        inner.append(res.inner_chunk_size or res.num_outputs * res.numel)
    assert inner == sorted(inner)
    assert any(1 < k < res.num_outputs * res.numel for k in inner)
    with pytest.raises(ValueError, match="below the estimated minimum"):
        mj.per_sample_jacobian(model, case.inputs(), params=subset, mode=mode, memory_budget=1000)


def test_packed_batch_input_and_as_dict() -> None:
    case = CASE_BY_ID["fpn_ragged"]
    model = zoo_model(case.id)
    packed = mj.pack(case.inputs())
    subset = mj.ParamSubset.from_names(model, ["head.0.weight", "lateral.1.bias"])
    res = mj.per_sample_jacobian(model, packed, params=subset)
    blocks = res.as_dict()
    assert list(blocks) == ["head.0.weight", "lateral.1.bias"]  # the order given
    n, o = res.num_samples, res.num_outputs
    assert blocks["head.0.weight"].shape == (n, o, *model.head[0].weight.shape)
    assert blocks["lateral.1.bias"].shape == (n, o, 3)
    elem = mj.ParamSubset.from_indices(model, {"head.2.weight": [5, 1, 3]})
    res = mj.per_sample_jacobian(model, packed, params=elem)
    assert res.as_dict()["head.2.weight"].shape == (n, o, 3)
    full = mj.per_sample_jacobian(model, packed, params="head.2.weight")
    torch.testing.assert_close(
        res.jacobian, full.jacobian.reshape(n, o, -1)[..., [5, 1, 3]], atol=0, rtol=0
    )


def _snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "params": {n: (id(p), p.requires_grad, p.grad) for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {
            n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for n, m in model.named_modules()
        },
    }


def _assert_unchanged(before: dict, after: dict) -> None:
    assert before["params"] == after["params"]
    assert before["training"] == after["training"]
    assert before["hooks"] == after["hooks"]
    assert before["state"].keys() == after["state"].keys()
    for k in before["state"]:
        assert torch.equal(before["state"][k], after["state"][k]), k


@pytest.mark.parametrize("mode", ["rev", "fwd"])
@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_model_is_never_changed(mode: str, strategy: str) -> None:
    model = CASE_BY_ID["bn_cnn_multicrop"].build()
    model.features[0].weight.requires_grad_(False)
    before = _snapshot(model)
    mj.per_sample_jacobian(
        model, CASE_BY_ID["bn_cnn_multicrop"].inputs(), mode=mode, strategy=strategy
    )
    _assert_unchanged(before, _snapshot(model))


def test_batchnorm_in_train_mode_needs_a_choice() -> None:
    case = CASE_BY_ID["bn_cnn_multicrop"]
    model = case.build()
    ref = per_sample_jacobian_loop(model, case.inputs(), params="fc.*")
    model.train()
    with pytest.raises(ValueError, match=r"'features.1' \(BatchNorm2d\) is in train mode"):
        mj.per_sample_jacobian(model, case.inputs(), params="fc.*")
    with pytest.raises(ValueError, match="train mode"):
        per_sample_jacobian_loop(model, case.inputs(), params="fc.*")
    before = _snapshot(model)
    for strategy in ("auto", "loop"):
        res = mj.per_sample_jacobian(
            model, case.inputs(), params="fc.*", batch_norm="eval", strategy=strategy
        )
        assert_same(res, ref)
    _assert_unchanged(before, _snapshot(model))  # still in train mode, running stats untouched


def test_batchnorm_eval_choice_needs_running_stats() -> None:
    model = nn.Sequential(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2, track_running_stats=False)).double()
    with pytest.raises(ValueError, match="track_running_stats=False"):
        mj.per_sample_jacobian(model, batched_tensor(2, (2, 4, 4)), batch_norm="eval")


class _FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.dropout(x, 0.5, training=True))


def test_dropout_in_train_mode_needs_randomness_choice() -> None:
    model = nn.Sequential(nn.Linear(5, 4), nn.Dropout(0.5), nn.Linear(4, 2)).double().train()
    x = batched_tensor(4, (5,))
    with pytest.raises(ValueError, match=r"'1' \(Dropout, p=0.5\) is in train mode"):
        mj.per_sample_jacobian(model, x)
    for randomness in ("different", "same"):
        for mode in ("rev", "fwd"):
            torch.manual_seed(0)
            res = mj.per_sample_jacobian(
                model, x, randomness=randomness, mode=mode, params="2.weight"
            )
            # d out_k / d W2[k, j] = h_j * mask_j / (1 - p): per sample, one consistent mask for
            # every column, so each output row has the same support pattern
            blocks = res.as_dict()["2.weight"]  # (N, 2, 2, 4)
            support0 = blocks[:, 0, 0] != 0
            support1 = blocks[:, 1, 1] != 0
            assert torch.equal(support0, support1)
    with pytest.raises(ValueError, match="random operation"):
        mj.per_sample_jacobian(_FunctionalDropout().double(), x)


class _DataDependent(nn.Module):
    """Python control flow on a tensor value: vmap cannot run it, the loop can."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum().item() > 0:
            return y * 2
        return y


def test_vmap_failure_falls_back_to_loop_and_is_recorded() -> None:
    model = _DataDependent().double()
    x = batched_tensor(4, (5,))
    ref = per_sample_jacobian_loop(model, x)
    with pytest.warns(mj.FallbackWarning, match="ran 'loop'"):
        res = mj.per_sample_jacobian(model, x)
    assert res.strategy == "loop" and res.requested_strategy == "auto"
    assert "failed" in res.fallback
    assert_same(res, ref)
    with pytest.raises(
        RuntimeError, match=r"strategy .vmap. failed.* strict=True forbids running .loop."
    ):
        mj.per_sample_jacobian(model, x, strict=True)


def test_a_vmap_failure_is_remembered_for_the_shapes_and_still_recorded() -> None:
    model = _DataDependent().double()
    x = batched_tensor(5, (5,))
    ref = per_sample_jacobian_loop(model, x)
    with pytest.warns(mj.FallbackWarning):
        first = mj.per_sample_jacobian(model, x)
    with pytest.warns(mj.FallbackWarning, match="on an earlier call with these shapes"):
        second = mj.per_sample_jacobian(model, x)
    assert second.strategy == "loop" and "vmap" in second.fallback
    assert_same(first, ref)
    assert_same(second, ref)


class _OldStyleSquare(torch.autograd.Function):
    """A custom function without ``setup_context``: neither vmap nor jacrev can run it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _OldStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OldStyleSquare.apply(self.fc(x))


def test_the_loop_runs_rows_one_at_a_time_where_jacrev_cannot_and_notes_it() -> None:
    model = _OldStyle().double()
    x = batched_tensor(3, (5,))
    ref = per_sample_jacobian_loop(model, x)
    with pytest.warns(mj.FallbackWarning, match="ran 'loop'"):
        res = mj.per_sample_jacobian(model, x)
    assert res.strategy == "loop"
    assert any("one row at a time" in n for n in res.notes)
    assert_same(res, ref)


def test_strict_vmap_on_ragged_batch_raises() -> None:
    case = CASE_BY_ID["fpn_ragged"]
    with pytest.raises(ValueError, match="needs one shape signature but the batch has 3"):
        mj.per_sample_jacobian(zoo_model(case.id), case.inputs(), strategy="vmap", strict=True)


def test_auto_mode_follows_p_versus_o() -> None:
    model = DenseHead().double().eval()
    x = batched_tensor(2, (2, 4, 4))  # O = 2 * 16 = 32
    assert mj.per_sample_jacobian(model, x, params="cls.bias").mode == "fwd"  # P = 2
    assert mj.per_sample_jacobian(model, x).mode == "rev"  # P = 65 > 32


def test_inputs_requiring_grad_do_not_build_a_graph() -> None:
    model = zoo_model("mlp_vectors")
    x = batched_tensor(3, (5,)).requires_grad_(True)
    res = mj.per_sample_jacobian(model, x)
    assert not res.jacobian.requires_grad
    assert x.grad is None


def test_users_recipe_agrees() -> None:
    """The engine equals the recipe users write today (vmap(jacrev) w.r.t. whole tensors, then
    the selected single entries picked out in the order given), written independently of the
    library."""
    from torch.func import functional_call, jacrev, vmap

    torch.manual_seed(0)
    model = ConvBlock(3, 8).double()
    feats = [
        torch.randn(2, 3, 9, 9, dtype=torch.double),
        torch.randn(2, 3, 8, 8, dtype=torch.double),
    ]
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = ["conv.0.weight", "conv.2.weight"]
    idx = {"conv.0.weight": torch.tensor([3, 40, 7]), "conv.2.weight": torch.tensor([0, 100])}

    def f(relevant, feature_list):
        full = dict(params)
        full.update(zip(names, relevant))
        batch = [feature.unsqueeze(0) for feature in feature_list]
        return functional_call(model, full, (batch,))

    grads = vmap(jacrev(f), in_dims=(None, 0))(tuple(params[n] for n in names), feats)
    picked = [g.reshape(2, -1, params[n].numel())[..., idx[n]] for g, n in zip(grads, names)]
    expected = torch.cat(picked, dim=-1)
    res = mj.per_sample_jacobian(model, feats, params=mj.ParamSubset.from_indices(model, idx))
    torch.testing.assert_close(res.jacobian, expected, atol=ATOL, rtol=0)


def test_fpn_zoo_model_uses_every_part() -> None:
    """Guard the zoo: the FPN's output depends on laterals, top-down, extra and head params."""
    model = TinyFPN((3, 4), width=3, num_outputs=2).double()
    case = CASE_BY_ID["fpn_ragged"]
    res = mj.per_sample_jacobian(model, case.inputs())
    for name, block in res.as_dict().items():
        assert block.abs().sum() > 0, name


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_cuda_matches_cpu(cuda_device: torch.device, mode: str) -> None:
    case = CASE_BY_ID["fpn_ragged"]
    subset, ref = zoo_reference(case.id, "elements")
    model = copy.deepcopy(zoo_model(case.id)).to(cuda_device)
    res = mj.per_sample_jacobian(model, case.inputs(), params=subset, mode=mode)
    assert res.jacobian.device.type == "cuda"
    torch.testing.assert_close(res.jacobian.cpu(), ref.jacobian, atol=ATOL, rtol=0)


def test_every_zoo_case_has_outputs_and_subsets() -> None:
    """Guard the zoo itself: each case runs and every subset kind selects something."""
    for case in CASES:
        model = zoo_model(case.id)
        for kind in SUBSET_KINDS:
            assert make_subset(model, kind, case).numel > 0


def test_a_broken_model_raises_its_own_error_without_fallback() -> None:
    model = nn.Conv2d(3, 2, 3).double()  # expects 3 channels
    with pytest.raises(RuntimeError, match="channels"):
        mj.per_sample_jacobian(model, batched_tensor(2, (2, 5, 5)))  # a FallbackWarning would fail


# the auto choice table: (the machine routes are priced on, the strategy auto must pick, its
# note): where a call's set-up costs everything, padding all samples into one call wins; where
# flops cost everything, padding's extra work loses before it is planned
AUTO_TABLE = [
    pytest.param(
        {"op_s": 1e-12, "flop_s": 1e-15, "call_s": 1.0},
        "padded",
        r"estimated bucketed [\d.]+ ms, padded [\d.]+ ms",
        id="call-bound-padded",
    ),
    pytest.param(
        {"op_s": 1e-12, "flop_s": 1.0, "call_s": 1e-12},
        "bucketed",
        r"padded at least [\d.]+ ms",  # its lower bound already loses: padded is not planned
        id="flop-bound-bucketed",
    ),
]


@pytest.mark.parametrize(("machine", "expected", "note"), AUTO_TABLE)
@pytest.mark.parametrize("case_id", ["fpn_scale_ragged", "bn_cnn_multicrop", "dense_per_pixel"])
def test_auto_choice_table(case_id, machine, expected, note) -> None:
    """Auto follows the cost model on the machine it prices on, and whatever it picks equals
    the oracle."""
    from multiscale_jac import _calibration

    ops = {p: (machine["op_s"],) * len(_calibration.KINDS) for p in _calibration.PASSES}
    calls = dict.fromkeys(_calibration.PASSES, machine["call_s"])
    _calibration.use_machine(_calibration.Machine(ops, machine["flop_s"], calls))  # (conftest)
    case = CASE_BY_ID[case_id]
    subset, ref = zoo_reference(case_id, "names")
    res = mj.per_sample_jacobian(
        zoo_model(case_id),
        case.inputs(),
        params=subset,
        output_fn=case.output_fn,
        strict=True,
        entries="generic",  # (not a small job: no choice of strategy there)
    )
    assert res.strategy == expected, res.notes
    auto = [n for n in res.notes if n.startswith("auto:")]
    assert auto[0].endswith(f"chose {expected!r}") and re.search(note, auto[0])
    assert_same(res, ref)
