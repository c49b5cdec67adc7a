"""Structured Jacobian columns for conv/linear weight and bias entries (``entries=``).

Every structured result is compared with the loop oracle in float64 (1e-10): on every zoo model
(shared modules over levels, tied weights, BatchNorm in eval, dense outputs, tokens), for entry
subsets spread over all tensors (first/last entries included) and for whole tensors, in both
modes; and on hypothesis-generated conv stacks shared over levels.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from cases import CASES, DTYPE, FWD_HEAVY, SLOW_TIER
from conftest import CASE_BY_ID, zoo_model
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

import multiscale_jac as mj
import multiscale_jac.models
from multiscale_jac.adapter import PerSampleFunction
from multiscale_jac.entries import entry_names
from multiscale_jac.reference import per_sample_jacobian_loop
from multiscale_jac.structured import rev_candidates
from multiscale_jac.testing import pyramids

TOL = 1e-10


def entry_subset(model: nn.Module, kind: str, seed: int = 0) -> mj.ParamSubset:
    """``entries``: a few random entries of every tensor plus its first and last entry;
    ``whole``: every tensor whole (the degenerate case)."""
    if kind == "whole":
        return mj.ParamSubset.all(model)
    g = torch.Generator().manual_seed(seed)
    chosen = {}
    for name, p in model.named_parameters():
        n = p.numel()
        pick = torch.randperm(n, generator=g)[: min(3, n)]
        chosen[name] = torch.cat([pick, torch.tensor([0, n - 1])]).unique()
    return mj.ParamSubset.from_indices(model, chosen)


def oracle(model: nn.Module, inputs, subset: mj.ParamSubset, output_fn=None) -> mj.JacobianResult:
    return per_sample_jacobian_loop(model, inputs, params=subset, output_fn=output_fn)


def assert_matches(res: mj.JacobianResult, ref: mj.JacobianResult) -> None:
    assert res.jacobian.shape == ref.jacobian.shape
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=TOL, rtol=0)


def _structured_combos() -> list:
    """Every case x mode x kind. The fast tier runs one kind per case and mode, turning with
    the case: every case meets both modes and both kinds, every mode meets both kinds on half
    the cases; the slow tier runs the rest."""
    out = []
    for i, c in enumerate(CASES):
        for j, mode in enumerate(("fwd", "rev")):
            for k, kind in enumerate(("entries", "whole")):
                # forward mode over every tensor of a deep model: seconds (slow tier)
                # and the SLOW_TIER cases (seconds in either mode)
                heavy = (c.id in FWD_HEAVY and mode == "fwd") or c.id in SLOW_TIER
                fast = (i + j) % 2 == k and not heavy
                out.append(
                    pytest.param(
                        c.id,
                        mode,
                        kind,
                        id=f"{c.id}-{mode}-{kind}",
                        marks=[pytest.mark.slow] * (not fast),
                    )
                )
    return out


@pytest.mark.parametrize(("case_id", "mode", "kind"), _structured_combos())
def test_structured_matches_loop(case_id: str, mode: str, kind: str) -> None:
    case = CASE_BY_ID[case_id]
    model = zoo_model(case_id)
    subset = entry_subset(model, kind)
    inputs = case.inputs()
    ref = oracle(model, inputs, subset, case.output_fn)
    with pytest.warns() if case.fwd_unsupported and mode == "fwd" else _no_warning():
        res = mj.per_sample_jacobian(
            model,
            inputs,
            params=subset,
            output_fn=case.output_fn,
            mode=mode,
            strategy="bucketed",
            entries="structured",
        )
    assert_matches(res, ref)
    fn = PerSampleFunction(model, subset, mj.pack(inputs).kind)
    if res.mode == "fwd":
        # every conv/linear weight or bias the model calls through conv/linear ran structured
        assert set(res.structured) <= set(entry_names(fn))
        if entry_names(fn):
            assert res.structured, res.notes
    else:
        assert set(res.structured) == set(rev_candidates(fn))


class _no_warning:
    def __enter__(self) -> None:
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error", mj.FallbackWarning)

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


@pytest.mark.parametrize("case_id", ["seed_convblock_levels", "fpn_ragged", "mlp_vectors"])
def test_generic_and_auto_agree_with_structured(case_id: str, monkeypatch) -> None:
    from multiscale_jac import engine

    monkeypatch.setattr(engine, "SMALL_JOB_S", 0.0)  # planned in full, however small the job
    case = CASE_BY_ID[case_id]
    model = zoo_model(case_id)
    subset = entry_subset(model, "entries", seed=1)
    ref = oracle(model, case.inputs(), subset, case.output_fn)
    for entries in ("generic", "auto", "structured"):
        res = mj.per_sample_jacobian(
            model, case.inputs(), params=subset, output_fn=case.output_fn, entries=entries
        )
        assert_matches(res, ref)
        if entries == "generic":
            assert res.structured == ()
        assert res.requested_mode == "auto"
        assert any(n.startswith("mode: estimated") for n in res.notes), res.notes


# ---------------------------------------------------------------------- hypothesis
ACTS = ["none", "relu", "relu_inplace", "tanh", "bn", "gelu"]


class Stack(nn.Module):
    """Conv layers shared over every level (applied once per level), outputs concatenated."""

    def __init__(self, layers: list[dict], c_in: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList()
        self.acts: list[str] = []
        self.bns = nn.ModuleDict()
        c = c_in
        for i, spec in enumerate(layers):
            conv = nn.Conv2d(
                c,
                spec["out"],
                spec["k"],
                stride=spec["stride"],
                padding=spec["padding"],
                dilation=spec["dilation"],
                groups=spec["groups"],
                bias=spec["bias"],
            )
            self.convs.append(conv)
            self.acts.append(spec["act"])
            if spec["act"] == "bn":
                bn = nn.BatchNorm2d(spec["out"])
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                self.bns[str(i)] = bn
            c = spec["out"]

    def forward(self, levels: list[torch.Tensor]) -> torch.Tensor:
        outs = []
        for x in levels:
            for i, (conv, act) in enumerate(zip(self.convs, self.acts)):
                x = conv(x)
                if act == "relu":
                    x = F.relu(x)
                elif act == "relu_inplace":
                    x = F.relu(x, inplace=True)
                elif act == "tanh":
                    x = torch.tanh(x)
                elif act == "gelu":
                    x = F.gelu(x)
                elif act == "bn":
                    x = self.bns[str(i)](x)
            outs.append(x.flatten(1))
        return torch.cat(outs, dim=1)


@st.composite
def conv_stacks(draw):
    c_in = draw(st.integers(1, 3))
    layers = []
    c = c_in
    reach = 0
    for _ in range(draw(st.integers(1, 3))):
        out = draw(st.integers(1, 4))
        groups = draw(st.sampled_from([g for g in (1, 2) if c % g == 0 and out % g == 0]))
        k = draw(st.integers(1, 3))
        stride = draw(st.integers(1, 2))
        dilation = draw(st.integers(1, 2))
        pads = [0, 1] + (["same"] if stride == 1 else [])
        padding = draw(st.sampled_from(pads))
        layers.append(
            {
                "out": out,
                "k": k,
                "stride": stride,
                "dilation": dilation,
                "padding": padding,
                "groups": groups,
                "bias": draw(st.booleans()),
                "act": draw(st.sampled_from(ACTS)),
            }
        )
        reach += dilation * (k - 1)
        c = out
    size = reach * 2 + 2
    batch = draw(st.integers(1, 3))
    # 1-2 batched levels, each of its own size (size..size+3 per side)
    one_level = pyramids(
        channels=c_in,
        strides=1,
        min_size=size,
        max_size=size + 3,
        batch_size=batch,
        ragged=False,
        dtype=DTYPE,
    )
    inputs = [draw(one_level)[0] for _ in range(draw(st.integers(1, 2)))]
    return c_in, layers, inputs, draw(st.integers(0, 2**16))


@given(spec=conv_stacks(), mode=st.sampled_from(["fwd", "rev"]))
def test_random_conv_stacks_structured_match_loop(spec, mode: str) -> None:
    c_in, layers, inputs, seed = spec
    torch.manual_seed(seed)
    model = Stack(layers, c_in).to(DTYPE).eval()
    try:
        model(inputs)
    except RuntimeError:  # strides shrank a level below a kernel: not a valid model
        assume(False)
    subset = entry_subset(model, "entries", seed=seed)
    ref = oracle(model, inputs, subset)
    res = mj.per_sample_jacobian(
        model, inputs, params=subset, mode=mode, entries="structured", strict=True
    )
    assert_matches(res, ref)
    if mode == "fwd":
        # every conv weight/bias ran structured, or the notes say why not
        for name in subset.names:
            if name.startswith("convs.") and name not in res.structured:
                assert any(name in n and ("generic" in n) for n in res.notes), res.notes


# ---------------------------------------------------------------------- fallbacks
class InplaceAfterConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3)
        self.b = nn.Conv2d(3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y.mul_(2.0)  # in place on a layer output: the structured pass cannot keep it pending
        return self.b(y).flatten(1)


class RecurrentConv(nn.Module):
    """The same conv applied to its own output: its input carries a tangent (dense route)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.c(x))).flatten(1)


class RecurrentConvDense(nn.Module):
    """The same conv on its own output after a non-elementwise op: the second call's input
    carries a (materialised) tangent, so the entry layer takes its dense route."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x)
        return self.c(y.roll(1, dims=-1)).flatten(1)


class WeightElsewhere(nn.Module):
    """A weight also read outside conv/linear (a penalty-like output): the generic route."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x).flatten(1)
        return torch.cat([y, self.c.weight.sum().reshape(1, 1) * y[:, :1]], dim=1)


@pytest.mark.parametrize(
    "model_cls, note",
    [
        (InplaceAfterConv, "in-place op"),
        (RecurrentConv, None),
        (RecurrentConvDense, None),
        (WeightElsewhere, None),
    ],
)
def test_structured_edge_cases_stay_exact(model_cls, note: str | None) -> None:
    torch.manual_seed(0)
    model = model_cls().to(DTYPE).eval()
    x = torch.randn(2, 2, 6, 6, dtype=DTYPE)
    subset = entry_subset(model, "entries")
    ref = oracle(model, x, subset)
    res = mj.per_sample_jacobian(model, x, params=subset, mode="fwd", entries="structured")
    assert_matches(res, ref)
    assert res.fallback is None and res.strategy == "vmap", res.fallback
    if note:
        assert any(note in n for n in res.notes), res.notes
        assert "a.weight" not in res.structured


def test_entries_option_is_validated() -> None:
    model = zoo_model("mlp_vectors")
    with pytest.raises(ValueError, match=r"entries.*'fast'"):
        mj.per_sample_jacobian(model, torch.randn(2, 5, dtype=DTYPE), entries="fast")


# ---------------------------------------------------------------------- memory planner
def test_budgets_give_identical_structured_results() -> None:
    case = CASE_BY_ID["seed_convblock_levels"]
    model = zoo_model(case.id)
    subset = entry_subset(model, "entries", seed=3)
    ref = oracle(model, case.inputs(), subset)
    res = mj.per_sample_jacobian(model, case.inputs(), params=subset, memory_budget=10**9)
    result_bytes = res.jacobian.numel() * res.jacobian.element_size()
    with pytest.raises(ValueError, match=r"minimum of (\d+) bytes") as info:
        mj.per_sample_jacobian(model, case.inputs(), params=subset, memory_budget=result_bytes)
    minimum = int(re.search(r"minimum of (\d+) bytes", str(info.value)).group(1))
    seen = set()
    for factor in (1.0, 1.3, 2.0, 5.0, 50.0):
        r = mj.per_sample_jacobian(
            model, case.inputs(), params=subset, memory_budget=int(minimum * factor)
        )
        seen.add((r.chunk_size, r.inner_chunk_size))
        assert r.structured == res.structured
        torch.testing.assert_close(r.jacobian, ref.jacobian, atol=TOL, rtol=0)
    assert len(seen) > 1  # the budgets did change the chunking


PLANNER_SCRIPT = textwrap.dedent(
    """
    import gc, json, sys, torch
    import multiscale_jac as mj
    from multiscale_jac.models import ConvBlock

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def hwm():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ConvBlock(16, 8).eval()
    x = [torch.randn(8, 16, 20, 20), torch.randn(8, 16, 12, 12)]
    g = torch.Generator().manual_seed(1)
    subset = mj.ParamSubset.from_indices(
        model, {n: torch.randperm(p.numel(), generator=g)[:60]
                for n, p in model.named_parameters() if n.endswith("weight")}
    )
    budget = int(sys.argv[1])
    small = mj.per_sample_jacobian(model, [t[:1] for t in x], params=subset)  # warm-up
    del small
    gc.collect()
    base = rss()
    try:
        res = mj.per_sample_jacobian(model, x, params=subset, memory_budget=budget)
    except ValueError as err:
        print(json.dumps({"error": str(err)}))
        raise SystemExit(0)
    print(json.dumps({"rise": hwm() - base, "result": res.jacobian.numel() * 4,
                      "chunks": [res.chunk_size, res.inner_chunk_size]}))
    """
)


def _planner(budget: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PLANNER_SCRIPT, str(budget)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_memory_budget_holds_in_a_fresh_process() -> None:
    """Peak RSS rise of one call stays under a generous budget; an impossible one raises."""
    budget = 120 * 2**20
    rec = _planner(budget)
    assert "error" not in rec, rec
    assert rec["rise"] <= budget, rec
    assert rec["result"] < budget
    rec = _planner(2**20)
    assert "below the estimated minimum" in rec["error"]


def test_memory_budget_holds_on_cuda(cuda_device) -> None:
    """On CUDA the planner's budget bounds ``max_memory_allocated`` over the call."""
    torch.manual_seed(0)
    model = mj.models.ConvBlock(16, 8).to(cuda_device).eval()
    x = [
        torch.randn(8, 16, 20, 20, device=cuda_device),
        torch.randn(8, 16, 12, 12, device=cuda_device),
    ]
    g = torch.Generator().manual_seed(1)
    subset = mj.ParamSubset.from_indices(
        model,
        {
            n: torch.randperm(p.numel(), generator=g)[:60]
            for n, p in model.named_parameters()
            if n.endswith("weight")
        },
    )
    budget = 64 * 2**20
    torch.cuda.synchronize(cuda_device)
    torch.cuda.reset_peak_memory_stats(cuda_device)
    base = torch.cuda.memory_allocated(cuda_device)
    res = mj.per_sample_jacobian(model, x, params=subset, memory_budget=budget)
    torch.cuda.synchronize(cuda_device)
    assert torch.cuda.max_memory_allocated(cuda_device) - base <= budget
    cpu = mj.per_sample_jacobian(model.cpu(), [t.cpu() for t in x], params=subset)
    torch.testing.assert_close(res.jacobian.cpu(), cpu.jacobian, atol=1e-4, rtol=1e-4)
