"""Bad input on every public entry point: the documented exception, a message naming the
culprit, and the model left exactly as it was (parameters, buffers, grads, train/eval flags,
requires_grad flags, hooks).

Rows are (entry point x bad value): the shared options are checked on every entry point that
takes them, the rest where they apply. The package-level table of ``pack``/``ParamSubset``
errors is ``test_errors.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import multiscale_jac as mj

D = torch.float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = OrderedDict(
        conv=nn.Conv2d(2, 3, 3, padding=1),
        bn=nn.BatchNorm2d(3),
        act=nn.Tanh(),
        drop=nn.Dropout(0.2),
        pool=nn.AdaptiveAvgPool2d(1),
        flat=nn.Flatten(),
        head=nn.Linear(3, 3),
    )
    return nn.Sequential(layers).to(D).eval()


X = torch.randn(3, 2, 5, 5, dtype=D)
Y = torch.tensor([0, 2, 1])


def _jacobian(m: nn.Module, inputs: Any = None, **kw: Any) -> Any:
    return mj.per_sample_jacobian(m, X if inputs is None else inputs, **{"params": "head.*", **kw})


def _loop(m: nn.Module, inputs: Any = None, **kw: Any) -> Any:
    return mj.reference.per_sample_jacobian_loop(
        m, X if inputs is None else inputs, **{"params": "head.*", **kw}
    )


def _fisher(m: nn.Module, inputs: Any = None, targets: Any = None, **kw: Any) -> Any:
    data = [(X if inputs is None else inputs, Y if targets is None else targets)]
    return mj.diag_fisher(m, data, **{"params": "head.*", **kw})


def _sq_norm(m: nn.Module, inputs: Any = None, **kw: Any) -> Any:
    return mj.jacobian_sq_norm(m, X if inputs is None else inputs, **{"params": "head.*", **kw})


def _sq_norm_backward(m: nn.Module, inputs: Any = None, **kw: Any) -> Any:
    return mj.jacobian_sq_norm_backward(
        m, X if inputs is None else inputs, **{"params": "head.*", **kw}
    )


def _laplace(m: nn.Module, inputs: Any = None, targets: Any = None, **kw: Any) -> Any:
    subset = kw.pop("params", "head.*")
    data = [(X if inputs is None else inputs, Y if targets is None else targets)]
    return mj.SubnetLaplace(m, "classification", subset, **kw).fit(data)


def _variance(m: nn.Module, inputs: Any = None, targets: Any = None, **kw: Any) -> Any:
    data = [(X if inputs is None else inputs, Y if targets is None else targets)]
    return mj.largest_variance(m, data, 2, **{"params": "head.*", **kw})


#: entry point -> (call, takes the Jacobian engine's options, takes targets)
ENTRY: dict[str, tuple[Callable[..., Any], bool, bool]] = {
    "per_sample_jacobian": (_jacobian, True, False),
    "loop": (_loop, False, False),
    "diag_fisher": (_fisher, False, True),
    "jacobian_sq_norm": (_sq_norm, False, False),
    "jacobian_sq_norm_backward": (_sq_norm_backward, False, False),
    "SubnetLaplace": (_laplace, False, True),
    "largest_variance": (_variance, False, True),
}
SHARED_IN_LOOP = {"params", "output_fn", "batch_norm", "randomness", "input_kind"}

#: (id, option values, exception, message fragment, applies to the loop reference)
SHARED: list[tuple[str, dict[str, Any], type, str]] = [
    ("params_int", {"params": 3}, TypeError, "must be None, a ParamSubset"),
    ("params_unknown", {"params": "hed.*"}, ValueError, "pattern 'hed.\\*' matches no parameter"),
    ("params_typo", {"params": "head.wieght"}, ValueError, "did you mean 'head.weight'"),
    ("output_fn_int", {"output_fn": 3}, TypeError, "output_fn must be callable"),
    ("batch_norm_bad", {"batch_norm": "train"}, ValueError, "unknown batch_norm 'train'"),
    ("randomness_bad", {"randomness": "sometimes"}, ValueError, "unknown randomness 'sometimes'"),
    ("randomness_int", {"randomness": 1}, TypeError, "randomness must be a string"),
    ("input_kind_bad", {"input_kind": "images"}, ValueError, "unknown input_kind 'images'"),
    ("input_kind_misfit", {"input_kind": "samples"}, ValueError, "does not fit one batched"),
    ("strict_str", {"strict": "yes"}, TypeError, "strict must be True or False"),
    ("chunk_size_zero", {"chunk_size": 0}, ValueError, "chunk_size must be >= 1"),
    ("chunk_size_float", {"chunk_size": 2.5}, TypeError, "chunk_size must be a positive int"),
    ("budget_negative", {"memory_budget": -1}, ValueError, "memory_budget must be > 0"),
    ("budget_str", {"memory_budget": "1GB"}, TypeError, "memory_budget must be a number"),
    ("budget_tiny", {"memory_budget": 64}, mj.MemoryBudgetError, "memory_budget=64 bytes is below"),
]
#: bad inputs, given to every entry point
INPUTS: list[tuple[str, Any, type, str]] = [
    ("inputs_str", "images", TypeError, "got str"),
    ("inputs_empty", [], ValueError, "empty list of samples"),
    (
        "inputs_dtype",
        X.float(),
        TypeError,
        "torch.float32 but the model's parameters torch.float64",
    ),
    ("inputs_channels", torch.randn(3, 4, 5, 5, dtype=D), RuntimeError, "channels"),
    ("inputs_ambiguous", [torch.randn(4, 5, 5, dtype=D)] * 3, ValueError, "fails on both"),
    ("inputs_batch_of_one", [[torch.randn(1, 2, 5, 5, dtype=D)]] * 2, ValueError, "batch of one"),
    ("inputs_mixed", [X, [X[0]]], TypeError, "is a Tensor but samples"),
    ("inputs_dict_empty", {}, ValueError, "empty mapping"),
]
#: bad targets, given to the entry points that take them
TARGETS: list[tuple[str, Any, type, str]] = [
    ("targets_float", torch.tensor([0.5, 1.0, 2.0]), TypeError, "integer class indices"),
    ("targets_range", torch.tensor([0, 3, 1]), ValueError, "label 3 is out of range"),
    ("targets_negative", torch.tensor([0, -2, 1]), ValueError, "label -2 is out of range"),
    ("targets_count", torch.tensor([0, 1]), ValueError, "leading batch dim of 3"),
    ("targets_shape", torch.zeros(3, 2, dtype=torch.long), ValueError, "2 positions, the logits 1"),
    ("targets_type", "labels", TypeError, "targets must be a tensor"),
]


def _rows() -> list[Any]:
    rows = []
    for entry, (_, engine_options, targets) in ENTRY.items():
        for name, opts, exc, match in SHARED:
            if entry == "loop" and not set(opts) <= SHARED_IN_LOOP:
                continue
            rows.append(pytest.param(entry, opts, exc, match, id=f"{entry}-{name}"))
        for name, value, exc, match in INPUTS:
            rows.append(pytest.param(entry, {"inputs": value}, exc, match, id=f"{entry}-{name}"))
        if targets:
            for name, value, exc, match in TARGETS:
                rows.append(
                    pytest.param(entry, {"targets": value}, exc, match, id=f"{entry}-{name}")
                )
        if engine_options:
            for opt, value, exc, match in [
                ("mode", "reverse", ValueError, "unknown mode 'reverse'"),
                ("strategy", "vmapp", ValueError, "unknown strategy 'vmapp'"),
                ("entries", "some", ValueError, "unknown entries 'some'"),
            ]:
                rows.append(pytest.param(entry, {opt: value}, exc, match, id=f"{entry}-{opt}"))
    return rows


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything about the model an entry point could change."""
    return {
        "state": {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "flags": [(m.training, type(m)) for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "hooks": [
            (
                len(m._forward_hooks),
                len(m._forward_pre_hooks),
                len(m._backward_hooks),
                len(m._backward_pre_hooks),
                len(m._state_dict_hooks),
                len(m._load_state_dict_pre_hooks),
            )
            for m in model.modules()
        ],
        "modes": len(torch.overrides._get_current_function_mode_stack()),
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), k
        assert v.dtype == after["state"][k].dtype, k
    for a, b in zip(before["grads"], after["grads"]):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    for key in ("flags", "requires_grad", "hooks", "modes"):
        assert before[key] == after[key], key


ROWS = _rows()


def test_the_table_is_large() -> None:
    assert len(ROWS) >= 80


@pytest.mark.parametrize("entry, options, exc, match", ROWS)
def test_bad_input_is_refused_and_the_model_untouched(entry, options, exc, match) -> None:
    model = _model()
    before = snapshot(model)
    call = ENTRY[entry][0]
    with pytest.raises(exc, match=match):
        call(model, **options)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("entry", list(ENTRY))
def test_train_mode_layers_are_refused_and_left_in_train_mode(entry: str) -> None:
    model = _model().train()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"module 'bn' \(BatchNorm2d\) is in train mode"):
        ENTRY[entry][0](model)
    model.bn.eval()
    with pytest.raises(ValueError, match=r"module 'drop' \(Dropout, p=0.2\) is in train mode"):
        ENTRY[entry][0](model)
    model.bn.train()
    assert_same(before, snapshot(model))
