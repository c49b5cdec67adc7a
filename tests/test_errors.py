"""Bad input raises the documented error with a message naming the offending value."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import multiscale_jac as mj
from multiscale_jac.reference import per_sample_jacobian_loop


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(), nn.LazyLinear(2)).eval()


def _conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)).eval()


def _x(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 2, 4, 4)


def _bn_train() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2)).train()


def _dropout_train() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(32, 4), nn.Dropout(0.1)).train()


def _int_param_model() -> nn.Module:
    m = _conv()
    m[0].weight = nn.Parameter(torch.zeros(2, 2, 3, 3, dtype=torch.int64), requires_grad=False)
    return m


def _tied() -> nn.Module:
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    m[1].weight = m[0].weight
    return m


# (id, callable, exception type, regex that must match the message)
CASES = [
    # pack
    ("empty_sample_list", lambda: mj.pack([]), ValueError, "empty list of samples"),
    (
        "empty_level_list",
        lambda: mj.pack([[], []]),
        ValueError,
        "sample 0 is an empty list of levels",
    ),
    (
        "non_tensor_level",
        lambda: mj.pack([[torch.randn(2, 3, 3)], [np.zeros((2, 3, 3))]]),
        TypeError,
        "sample 1, level 0 is a ndarray",
    ),
    ("non_tensor_input", lambda: mj.pack("images"), TypeError, "got str"),
    (
        "mixed_list",
        lambda: mj.pack([torch.randn(2, 2, 3, 3), [torch.randn(2, 3, 3)]]),
        TypeError,
        r"samples\[0\] is a Tensor but samples\[1\] is a list",
    ),
    (
        "channel_mismatch",
        lambda: mj.pack([[torch.randn(3, 4, 4)], [torch.randn(2, 4, 4)]]),
        ValueError,
        r"sample 1, level 0 has 2 channels \(shape \(2, 4, 4\)\) but sample 0 has 3",
    ),
    (
        "rank_mismatch",
        lambda: mj.pack([[torch.randn(3, 4, 4)], [torch.randn(3, 4)]]),
        ValueError,
        r"sample 1, level 0 has rank 2 \(shape \(3, 4\)\) but sample 0 has rank 3",
    ),
    (
        "level_count_mismatch",
        lambda: mj.pack([[torch.randn(3, 4, 4), torch.randn(3, 2, 2)], [torch.randn(3, 4, 4)]]),
        ValueError,
        "sample 1 has 1 levels but sample 0 has 2",
    ),
    (
        "too_many_spatial_dims",
        lambda: mj.pack([[torch.randn(1, 2, 2, 2, 2)]]),
        ValueError,
        r"shape \(1, 2, 2, 2, 2\); a level must be \(C, \*spatial\) with 0 to 3",
    ),
    ("scalar_level", lambda: mj.pack([[torch.tensor(1.0)]]), ValueError, r"has shape \(\)"),
    ("empty_spatial_dim", lambda: mj.pack([[torch.randn(2, 0, 3)]]), ValueError, "empty dimension"),
    (
        "complex_dtype",
        lambda: mj.pack([[torch.zeros(2, 3, 3, dtype=torch.complex64)]]),
        TypeError,
        "sample 0, level 0 has dtype torch.complex64; complex inputs are not supported",
    ),
    (
        "mixed_dtypes",
        lambda: mj.pack([[torch.randn(2, 3, 3)], [torch.randn(2, 3, 3, dtype=torch.float64)]]),
        TypeError,
        "sample 1, level 0 has dtype torch.float64 but sample 0, level 0 has torch.float32",
    ),
    (
        "batch_size_mismatch",
        lambda: mj.pack([torch.randn(2, 3, 4, 4), torch.randn(3, 3, 2, 2)]),
        ValueError,
        "level 1 has batch size 3 but level 0 has 2",
    ),
    (
        "unbatched_tensor",
        lambda: mj.pack(torch.randn(5)),
        ValueError,
        r"the input tensor has shape \(5,\)",
    ),
    ("zero_samples_tensor", lambda: mj.pack(torch.randn(0, 3)), ValueError, "zero samples"),
    (
        "unknown_layout",
        lambda: mj.pack(_x(), layout="ragged"),
        ValueError,
        "unknown layout 'ragged'; expected one of 'padded', 'nested'",
    ),
    # ParamSubset
    (
        "unknown_name",
        lambda: mj.ParamSubset.from_names(_conv(), "0.wieght"),
        ValueError,
        r"unknown parameter name '0.wieght'; did you mean '0.weight'",
    ),
    (
        "pattern_matches_nothing",
        lambda: mj.ParamSubset.from_names(_conv(), "head.*"),
        ValueError,
        "pattern 'head.\\*' matches no parameter",
    ),
    ("empty_names", lambda: mj.ParamSubset.from_names(_conv(), []), ValueError, "empty list"),
    ("non_string_name", lambda: mj.ParamSubset.from_names(_conv(), [3]), TypeError, "got 3"),
    (
        "index_out_of_range",
        lambda: mj.ParamSubset.from_indices(_conv(), {"0.weight": [3, 36]}),
        ValueError,
        r"indices for '0.weight': index 36 is out of range for 36 entries",
    ),
    (
        "negative_index",
        lambda: mj.ParamSubset.from_indices(_conv(), {"0.weight": [-1]}),
        ValueError,
        "index -1 is out of range",
    ),
    (
        "duplicate_index",
        lambda: mj.ParamSubset.from_indices(_conv(), {"0.weight": torch.tensor([4, 1, 4])}),
        ValueError,
        "index 4 is given more than once",
    ),
    (
        "empty_indices",
        lambda: mj.ParamSubset.from_indices(_conv(), {"0.weight": []}),
        ValueError,
        "indices for '0.weight' is empty",
    ),
    (
        "float_indices",
        lambda: mj.ParamSubset.from_indices(_conv(), {"0.weight": torch.tensor([1.0])}),
        TypeError,
        "must be integers; got dtype torch.float32",
    ),
    (
        "bool_indices",
        lambda: mj.ParamSubset.from_indices(_conv(), {"0.weight": torch.tensor([True])}),
        TypeError,
        "use from_mask",
    ),
    (
        "unknown_index_name",
        lambda: mj.ParamSubset.from_indices(_conv(), {"1.weight": [0]}),
        ValueError,
        "unknown parameter name '1.weight'",
    ),
    (
        "tied_tensor_given_twice",
        lambda: mj.ParamSubset.from_indices(_tied(), {"0.weight": [0], "1.weight": [1]}),
        ValueError,
        r"parameters '0.weight' and '1.weight' are the same \(tied\) tensor",
    ),
    (
        "indices_not_a_dict",
        lambda: mj.ParamSubset.from_indices(_conv(), [1, 2]),
        TypeError,
        r"from_indices expects a dict \{name: indices\}; got list",
    ),
    (
        "flat_index_out_of_range",
        lambda: mj.ParamSubset.from_flat_indices(_conv(), [38]),
        ValueError,
        "flat indices: index 38 is out of range for 38 entries",
    ),
    (
        "flat_duplicate",
        lambda: mj.ParamSubset.from_flat_indices(_conv(), [1, 1]),
        ValueError,
        "index 1 is given more than once",
    ),
    (
        "mask_shape",
        lambda: mj.ParamSubset.from_mask(_conv(), {"0.bias": torch.ones(3, dtype=torch.bool)}),
        ValueError,
        r"mask for '0.bias' has shape \(3,\) but the parameter has shape \(2,\)",
    ),
    (
        "mask_dtype",
        lambda: mj.ParamSubset.from_mask(_conv(), {"0.bias": torch.ones(2)}),
        TypeError,
        "mask for '0.bias' must be a bool tensor; got torch.float32",
    ),
    (
        "mask_selects_nothing",
        lambda: mj.ParamSubset.from_mask(_conv(), {"0.bias": torch.zeros(2, dtype=torch.bool)}),
        ValueError,
        "selects no entries",
    ),
    ("no_parameters", lambda: mj.ParamSubset.all(nn.ReLU()), ValueError, "no parameters"),
    ("subset_not_a_module", lambda: mj.ParamSubset.all([1, 2]), TypeError, "got list"),
    # per_sample_jacobian
    (
        "model_not_module",
        lambda: mj.per_sample_jacobian(lambda x: x, _x()),
        TypeError,
        "model must be a torch.nn.Module; got function",
    ),
    (
        "unknown_strategy",
        lambda: mj.per_sample_jacobian(_conv(), _x(), strategy="vmapp"),
        ValueError,
        "unknown strategy 'vmapp'; expected one of 'auto', 'vmap', 'bucketed', 'padded', 'loop'",
    ),
    (
        "unknown_mode",
        lambda: mj.per_sample_jacobian(_conv(), _x(), mode="reverse"),
        ValueError,
        "unknown mode 'reverse'; expected one of 'auto', 'rev', 'fwd'",
    ),
    (
        "mode_not_string",
        lambda: mj.per_sample_jacobian(_conv(), _x(), mode=1),
        TypeError,
        "mode must be a string",
    ),
    (
        "unknown_randomness",
        lambda: mj.per_sample_jacobian(_conv(), _x(), randomness="random"),
        ValueError,
        "unknown randomness 'random'",
    ),
    (
        "unknown_batch_norm",
        lambda: mj.per_sample_jacobian(_conv(), _x(), batch_norm="train"),
        ValueError,
        "unknown batch_norm 'train'",
    ),
    (
        "chunk_size_zero",
        lambda: mj.per_sample_jacobian(_conv(), _x(), chunk_size=0),
        ValueError,
        "chunk_size must be >= 1; got 0",
    ),
    (
        "chunk_size_float",
        lambda: mj.per_sample_jacobian(_conv(), _x(), chunk_size=2.0),
        TypeError,
        "chunk_size must be a positive int or None; got 2.0",
    ),
    (
        "memory_budget_negative",
        lambda: mj.per_sample_jacobian(_conv(), _x(), memory_budget=-5),
        ValueError,
        "memory_budget must be > 0 bytes; got -5",
    ),
    (
        "memory_budget_string",
        lambda: mj.per_sample_jacobian(_conv(), _x(), memory_budget="1GB"),
        TypeError,
        "memory_budget must be a number of bytes or None; got '1GB'",
    ),
    (
        "strict_not_bool",
        lambda: mj.per_sample_jacobian(_conv(), _x(), strict="yes"),
        TypeError,
        "strict must be True or False; got 'yes'",
    ),
    (
        "output_fn_not_callable",
        lambda: mj.per_sample_jacobian(_conv(), _x(), output_fn=3),
        TypeError,
        "output_fn must be callable or None; got int",
    ),
    (
        "params_wrong_type",
        lambda: mj.per_sample_jacobian(_conv(), _x(), params=5),
        TypeError,
        "params must be None, a ParamSubset, a parameter name/glob or a list of them; got int",
    ),
    (
        "params_unknown_name",
        lambda: mj.per_sample_jacobian(_conv(), _x(), params="conv.weight"),
        ValueError,
        "unknown parameter name 'conv.weight'",
    ),
    (
        "batchnorm_train_mode",
        lambda: mj.per_sample_jacobian(_bn_train(), _x()),
        ValueError,
        r"module '1' \(BatchNorm2d\) is in train mode.*model.eval\(\).*batch_norm='eval'",
    ),
    (
        "batchnorm_train_mode_loop",
        lambda: per_sample_jacobian_loop(_bn_train(), _x()),
        ValueError,
        r"module '1' \(BatchNorm2d\) is in train mode",
    ),
    (
        "dropout_train_mode",
        lambda: mj.per_sample_jacobian(_dropout_train(), _x()),
        ValueError,
        r"module '2' \(Dropout, p=0.1\) is in train mode.*randomness='different'",
    ),
    (
        "non_floating_parameter",
        lambda: mj.per_sample_jacobian(_int_param_model(), _x()),
        TypeError,
        "parameter '0.weight' has dtype torch.int64; only floating-point",
    ),
    (
        "output_without_batch_dim",
        lambda: mj.per_sample_jacobian(_conv(), _x(), output_fn=lambda y: y[0]),
        ValueError,
        r"output has shape \(2, 4, 4\), but for one sample .* leading batch dim of 1",
    ),
    (
        "output_not_tensor",
        lambda: mj.per_sample_jacobian(_conv(), _x(), output_fn=lambda y: {"a": [y, "x"]}),
        TypeError,
        r"output\['a'\]\[1\] is a str",
    ),
    (
        "integer_images",
        lambda: mj.per_sample_jacobian(_conv(), torch.zeros(2, 2, 4, 4, dtype=torch.int32)),
        TypeError,
        r"level 0 holds integer data \(torch.int32\).*Convert images to floating point",
    ),
]


@pytest.mark.parametrize(
    ("call", "exc", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_raises_clear_error(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_no_assert_statements_for_user_input() -> None:
    """User input is never checked with ``assert`` (stripped under ``python -O``)."""
    import ast
    import pathlib

    root = pathlib.Path(mj.__file__).parent
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        asserts = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
        assert not asserts, f"{path.name} uses assert at lines {asserts}"
