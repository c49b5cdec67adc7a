"""The adapter calls the model with the structure the user passed, as a batch of one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multiscale_jac as mj
from multiscale_jac.adapter import flatten_output
from multiscale_jac.reference import per_sample_jacobian_loop


class Recorder(nn.Module):
    """Records what the model receives; sums every level through one linear map."""

    def __init__(self, channels: int = 2) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(channels, dtype=torch.float64))
        self.seen: list = []

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            self.seen.append(("tensor", tuple(x.shape)))
            levels = [x]
        else:
            self.seen.append((type(x).__name__, [tuple(t.shape) for t in x]))
            levels = x
        batch = levels[0].shape[0]
        outs = [torch.einsum("bc...,c->b", t, self.w).reshape(batch, 1) for t in levels]
        return torch.cat(outs, dim=1)


@pytest.mark.parametrize("strategy", ["bucketed", "padded", "loop"])
def test_structure_passed_to_model(strategy: str) -> None:
    model = Recorder()
    d = torch.float64
    mj.per_sample_jacobian(model, torch.randn(3, 2, 4, 5, dtype=d), strategy=strategy)
    assert set(model.seen) == {("tensor", (1, 2, 4, 5))}
    model.seen.clear()
    mj.per_sample_jacobian(
        model,
        [torch.randn(3, 2, 4, 4, dtype=d), torch.randn(3, 2, 2, 2, dtype=d)],
        strategy=strategy,
    )
    assert {str(s) for s in model.seen} == {str(("list", [(1, 2, 4, 4), (1, 2, 2, 2)]))}
    model.seen.clear()
    # ragged samples with one level: still a list
    mj.per_sample_jacobian(
        model, [[torch.randn(2, 3, 3, dtype=d)], [torch.randn(2, 1, 4, dtype=d)]], strategy=strategy
    )
    if strategy == "padded":  # every sample padded to the largest size, masked
        assert {str(s) for s in model.seen} == {str(("list", [(1, 2, 3, 4)]))}
    else:
        assert {str(s) for s in model.seen} == {
            str(("list", [(1, 2, 3, 3)])),
            str(("list", [(1, 2, 1, 4)])),
        }


def test_outputs_are_flattened_leaf_by_leaf() -> None:
    a = torch.arange(6.0).reshape(1, 2, 3)
    b = torch.tensor([[7.0]])
    out = flatten_output({"x": a, "y": [b, (a[:, :1],)]})
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 7, 0, 1, 2]
    assert flatten_output(torch.tensor(3.0)).tolist() == [3.0]


def test_scalar_output_fn() -> None:
    model = Recorder()
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    res = mj.per_sample_jacobian(model, x, output_fn=lambda y: y.sum())
    ref = per_sample_jacobian_loop(model, x, output_fn=lambda y: y.sum())
    assert res.jacobian.shape == (4, 1, 2)
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=1e-12, rtol=0)
    # d/dw of sum_c,h,w x[c,h,w] w[c] = sum_h,w x[c]
    torch.testing.assert_close(res.jacobian[:, 0], x.sum(dim=(2, 3)), atol=1e-12, rtol=0)


def test_buffers_are_used_as_they_are() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2).double()
            self.register_buffer("scale", torch.tensor(3.0, dtype=torch.float64))

        def forward(self, x):
            return self.lin(x) * self.scale

    model = Scaled()
    x = torch.randn(2, 3, dtype=torch.float64)
    res = mj.per_sample_jacobian(model, x, params="lin.bias")
    torch.testing.assert_close(
        res.jacobian, 3.0 * torch.eye(2, dtype=torch.float64).expand(2, 2, 2)
    )
