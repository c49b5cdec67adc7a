"""A followed run's rows taken over by a later run (multiscale_jac._row_replay): only where the
later run made the same torch calls with the same arguments; a fold that Python state, data or
index values change between calls of the same shapes still gets its rows right."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multiscale_jac as mj
from multiscale_jac._row_replay import ROW_PLANS

DTYPE = torch.float64


def _kept(model: nn.Module) -> list:
    """The row plans kept for ``model``."""
    return [v for (ident, _), (_, v) in ROW_PLANS._entries.items() if ident == id(model) and v]


class _Pairs(nn.Module):
    """Pairs folded into the batch: sample-major or sample-minor (``minor``), rolled by
    ``shift`` rows, permuted by a permutation drawn from ``perm_seed``, or rolled by a row where the
    first entry of the batch is positive (``by_data``: read from sample 0 alone); the rows go back in order before the head, so a
    sample's output is its own alone or in a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = nn.Linear(3, 4), nn.Linear(8, 2)
        self.minor, self.shift, self.perm_seed, self.by_data = False, 0, None, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        rows = x.transpose(0, 1).reshape(-1, 3) if self.minor else x.reshape(-1, 3)
        if self.shift:
            rows = torch.roll(rows, self.shift, 0)
        perm = None
        if self.perm_seed is not None:
            g = torch.Generator().manual_seed(self.perm_seed)
            perm = torch.randperm(rows.shape[0], generator=g)
            rows = rows[perm]
        if self.by_data and bool(x[0, 0, 0] > 0):
            rows = torch.roll(rows, 1, 0)
        h = torch.tanh(self.inner(rows))
        if self.by_data and bool(x[0, 0, 0] > 0):
            h = torch.roll(h, -1, 0)
        if perm is not None:
            h = h[torch.argsort(perm)]
        if self.shift:
            h = torch.roll(h, -self.shift, 0)
        h = h.reshape(2, n, 4).transpose(0, 1) if self.minor else h.reshape(n, 2, 4)
        return self.head(h.reshape(n, 8))


def _model() -> _Pairs:
    torch.manual_seed(0)
    return _Pairs().to(DTYPE)


def _data(seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 2, 3, generator=g, dtype=DTYPE)
    return [(x, torch.randint(0, 2, (5,), generator=g))]


def _loop_fisher(model: nn.Module, data: list) -> torch.Tensor:
    """The empirical Fisher's diagonal, one sample at a time (mean of squared gradients)."""
    (x, y), params = data[0], list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        for t, g in zip(total, torch.autograd.grad(loss, params)):
            t += g**2
    return torch.cat([t.reshape(-1) for t in total]) / x.shape[0]


def _check(model: nn.Module, data: list) -> None:
    got = mj.diag_fisher(model, data, method="layerwise").flat
    torch.testing.assert_close(got, _loop_fisher(model, data), rtol=1e-10, atol=1e-12)


def test_a_second_run_takes_the_rows_over() -> None:
    model = _model()
    _check(model, _data())
    assert _kept(model)
    _check(model, _data(1))  # other values, the same calls: taken over, and right


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: setattr(m, "minor", True), id="the fold turns sample-minor"),
        pytest.param(lambda m: setattr(m, "shift", 3), id="rows rolled by another shift"),
    ],
)
def test_python_state_that_changes_the_calls_is_followed_again(change) -> None:
    model = _model()
    _check(model, _data())
    change(model)
    _check(model, _data())


def test_index_values_are_read_on_every_run() -> None:
    """A permutation by an index tensor: its rule reads values, so no run is taken over."""
    model = _model()
    for seed in (0, 1, 2):
        model.perm_seed = seed
        _check(model, _data())
        assert not _kept(model)


def test_control_flow_on_data_is_followed_again() -> None:
    model = _model()
    model.by_data = True
    x, y = _data()[0]
    for sign in (1.0, -1.0, 1.0):
        x = x.clone()
        x[0, 0, 0] = sign * x[0, 0, 0].abs()
        _check(model, [(x, y)])
    assert _kept(model)  # pure runs: kept, and followed again where they differ


def test_clear_plan_cache_forgets_the_kept_runs() -> None:
    model = _model()
    _check(model, _data())
    assert _kept(model)
    mj.clear_plan_cache()
    assert not _kept(model)
