"""Models that fold a dimension into the batch (issue 38): every route of every entry point
equals the loop oracle, falls back with a FallbackWarning, or refuses with a clear error.

The folds are :class:`multiscale_jac._folds.FoldingNet`'s: pairs sample-major and
sample-minor, permuted rows, rows sorted by their data, a learned token expanded over the
batch, video frames (sample-major and -minor), same-size levels concatenated or stacked along
the batch, a map and its mirror image, and the negative case of a batch mean.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import examples
from hypothesis import given, settings

import multiscale_jac as mj
from multiscale_jac._folds import CONV_FOLDS, VECTOR_FOLDS, FoldingNet, folding_inputs
from multiscale_jac.testing import FoldingCase, check_routes, folding_models

DTYPE = torch.float64


def _assert_ok(case: FoldingCase) -> None:
    report = check_routes(case.model, case.inputs, case.targets)
    assert report.ok, f"{case!r}\n{report.message()}"
    statuses = {r.status for r in report.routes}
    assert statuses <= {"exact", "fell back", "refused"}


@pytest.mark.slow
@settings(max_examples=examples(200, 200), deadline=None)
@given(case=folding_models())
def test_every_route_of_every_entry_point_on_drawn_folding_models(case: FoldingCase) -> None:
    """At least 200 drawn folding models (float64): 0 silent wrong numbers."""
    _assert_ok(case)


@settings(max_examples=examples(12, 8), deadline=None)
@given(case=folding_models())
def test_every_route_on_a_few_drawn_folding_models(case: FoldingCase) -> None:
    """The same property on a few draws (the fast tier)."""
    _assert_ok(case)


def _case(
    kind: str, n: int = 5, body: str | None = None
) -> tuple[FoldingNet, object, torch.Tensor]:
    body = body or ("conv" if kind in CONV_FOLDS else "linear")
    torch.manual_seed(0)
    model = FoldingNet(kind, body, items=2, features=3, width=4).to(DTYPE).eval()
    gen = torch.Generator().manual_seed(1)
    x = folding_inputs(model, n, features=3, size=3, generator=gen)
    y = torch.randint(0, 3, (n,), generator=gen)
    return model, x, y


# the four folds the issue measured: 11-50 % off before, no warning
FOLDS = ["items", "items_minor", "frames", "levels", "stack", "tta", "perm", "frames_minor"]


@pytest.mark.parametrize("kind", FOLDS)
@pytest.mark.parametrize("n", [1, 5])
def test_the_default_fisher_runs_layerwise_and_is_exact(kind: str, n: int) -> None:
    """The default (``method="auto"``) runs the closed forms on the folded rows (no fallback,
    no warning: a folded Linear or Conv is still a closed form) and equals ``vmap``."""
    model, x, y = _case(kind, n)
    ref = mj.diag_fisher(model, [(x, y)], method="vmap").flat
    for kind_ in ("empirical", "exact"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = mj.diag_fisher(model, [(x, y)], kind=kind_, tune=False)
        want = (
            ref
            if kind_ == "empirical"
            else mj.diag_fisher(model, [(x, y)], kind=kind_, method="vmap").flat
        )
        assert torch.allclose(got.flat, want, rtol=1e-10, atol=1e-14)
        assert set(got.plan.values()) <= {"gram", "per_sample", "norm_affine"}, got.plan


@pytest.mark.parametrize("kind", FOLDS)
def test_the_layerwise_jacobian_norm_is_exact_on_folds(kind: str) -> None:
    model, x, _ = _case(kind)
    want = mj.jacobian_sq_norm(model, x, method="vmap")
    got = mj.jacobian_sq_norm(model, x, method="layerwise")
    assert torch.allclose(got, want, rtol=1e-10)


@pytest.mark.parametrize("kind", ["items", "frames", "levels"])
def test_diag_laplace_is_the_diagonal_of_the_full_ggn(kind: str) -> None:
    """The issue's DiagLaplace: its H was 2-4.7 (relative) off the library's own full GGN."""
    model, x, y = _case(kind)
    diag = mj.DiagLaplace(model, "classification").fit([(x, y)])
    full = mj.SubnetLaplace(model, "classification", mj.ParamSubset.all(model)).fit([(x, y)])
    assert torch.allclose(diag.H, full.H.diagonal(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(("kind", "match"), [("mix", "mixes samples"), ("sort", "aten.sort")])
def test_rows_no_rule_describes_fall_back_with_the_reason(kind: str, match: str) -> None:
    """Rows mixed (a batch mean) or moved by their data (sorted): ``layerwise`` refuses,
    naming the op; ``auto`` falls back to ``vmap`` with a FallbackWarning that says so."""
    model, x, y = _case(kind)
    with pytest.raises(ValueError, match=match):
        mj.diag_fisher(model, [(x, y)], method="layerwise")
    with pytest.warns(mj.FallbackWarning, match=match):
        got = mj.diag_fisher(model, [(x, y)], tune=False)
    want = mj.diag_fisher(model, [(x, y)], method="vmap").flat
    assert torch.allclose(got.flat, want, rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match=match):
        mj.jacobian_sq_norm(model, x, method="layerwise")


def test_a_learned_row_read_by_every_sample_is_refused_naming_the_layer() -> None:
    """A Linear on a learned query expanded over the batch: its rows come from no sample's
    data and every sample's output reads them, so no closed form can split their gradient."""

    class Queries(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = torch.nn.Parameter(torch.randn(1, 2, 3))
            self.proj = torch.nn.Linear(3, 3)
            self.head = torch.nn.Linear(3, 2)

        def forward(self, x):
            q = self.proj(self.query.expand(x.shape[0], -1, -1))  # (N, 2, 3)
            return self.head((torch.softmax(q @ x.transpose(1, 2), -1) @ x).mean(1))

    torch.manual_seed(0)
    model = Queries().to(DTYPE).eval()
    x = torch.randn(4, 5, 3, dtype=DTYPE)
    y = torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match=r"Linear layer of 'proj.weight', 'proj.bias'.*no sample"):
        mj.diag_fisher(model, [(x, y)], method="layerwise", params="proj.*")
    with pytest.warns(mj.FallbackWarning, match="proj.weight"):
        got = mj.diag_fisher(model, [(x, y)], tune=False, params="proj.*")
    want = mj.diag_fisher(model, [(x, y)], method="vmap", params="proj.*")
    assert torch.allclose(got.flat, want.flat, rtol=1e-10)


@pytest.mark.parametrize("kind", VECTOR_FOLDS[:3] + CONV_FOLDS[:3])
def test_kron_factors_of_a_folded_batch_are_those_of_its_samples_one_at_a_time(kind: str) -> None:
    """K-FAC on folded rows: a sample's rows count as calls of their own (curvlinops'
    convention, checked against laplace-torch in test_kfac_laplace_torch.py), so a batch gives
    what its samples give one at a time."""
    from multiscale_jac._kfac import kron_factors

    model, x, y = _case(kind)
    params = [
        n for n, _ in model.named_parameters() if ("body" in n and "1." not in n) or "head" in n
    ]
    batched = kron_factors(model, [(x, y)], params=params)
    alone = kron_factors(model, [(x, y)], params=params, chunk_size=1)
    for a, b in zip(batched.layers, alone.layers):
        assert torch.allclose(a.A, b.A, rtol=1e-10) and torch.allclose(a.G, b.G, rtol=1e-10)
