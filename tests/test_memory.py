"""One memory model (``multiscale_jac._memory``): the minimum planning states is the one a
budget below it is refused with, and every entry point reads it (no probing)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import CASE_BY_ID
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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
    from multiscale_jac.laplace import _jacobian_rows as _curvature

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Tanh(), torch.nn.Conv2d(4, 3, 1)
    ).eval()
    x, y = torch.randn(2, 3, 6, 6), torch.randint(0, 3, (2, 6, 6))
    subset = mj.ParamSubset.largest_magnitude(model, 20)
    calls = []
    real = _curvature.JacobianRows._engine

    def spy(self, packed, output_fn, options):
        calls.append(options.memory_budget)
        return real(self, packed, output_fn, options)

    monkeypatch.setattr(_curvature.JacobianRows, "_engine", spy)
    with pytest.raises(MemoryBudgetError, match="the engine computing them") as err:
        mj.SubnetLaplace(model, "classification", subset, memory_budget=1).fit([(x, y)])
    assert calls == []  # nothing ran to learn the minimum
    la = mj.SubnetLaplace(model, "classification", subset, memory_budget=err.value.minimum)
    la.fit([(x, y)])
    ref = mj.SubnetLaplace(model, "classification", subset).fit([(x, y)])
    torch.testing.assert_close(la.H, ref.H, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- the budget holds
class LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among the storages made inside the
    mode (every op's outputs, tracked until freed): what a call allocates, not what existed
    before it (the model, the inputs). Blind to a kernel's own scratch memory."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]
        # a view's output shares its input's storage: allocated before, or counted
        inputs = {_storage(t)[1] for t in tree_flatten((args, kwargs))[0]}
        for t in tree_flatten(out)[0]:
            storage, key = _storage(t)
            if storage is not None and key and key not in self.live and key not in inputs:
                self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
                self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def _storage(t: object) -> tuple[torch.UntypedStorage | None, int]:
    """A tensor's storage and its address (``None, 0``: not a tensor with a storage of its
    own: meta tensors, and the wrappers forward-mode ``vmap`` passes through the mode)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None, 0
    try:
        storage = t.untyped_storage()
        return storage, storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None, 0


class ResidualBN(nn.Module):
    """A residual block with BatchNorm: its vmapped backward holds several cotangents a row
    (the skip's waits for the body; BatchNorm's batching rule copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
        )  # fmt: skip
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = self.stem(x)
        y = torch.relu(x + self.body(x))
        return self.head(F.adaptive_avg_pool2d(y, 4).flatten(1))


def _budget_models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 5),
    )  # fmt: skip
    mlp = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 5))
    return {
        "cnn": (cnn.eval(), torch.randn(7, 3, 16, 16)),
        "residual_bn": (ResidualBN().eval(), torch.randn(7, 3, 16, 16)),
        "mlp": (mlp.eval(), torch.randn(7, 64)),
    }


def _allocates_under_budget(model: nn.Module, x: Any, times: int, **kwargs: Any) -> Any:
    """``per_sample_jacobian`` under ``times`` its stated minimum (``memory_budget=1`` raises
    it), one-time allocations paid on one sample first: the tensors it allocates (its result
    included) stay under the budget. Returns the result."""
    with pytest.raises(MemoryBudgetError) as err:
        mj.per_sample_jacobian(model, x, memory_budget=1, **kwargs)
    budget = times * err.value.minimum
    mj.per_sample_jacobian(model, x[:1], **kwargs)  # one-time allocations outside the count
    with LiveBytes() as live:
        res = mj.per_sample_jacobian(model, x, memory_budget=budget, **kwargs)
    assert live.peak <= budget, f"{live.peak} bytes allocated under a budget of {budget}"
    return res


@pytest.mark.parametrize("name", ["cnn", "residual_bn", "mlp"])
@pytest.mark.parametrize("times", [1, 2, 4])
def test_the_engine_allocates_at_most_its_budget(name: str, times: int) -> None:
    """Reverse mode under ``memory_budget``: the tensors a call allocates (its result
    included) never exceed the budget, from the minimum up; the minimum is stated by the
    memory model, so an undercounted step (a residual block's backward holds more than two
    layers' cotangents a row) fails here."""
    model, x = _budget_models()[name]
    kwargs = dict(mode="rev", strategy="vmap", entries="generic", tune=False)
    res = _allocates_under_budget(model, x, times, **kwargs)
    assert res.jacobian.shape[0] == 7


@pytest.mark.parametrize(
    ("name", "times"),
    [
        pytest.param(
            "residual_bn",
            1,
            marks=pytest.mark.xfail(
                strict=True,
                reason="known gap: at exactly the minimum a fit allocates 1-3% over its budget "
                "(the residual block's BatchNorm reverse step 174.2 kB under 168.9 kB; the "
                "2-conv CNN's survey, 111.9 kB under 110.6 kB, where it runs: a job as small "
                "as this one skips it)",
            ),
        ),
        *[(name, t) for name in ("cnn", "residual_bn") for t in (2, 4)],
        ("cnn", 1),
    ],
)
def test_a_laplace_fit_allocates_at_most_its_budget(name: str, times: int) -> None:
    """A ``SubnetLaplace`` fit under ``memory_budget``: the tensors it allocates (posterior,
    Jacobian rows, the engine's working set, planning's passes) stay under the budget."""
    model, x = _budget_models()[name]
    y = torch.randint(0, 5, (x.shape[0],))
    subset = mj.ParamSubset.largest_magnitude(model, 30)
    with pytest.raises(MemoryBudgetError) as err:
        mj.SubnetLaplace(model, "classification", subset, memory_budget=1).fit([(x, y)])
    budget = times * err.value.minimum
    la = mj.SubnetLaplace(model, "classification", subset, memory_budget=budget)
    with LiveBytes() as live:
        la.fit([(x, y)])
    assert live.peak <= budget, f"{live.peak} bytes allocated under a budget of {budget}"


def _indexed_head() -> tuple[nn.Module, torch.Tensor, mj.ParamSubset]:
    """A wide linear layer of which 24 entries are selected by index: each forward tangent
    of a generic entry puts its one-hot into a tangent of the whole (64, 512) weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 64), nn.Tanh(), nn.Linear(64, 3)).eval()
    subset = mj.ParamSubset.from_indices(model, {"0.weight": torch.arange(0, 24 * 97, 97)})
    return model, torch.randn(5, 512), subset


@pytest.mark.parametrize("times", [1, 2, 4])
def test_generic_forward_tangents_of_an_indexed_tensor_stay_under_the_budget(times: int) -> None:
    """Forward mode, generic entries of a tensor selected by index: each sample's tangents of
    the whole tensor (128 kB each here) and its copy the entries are put into are in the
    memory model, so the budget holds from the minimum up."""
    model, x, subset = _indexed_head()
    kwargs = dict(params=subset, mode="fwd", strategy="vmap", entries="generic", tune=False)
    res = _allocates_under_budget(model, x, times, **kwargs)
    assert res.jacobian.shape == (5, 3, 24)


@pytest.mark.parametrize(
    "times",
    [
        pytest.param(1, marks=pytest.mark.slow),  # one sample and one tangent a step: 18 s
        2,
        4,
    ],
)
def test_structured_forward_entries_stay_under_the_budget(times: int) -> None:
    """Forward mode, structured entries of three ConvBlock tensors (200 entries, the largest
    tensor's all in one step): the budget holds from twice the minimum up."""
    torch.manual_seed(0)
    model = mj.models.ConvBlock(in_ch=32, out_ch=8).eval()
    x = [torch.randn(3, 32, 24, 24), torch.randn(3, 32, 14, 14)]
    numel = sum(p.numel() for p in model.parameters())
    picks = torch.randperm(numel, generator=torch.Generator().manual_seed(2))[:200]
    subset = mj.ParamSubset.from_flat_indices(model, picks)
    kwargs = dict(params=subset, mode="fwd", strategy="vmap", entries="structured", tune=False)
    res = _allocates_under_budget(model, x, times, **kwargs)
    assert res.jacobian.shape == (3, 3104, 200)
