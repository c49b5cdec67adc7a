"""multiscale_jac.testing: the strategies draw valid, well-shrinking inputs; the checkers pass
on the zoo and fail readably when a route is broken on purpose; the module works without
Hypothesis (the strategies then raise an ImportError naming the extra)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from cases import BIFPN_CHANNELS, CASE_IDS, CASES, SLOW_TIER, make_subset
from conftest import CASE_BY_ID, examples, zoo_model
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from test_fisher import as_model_input, batches, make_targets, samples_of

import multiscale_jac as mj
import multiscale_jac.engine
import multiscale_jac.testing
from multiscale_jac.testing import (
    CheckReport,
    assert_fisher_matches,
    assert_jacobian_matches,
    assert_laplace_matches,
    check_model,
    images,
    param_subsets,
    pyramids,
    token_batches,
)


def _finest_doubled(pyramid) -> list:
    """Two-level samples whose finest level is exactly twice the coarse one (what
    ``F.interpolate(scale_factor=2)`` in ``fpn_scale_ragged`` needs)."""
    return [[x.repeat_interleave(2, -1).repeat_interleave(2, -2), y] for x, y in pyramid]


def _bifpn_strides(pyramid) -> list:
    """Three-level samples at strides 1, 2 and 4 exactly (what ``bifpn_ragged``'s max pooling
    and nearest upsampling by 2 need), from levels drawn at one size."""
    return [
        [
            x.repeat_interleave(4, -1).repeat_interleave(4, -2),
            y.repeat_interleave(2, -1).repeat_interleave(2, -2),
            z,
        ]
        for x, y, z in pyramid
    ]


SMALL = {"max_size": 4, "batch_size": (1, 3)}
# every zoo model's inputs, drawn by the strategy that fits it (small, so the loop is quick)
ZOO_INPUTS = {
    "seed_convblock_levels": pyramids(
        channels=3, strides=(1, 1), min_size=7, max_size=7, batch_size=(1, 3), ragged=False
    ),
    "seed_convblock_ragged": pyramids(
        channels=3, strides=(1, 1), min_size=7, max_size=8, batch_size=(1, 2)
    ),
    "fpn_ragged": pyramids(channels=(3, 4), strides=(1, 2), **SMALL),
    "fpn_scale_ragged": pyramids(
        channels=(3, 4), strides=(1, 1), max_size=2, batch_size=(1, 3)
    ).map(_finest_doubled),
    "bn_cnn_multicrop": pyramids(channels=3, strides=(1, 2), **SMALL),
    "dense_per_pixel": images(channels=2, **SMALL),
    "dense_tensor": images(channels=2, ragged=False, **SMALL),
    "mlp_vectors": images(channels=5, spatial_dims=0, ragged=False, batch_size=(1, 3)),
    "conv1d": images(channels=2, spatial_dims=1, min_size=3, max_size=6, ragged=False),
    "conv3d": images(channels=1, spatial_dims=3, min_size=2, max_size=3, ragged=False),
    "shared_dict_head": pyramids(channels=(2, 3), strides=(1, 2), **SMALL),
    "tied_weights": images(channels=4, spatial_dims=0, ragged=False, batch_size=(1, 3)),
    "transformer_tokens": token_batches(channels=3, max_tokens=5, batch_size=(1, 3)),
    "transformer_tokens_2d": token_batches(
        channels=3, spatial_dims=2, max_tokens=3, batch_size=(1, 3)
    ),
    "anchor_cache_head": pyramids(channels=(2, 3), strides=(1, 2), **SMALL),
    "coord_grid": pyramids(channels=2, strides=(1, 2), **SMALL),
    "bifpn_ragged": pyramids(
        channels=BIFPN_CHANNELS, strides=(1, 1, 1), max_size=2, batch_size=(1, 3)
    ).map(_bifpn_strides),
}


def _levels(x) -> list:
    return list(x.values()) if isinstance(x, dict) else list(x)


# ---------------------------------------------------------------------- strategies: validity
@st.composite
def pyramid_options(draw) -> dict:
    num_levels = draw(st.integers(1, 4))
    lo = draw(st.integers(1, 3))
    per_level = st.lists(st.integers(1, 3), min_size=num_levels, max_size=num_levels)
    return {
        "channels": draw(st.integers(1, 3) | per_level),
        "strides": draw(
            st.lists(st.sampled_from([1, 2, 3, 4]), min_size=num_levels, max_size=num_levels)
        ),
        "spatial_dims": draw(
            st.just(2) | st.lists(st.integers(0, 3), min_size=num_levels, max_size=num_levels)
        ),
        "min_size": lo,
        "max_size": draw(st.integers(lo, 7)),
        "batch_size": draw(st.integers(1, 3) | st.tuples(st.just(1), st.integers(1, 5))),
        "ragged": draw(st.booleans()),
        "as_mapping": draw(st.sampled_from([False, True, ("c3", "c4", "c5", "c6")[:num_levels]])),
    }


@settings(max_examples=examples(ci=100, dev=40))
@given(options=pyramid_options(), data=st.data())
def test_pyramids_are_valid_inputs(options: dict, data) -> None:
    pyr = data.draw(pyramids(**options))
    strides = options["strides"]
    num_levels = len(strides)
    channels = options["channels"]
    channels = channels if isinstance(channels, list) else [channels] * num_levels
    dims = options["spatial_dims"]
    dims = dims if isinstance(dims, list) else [dims] * num_levels
    mapping = options["as_mapping"]
    keys = None if mapping is False else list(mapping) if mapping is not True else None
    if mapping is True:
        keys = [f"p{k}" for k in range(num_levels)]
    ragged = options["ragged"]
    packed = mj.pack(pyr, input_kind="samples" if ragged else "levels")  # accepted as drawn
    if ragged:
        assert isinstance(pyr, list) and packed.kind == "samples"
        samples = [_levels(s) for s in pyr]
        for s in pyr:
            assert (list(s) if keys else None) == keys and isinstance(s, OrderedDict) == bool(keys)
    else:
        assert packed.kind == "levels" and packed.is_uniform
        assert isinstance(pyr, OrderedDict) == bool(keys) and (list(pyr) if keys else None) == keys
        samples = [list(packed.sample(i)) for i in range(packed.num_samples)]
    lo, hi = (
        (options["batch_size"],) * 2
        if isinstance(options["batch_size"], int)
        else options["batch_size"]
    )
    assert lo <= len(samples) <= hi
    finest = strides.index(min(strides))
    rounding = {}
    for sample in samples:
        assert [t.shape[0] for t in sample] == channels
        assert [t.dim() - 1 for t in sample] == dims
        assert all(t.dtype == torch.float64 for t in sample)
        full = sample[finest].shape[1:]  # the finest level's sizes (its rank may be below max)
        assert all(options["min_size"] <= h <= options["max_size"] for h in full)
        for lvl, t in enumerate(sample):
            for d, h in enumerate(t.shape[1:]):
                if d >= len(full):  # a dim the finest level does not have: bounds only
                    continue
                num = full[d] * min(strides)
                floor, ceil = max(1, num // strides[lvl]), max(1, -(-num // strides[lvl]))
                assert h in (floor, ceil)
                if floor != ceil:  # one rounding per level and batch
                    assert rounding.setdefault(lvl, h == ceil) == (h == ceil)


def _find(strategy, condition, n: int = 300):
    """The minimal example that meets ``condition`` (Hypothesis shrinks it)."""
    return find(strategy, condition, settings=settings(max_examples=n, database=None))


def _occurs(strategy, condition, n: int = 300):
    """The first example drawn that meets ``condition`` (no shrinking: only that it occurs)."""
    quick = settings(max_examples=n, database=None, phases=[Phase.generate])
    return find(strategy, condition, settings=quick)


def _shapes(pyr) -> list[list[tuple[int, ...]]]:
    return [[tuple(t.shape) for t in _levels(s)] for s in pyr]


def test_ragged_uniform_and_mapping_forms_all_occur() -> None:
    strategy = pyramids(channels=(2, 3), batch_size=(1, 4))
    assert len(_occurs(strategy, lambda p: len(mj.pack(p).buckets()) > 1)) >= 2  # ragged
    shared = _occurs(strategy, lambda p: len(p) >= 3 and len(mj.pack(p).buckets()) == 2)
    assert max(len(b.indices) for b in mj.pack(shared).buckets()) >= 2  # a bucket of several
    uniform = _occurs(pyramids(channels=2, ragged=False), lambda p: True)
    assert isinstance(uniform, list) and all(t.dim() == 4 for t in uniform)
    assert mj.pack(uniform).is_uniform
    mapping = _occurs(pyramids(channels=2, as_mapping=("p3", "p4", "p5")), lambda p: True)
    assert all(list(sample) == ["p3", "p4", "p5"] for sample in mapping)
    # odd finest sizes next to one-pixel coarse maps, and both roundings of the same size
    _occurs(
        pyramids(channels=1, min_size=3, max_size=9),
        lambda p: p[0][0].shape[1] % 2 == 1 and p[0][2].shape[1] == 1,
    )
    three = pyramids(channels=1, min_size=3, max_size=3)
    assert _occurs(three, lambda p: p[0][1].shape[1] == 1)  # floor(3 / 2)
    assert _occurs(three, lambda p: p[0][1].shape[1] == 2)  # ceil(3 / 2)


def test_pyramids_shrink_to_the_smallest_pyramid() -> None:
    strategy = pyramids(channels=(2, 3, 4), batch_size=(1, 5), max_size=9)
    assert _shapes(_find(strategy, lambda p: True)) == [[(2, 1, 1), (3, 1, 1), (4, 1, 1)]]
    # a condition on the size: the minimal example has exactly what it needs, all else minimal
    tall = _find(strategy, lambda p: len(p) >= 2 and any(s[0].shape[1] >= 5 for s in p))
    assert _shapes(tall) == [[(2, 5, 1), (3, 2, 1), (4, 1, 1)]] * 2
    # a failure that needs two shapes in the batch: two samples, one of them the smallest
    two = _find(strategy, lambda p: len(mj.pack(p).buckets()) > 1)
    smallest, other = sorted(_shapes(two))
    assert smallest == [(2, 1, 1), (3, 1, 1), (4, 1, 1)]
    assert sorted(other[0][1:]) == [1, 2] and other[1:] == smallest[1:]


def test_images_and_token_batches() -> None:
    ragged = _occurs(images(channels=3), lambda x: len(x) > 1 and x[0].shape != x[1].shape)
    assert all(t.shape[0] == 3 and t.dim() == 3 for t in ragged)
    assert mj.pack(ragged, input_kind="tensors").kind == "tensors"
    assert _find(images(channels=2, ragged=False, spatial_dims=1), lambda x: True).shape == (
        1,
        2,
        1,
    )
    tokens = _occurs(token_batches(channels=3), lambda p: p.num_samples > 1 and not p.is_uniform)
    assert tokens.layout == "nested" and tokens.nested[0].size(2) == 3
    assert len({t.shape[0] for t in tokens.nested[0].unbind()}) > 1  # ragged token counts
    grid = _occurs(token_batches(channels=2, spatial_dims=2, max_tokens=3), lambda p: True)
    assert grid.levels[0].dim() == 4
    plain = _occurs(token_batches(channels=2, as_list=False), lambda p: True)
    assert plain.kind == "tensors"


@settings(max_examples=examples(ci=60, dev=25))
@given(
    data=st.data(), case_id=st.sampled_from(["fpn_ragged", "tied_weights", "transformer_tokens"])
)
def test_param_subsets_are_valid(data, case_id: str) -> None:
    model = zoo_model(case_id)
    within = {
        "fpn_ragged": "head.*",
        "tied_weights": None,
        "transformer_tokens": ["qkv.*", "cls.*"],
    }
    params = within[case_id]
    allowed = set(
        mj.ParamSubset.from_names(model, params).names
        if params
        else mj.ParamSubset.all(model).names
    )
    subset = data.draw(
        param_subsets(model, params=params, max_entries=5, max_tensors=2, max_whole=20)
    )
    subset.check_model(model)
    assert set(subset.names) <= allowed
    assert all(subset.shapes[n].numel() <= 20 for n in subset.names if subset.is_whole(n))
    assert sum(len(i) for i in subset.indices.values() if i is not None) <= 5
    flat = subset.flat_indices()
    assert len(set(flat.tolist())) == subset.numel  # no duplicates


def test_param_subset_kinds_and_orders_all_occur() -> None:
    model = zoo_model("fpn_ragged")
    strategy = param_subsets(model)
    names = [n for n, _ in model.named_parameters()]
    several = _occurs(strategy, lambda s: len(s.names) > 1 and s.all_whole)
    assert several.numel > 1  # whole tensors: by a glob or several names
    backwards = _occurs(
        strategy,
        lambda s: any(i is not None and len(i) > 1 and i[0] > i[1] for i in s.indices.values()),
    )
    assert backwards.numel >= 2  # entries of one tensor in descending order
    interleaved = _occurs(param_subsets(model, kinds=("flat",)), lambda s: s.columns is not None)
    assert interleaved.numel >= 3  # flat indices whose order interleaves tensors
    mixed = _occurs(strategy, lambda s: any(s.is_whole(n) for n in s.names) and not s.all_whole)
    assert len(mixed.names) >= 2  # whole tensors and entries of others
    order = [names.index(n) for n in _occurs(strategy, lambda s: len(s.names) > 1).names]
    assert len(order) > 1
    _occurs(
        strategy,
        lambda s: [names.index(n) for n in s.names] != sorted(names.index(n) for n in s.names),
    )
    # tensors too large to be drawn whole: their entries are drawn instead
    assert not _occurs(param_subsets(model, kinds=("tensors",), max_whole=1), bool).all_whole
    # shrinking: the first tensor whole, or its entry 0
    assert _find(strategy, lambda s: True) == mj.ParamSubset.from_names(model, names[0])
    one = _find(strategy, lambda s: not s.all_whole)
    assert one == mj.ParamSubset.from_indices(model, {names[0]: [0]})


def test_strategy_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="different level counts"):
        pyramids(channels=(1, 2), strides=(1, 2, 4))
    with pytest.raises(ValueError, match="min_size"):
        pyramids(channels=1, min_size=5, max_size=2)
    with pytest.raises(TypeError, match="batch_size"):
        pyramids(channels=1, batch_size=(1, 2, 3))
    with pytest.raises(ValueError, match="2 distinct keys"):
        pyramids(channels=(1, 2), as_mapping=("a", "a"))
    with pytest.raises(ValueError, match="kinds"):
        param_subsets(zoo_model("mlp_vectors"), kinds=("all",))


# ---------------------------------------------------------------------- checkers
# the zoo's own inputs; the larger ones run in the slow tier (the drawn inputs below cover
# every model in the fast tier)
HEAVY = {
    "seed_convblock_levels",
    "seed_convblock_ragged",
    "fpn_scale_ragged",
    "bn_cnn_multicrop",
    *SLOW_TIER,
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] * (c.id in HEAVY)) for c in CASES]
)
def test_assert_jacobian_matches_on_every_zoo_case(case) -> None:
    model = case.build()  # fresh: a cache the user's own calls set changes what padded may do
    report = assert_jacobian_matches(
        model, case.inputs(), params=case.glob, output_fn=case.output_fn
    )
    assert isinstance(report, CheckReport) and report.ok
    padded = report.routes[-1]
    assert padded.route.startswith("strategy='padded'")
    if case.padded_unsupported:
        assert padded.status == "fell back" and re.search(case.padded_unsupported, padded.reason)
    elif case.ragged:
        assert padded.status == "exact" and padded.ran.startswith("padded"), padded


def test_every_zoo_model_has_a_drawn_input() -> None:
    assert sorted(ZOO_INPUTS) == sorted(CASE_IDS)


@pytest.mark.parametrize(
    "case_id", [pytest.param(c, marks=[pytest.mark.slow] * (c in SLOW_TIER)) for c in CASE_IDS]
)
@settings(max_examples=examples(ci=4, dev=2))
@given(data=st.data())
def test_assert_jacobian_matches_on_drawn_inputs_and_subsets(case_id: str, data) -> None:
    """Every zoo model, over inputs drawn by pyramids / images / token_batches and subsets
    drawn by param_subsets, passes on every default route."""
    model = zoo_model(case_id)
    inputs = data.draw(ZOO_INPUTS[case_id], label="inputs")
    subset = data.draw(param_subsets(model, max_entries=4, max_tensors=2), label="subset")
    assert_jacobian_matches(model, inputs, params=subset, output_fn=CASE_BY_ID[case_id].output_fn)


def _corrupt(monkeypatch, strategy: str, where: tuple[int, int, int], by: float = 0.5) -> None:
    """Make ``per_sample_jacobian``'s ``strategy`` route return one wrong entry."""
    original = multiscale_jac.engine.run_engine

    def broken(fn, packed, options):
        res = original(fn, packed, options)
        if options.strategy.value != strategy:
            return res
        jac = res.jacobian.clone()
        jac[where] += by
        return dataclasses.replace(res, jacobian=jac)

    monkeypatch.setattr(multiscale_jac.engine, "run_engine", broken)


def test_a_broken_route_is_named_with_sample_row_parameter_and_index(monkeypatch) -> None:
    model = zoo_model("shared_dict_head")
    inputs = CASE_BY_ID["shared_dict_head"].inputs()
    names = [n for n, _ in model.named_parameters()]
    # interleaved flat indices: column 3 is entry 4 of shared.weight, of shape (2, 3, 3, 3)
    starts = dict(
        zip(
            names,
            torch.cumsum(torch.tensor([0] + [p.numel() for p in model.parameters()]), 0).tolist(),
        )
    )
    flat = [starts["shared.bias"] + 1, starts["proj.0.weight"], 7, starts["shared.weight"] + 4]
    subset = mj.ParamSubset.from_flat_indices(model, flat)
    assert_jacobian_matches(model, inputs, params=subset)  # exact before breaking it
    _corrupt(monkeypatch, "padded", (1, 2, 3))
    with pytest.raises(AssertionError) as err:
        assert_jacobian_matches(model, inputs, params=subset)
    text = str(err.value)
    first = text.splitlines()[1]
    assert first.startswith("- strategy='padded', mode='auto' (ran padded, ")
    assert "mismatch: sample 1 (level shapes (2, 4, 2), (3, 1, 3)), output row 2 of 4" in first
    assert "parameter 'shared.weight' entry 4 (index (0, 0, 1, 1)), column 3" in first
    assert re.search(r"error 0\.5\b", first) and "1 of 32 entries outside the tolerance" in first
    assert text.startswith("1 of 3 routes failed")
    assert "strategy='auto', mode='auto'" in text  # the table lists every route
    # docs/testing.md quotes this message under "What a failure looks like"
    page = (Path(__file__).resolve().parent.parent / "docs" / "testing.md").read_text()
    quoted = re.search(r"## What a failure looks like\n.*?```text\n(.*?)```", page, flags=re.S)
    assert quoted and quoted.group(1).strip() == text.strip()


def test_a_route_that_raises_fails_with_its_exception(monkeypatch) -> None:
    def boom(fn, packed, options):
        raise RuntimeError("boom in the engine")

    monkeypatch.setattr(multiscale_jac.engine, "run_engine", boom)
    case = CASE_BY_ID["mlp_vectors"]
    with pytest.raises(AssertionError, match=r"strategy='auto'.*error: RuntimeError: boom"):
        assert_jacobian_matches(zoo_model(case.id), case.inputs(), strategies=("auto",))


def test_strict_fails_on_a_fallback_quoting_the_reason() -> None:
    case = CASE_BY_ID["fpn_ragged"]  # F.interpolate(size=...): padded execution cannot run it
    model, inputs = zoo_model(case.id), case.inputs()[:2]
    report = assert_jacobian_matches(model, inputs, params="head.2.bias", strategies=("padded",))
    (route,) = report.routes
    assert route.status == "fell back" and route.ran.startswith("bucketed")
    assert "fell back [1]" in str(report) and "[1] strategy 'padded' cannot run" in str(report)
    with pytest.raises(AssertionError) as err:
        assert_jacobian_matches(
            model, inputs, params="head.2.bias", strategies=("padded",), strict=True
        )
    text = str(err.value)
    assert "fell back (strict): strategy 'padded' cannot run this model" in text
    assert "F.interpolate in module '<model>'" in text and "size=" in text


def test_float32_models_are_checked_on_a_float64_copy() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Tanh(), torch.nn.Flatten())
    x = [torch.randn(2, 4, 5), torch.randn(2, 3, 3)]
    report = check_model(model, x, strategies=("bucketed",), modes=("rev", "fwd"))
    assert report.ok and [r.status for r in report.routes] == ["exact", "exact"]
    assert next(model.parameters()).dtype == torch.float32  # the user's model is unchanged


NO_HYPOTHESIS = """
import sys
sys.modules["hypothesis"] = None  # as if it were not installed
import torch
from multiscale_jac.testing import assert_jacobian_matches, check_model, images
from multiscale_jac.testing import param_subsets, pyramids, token_batches
model = torch.nn.Linear(3, 2).double()
assert check_model(model, torch.randn(2, 3, dtype=torch.float64)).ok
for strategy, args in [(pyramids, {}), (images, {}), (token_batches, {}), (param_subsets, (model,))]:
    try:
        strategy(*args) if args else strategy(channels=2)
    except ImportError as err:
        assert 'pip install "multiscale_jac[testing]"' in str(err), err
    else:
        raise AssertionError(strategy)
print("ok")
"""


@pytest.mark.slow  # a fresh interpreter that imports torch: seconds
def test_without_hypothesis_checkers_import_and_strategies_name_the_extra() -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(NO_HYPOTHESIS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------- derived quantities
FISHER_CASES = [
    ("mlp_vectors", "classification"),
    ("dense_per_pixel", "classification"),
    ("mlp_vectors", "regression"),
    pytest.param("fpn_ragged", "regression", marks=pytest.mark.slow),
]


def _data(case_id: str, likelihood: str):
    model = zoo_model(case_id)
    samples, kind_in = samples_of(case_id)
    outs = [model(as_model_input(x, kind_in)).detach() for x in samples]
    return model, batches(samples, make_targets(outs, likelihood), kind_in, 2)


@pytest.mark.parametrize("case_id, likelihood", FISHER_CASES)
def test_assert_fisher_matches(case_id: str, likelihood: str) -> None:
    model, data = _data(case_id, likelihood)
    subset = make_subset(model, "elements", CASE_BY_ID[case_id])
    report = assert_fisher_matches(
        model,
        data,
        params=subset,
        likelihood=likelihood,
        sigma_noise=0.7 if likelihood == "regression" else 1.0,
    )
    assert [r.route for r in report.routes] == [
        "kind='empirical', method='auto'",
        "kind='exact', method='auto'",
    ]


def test_a_broken_fisher_is_named(monkeypatch) -> None:
    model, data = _data("mlp_vectors", "classification")
    original = multiscale_jac.testing.diag_fisher

    def broken(*args, **kwargs):
        res = original(*args, **kwargs)
        if kwargs["kind"] != "exact":
            return res
        flat = res.flat.clone()
        flat[2] *= 1.5
        return dataclasses.replace(res, flat=flat)

    monkeypatch.setattr(multiscale_jac.testing, "diag_fisher", broken)
    subset = mj.ParamSubset.from_indices(model, {"net.2.weight": [5, 1, 4], "net.0.bias": [0]})
    with pytest.raises(AssertionError) as err:
        assert_fisher_matches(model, data, params=subset)
    first = str(err.value).splitlines()[1]
    assert first.startswith("- kind='exact', method='auto' (ran ")
    assert "parameter 'net.2.weight' entry 4 (index (0, 4)), column 2" in first


@pytest.mark.parametrize("case_id, likelihood", FISHER_CASES)
def test_assert_laplace_matches(case_id: str, likelihood: str) -> None:
    model, data = _data(case_id, likelihood)
    subset = make_subset(model, "elements", CASE_BY_ID[case_id])
    report = assert_laplace_matches(model, data, subset, likelihood=likelihood, prior_precision=0.5)
    quantities = [r.route for r in report.routes]
    assert quantities[:3] == [
        "fit: H = sum_i J_i^T Lambda_i J_i",
        "predictive: mean = f(x)",
        "predictive: variance = diag(J Sigma J^T)",
    ]
    assert ("predictive: covariance = J Sigma J^T" in quantities) == (case_id != "dense_per_pixel")


@pytest.mark.parametrize(
    "case_id", ["dense_per_pixel", pytest.param("fpn_ragged", marks=pytest.mark.slow)]
)
def test_assert_laplace_matches_empirical_regression_with_noise(case_id: str) -> None:
    model, data = _data(case_id, "regression")
    subset = make_subset(model, "flat", CASE_BY_ID[case_id])
    assert_laplace_matches(
        model, data, subset, likelihood="regression", hessian="empirical", sigma_noise=0.5
    )


def test_a_broken_laplace_is_named(monkeypatch) -> None:
    model, data = _data("mlp_vectors", "classification")

    class Broken(mj.SubnetLaplace):
        def fit(self, *args, **kwargs):
            super().fit(*args, **kwargs)
            self.H[0, 1] += 1.0
            return self

    monkeypatch.setattr(multiscale_jac.testing, "SubnetLaplace", Broken)
    subset = mj.ParamSubset.from_indices(model, {"net.2.bias": [2], "net.0.weight": [7, 3]})
    with pytest.raises(AssertionError) as err:
        assert_laplace_matches(model, data, subset)
    text = str(err.value)
    assert (
        "- fit: H = sum_i J_i^T Lambda_i J_i (ran SubnetLaplace(hessian='ggn')): mismatch: " in text
    )
    assert (
        "H[0, 1]: parameter 'net.2.bias' entry 2, column 0 and parameter 'net.0.weight' entry 7 "
        "(index (1, 2)), column 1" in text
    )
