"""Structured derivatives w.r.t. selected conv/linear weight entries equal the generic path."""

from __future__ import annotations

import pytest
import torch
from conftest import CASE_BY_ID
from torch import nn
from torch.func import jacfwd, jacrev, vmap

import multiscale_jac as mj
from multiscale_jac.adapter import PerSampleFunction
from multiscale_jac.models import ConvBlock
from multiscale_jac.structured import StructuredFunction, rev_candidates

D = torch.float64


class GroupedStrided(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2)
        self.b = nn.Conv2d(6, 3, 3, padding="same", bias=False)
        self.c = nn.Conv1d(3, 2, 3, stride=2)

    def forward(self, x):
        y = self.b(torch.tanh(self.a(x)))
        return self.c(y.flatten(2)).flatten(1) + self.b.weight.sum()  # weight also read directly


MODELS = {
    "convblock_two_levels": (lambda: ConvBlock(3, 8), lambda: [(3, 8, 8), (3, 7, 9)], "levels"),
    "grouped_strided_dilated": (GroupedStrided, lambda: (4, 7, 6), "tensor"),
    **{
        cid: (None, None, cid)
        for cid in ("mlp_vectors", "conv1d", "tied_weights", "shared_dict_head")
    },
}


def _problem(name: str):
    build, shapes, kind = MODELS[name]
    torch.manual_seed(0)
    if build is None:
        case = CASE_BY_ID[kind]
        model = case.build()
        inputs = case.inputs()
    else:
        model = build().to(D).eval()
        s = shapes()
        inputs = (
            [torch.randn(3, *t, dtype=D) for t in s]
            if kind == "levels"
            else torch.randn(3, *s, dtype=D)
        )
    return model, mj.pack(inputs)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("transform", ["fwd", "rev"])
def test_structured_equals_generic(name: str, transform: str) -> None:
    model, packed = _problem(name)
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(1)
    picks = {
        n: torch.randperm(p.numel(), generator=g)[: max(1, p.numel() // 3)]
        for n, p in params.items()
    }
    subset = mj.ParamSubset.from_indices(model, picks)
    levels = packed.stack(packed.buckets()[0].indices)  # one shape bucket
    jac = {}
    base = PerSampleFunction(model, subset, packed.kind)
    for structured in (False, True):
        fn = StructuredFunction(base, rev_candidates(base)) if structured else base
        if structured:
            assert fn.names, "no tensor took the structured path"
        t = jacfwd if transform == "fwd" else jacrev
        out = vmap(t(fn), in_dims=(None,) + (0,) * len(levels))(base.values(), *levels)
        jac[structured] = torch.cat([o.flatten(2) for o in out], dim=2)
    torch.testing.assert_close(jac[True], jac[False], atol=1e-12, rtol=0)


def test_large_share_of_a_tensor_stays_generic() -> None:
    model = ConvBlock(3, 8).to(D)
    w = model.conv[0].weight
    subset = mj.ParamSubset.from_indices(
        model, {"conv.0.weight": torch.arange(w.numel() // 2 + 1), "conv.1.weight": [0, 1]}
    )
    fn = PerSampleFunction(model, subset, "levels")
    assert rev_candidates(fn) == ("conv.1.weight",)
    assert StructuredFunction(fn, subset.names).names == ("conv.1.weight",)
