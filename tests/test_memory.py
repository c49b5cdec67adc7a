"""One memory model (``multiscale_jac._memory``): the minimum planning states is the one a
budget below it is refused with, and every entry point reads it (no probing)."""

from __future__ import annotations

import pytest
import torch
from conftest import CASE_BY_ID

import multiscale_jac as mj
from multiscale_jac import _planning
from multiscale_jac._checks import prepare
from multiscale_jac.enums import MemoryBudgetError, Strategy


@pytest.mark.parametrize(
    "case_id", ["seed_convblock_levels", "fpn_scale_ragged", "bn_cnn_multicrop"]
)
@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_engine_minimum_is_the_minimum_a_budget_is_refused_with(case_id: str, mode: str) -> None:
    """``engine_minimum`` (planned, not run) equals what ``MemoryBudgetError`` states for the
    same call, and a budget of exactly that runs (on the small case: the minimum runs one
    row or tangent at a time)."""
    case = CASE_BY_ID[case_id]
    model, inputs = case.build(), case.inputs()
    kwargs = dict(mode=mode, strategy="bucketed", entries="generic")
    with pytest.raises(MemoryBudgetError) as err:
        mj.per_sample_jacobian(model, inputs, memory_budget=1, **kwargs)
    prep = prepare(model, params=None, output_fn=None, batch_norm="eval", randomness="error")
    packed = prep.pack(inputs)
    options = _planning.EngineOptions(
        mode=mj.Mode(mode), strategy=Strategy.BUCKETED, entries=mj.Entries.GENERIC
    )
    least = _planning.engine_minimum(prep.function(packed), packed, Strategy.BUCKETED, options)
    assert least == err.value.minimum
    if (case_id, mode) == ("bn_cnn_multicrop", "rev"):  # one row at a time: slow elsewhere
        res = mj.per_sample_jacobian(model, inputs, memory_budget=least, **kwargs)
        assert res.jacobian.shape[0] == packed.num_samples


def test_laplace_states_its_minimum_without_running_the_engine(monkeypatch) -> None:
    """The Laplace fit's budget adds the engine's minimum for one output position's rows
    (planned, :func:`engine_minimum`) to its own rows and the posterior: the engine is not
    called to find it, a budget below is refused naming the parts, and the minimum runs."""
    from multiscale_jac.laplace import _curvature

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Tanh(), torch.nn.Conv2d(4, 3, 1)
    ).eval()
    x, y = torch.randn(2, 3, 6, 6), torch.randint(0, 3, (2, 6, 6))
    subset = mj.ParamSubset.largest_magnitude(model, 20)
    calls = []
    real = _curvature.JacobianStream._engine

    def spy(self, packed, output_fn, options):
        calls.append(options.memory_budget)
        return real(self, packed, output_fn, options)

    monkeypatch.setattr(_curvature.JacobianStream, "_engine", spy)
    with pytest.raises(MemoryBudgetError, match="the engine computing them") as err:
        mj.SubnetLaplace(model, "classification", subset, memory_budget=1).fit([(x, y)])
    assert calls == []  # nothing ran to learn the minimum
    la = mj.SubnetLaplace(model, "classification", subset, memory_budget=err.value.minimum)
    la.fit([(x, y)])
    ref = mj.SubnetLaplace(model, "classification", subset).fit([(x, y)])
    torch.testing.assert_close(la.H, ref.H, rtol=1e-5, atol=1e-6)
