"""jacobian_sq_norm: value, exact gradient (double backward, finite differences), chunking,
the Hutchinson estimate."""

from __future__ import annotations

import pytest
import torch
from cases import DTYPE, make_subset
from conftest import CASE_BY_ID, jacnorm_jobs, zoo_model
from torch.nn.attention import SDPBackend, sdpa_kernel

import multiscale_jac as mj
from multiscale_jac.jacnorm import jacobian_sq_norm, jacobian_sq_norm_backward

CASE_IDS = ["seed_convblock_levels", "fpn_ragged", "mlp_vectors", "dense_per_pixel", "conv1d"]


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def double_backward(model, case, subset) -> dict[str, torch.Tensor]:
    """grad of sum_i sum_o |g_io[subset]|^2 by plain autograd, one sample and row at a time."""
    params = dict(model.named_parameters())
    packed = mj.pack(case.inputs())
    model.zero_grad(set_to_none=True)
    for i in range(packed.num_samples):
        levels = [t.unsqueeze(0) for t in packed.sample(i)]
        out = model(levels[0] if packed.kind is mj.InputKind.TENSOR else levels)
        if case.output_fn is not None:
            out = case.output_fn(out)
        out = out.reshape(-1)
        total = 0
        for o in range(out.numel()):
            gs = torch.autograd.grad(out[o], list(params.values()), create_graph=True)
            total = total + (subset.flatten(dict(zip(params, gs))) ** 2).sum()
        total.backward()
    ref = grads_of(model)
    model.zero_grad(set_to_none=True)
    return ref


@pytest.mark.parametrize(
    "case_id, method",
    [
        # the ragged pyramid's layerwise and hvp runs take seconds (slow tier); its vmap run and
        # the batched pyramid's three stay in the fast tier
        pytest.param(
            c, m, marks=[pytest.mark.slow] * (c == "fpn_ragged" and m in ("layerwise", "hvp"))
        )
        for c in CASE_IDS
        for m in ("layerwise", "vmap", "hvp")
    ],
)
def test_value_and_gradient_match_the_loop(case_id: str, method: str) -> None:
    case = CASE_BY_ID[case_id]
    model = zoo_model(case_id)
    subset = make_subset(model, "elements", case)
    jac = mj.per_sample_jacobian(
        model, case.inputs(), params=subset, output_fn=case.output_fn
    ).jacobian
    model.zero_grad(set_to_none=True)
    s = jacobian_sq_norm(
        model, case.inputs(), params=subset, output_fn=case.output_fn, method=method
    )
    torch.testing.assert_close(s, (jac**2).sum(), atol=1e-10, rtol=0)
    s.backward()
    got = grads_of(model)
    ref = double_backward(model, case, subset)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-10, rtol=0, msg=n)
    # chunked, accumulating into .grad, equals the one-shot backward
    for chunk in (1, 3):
        model.zero_grad(set_to_none=True)
        v = jacobian_sq_norm_backward(
            model,
            case.inputs(),
            params=subset,
            output_fn=case.output_fn,
            chunk_size=chunk,
            method=method,
        )
        torch.testing.assert_close(v, s.detach(), atol=1e-10, rtol=0)
        for n, g in grads_of(model).items():
            torch.testing.assert_close(g, ref[n], atol=1e-10, rtol=0, msg=n)
    model.zero_grad(set_to_none=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case_id, names", [("mlp_vectors", "net.0.weight"), ("bn_cnn_multicrop", "features.*")]
)
def test_gradient_matches_finite_differences(case_id: str, names: str) -> None:
    case = CASE_BY_ID[case_id]
    model = zoo_model(case.id)
    subset = mj.ParamSubset.from_names(model, names)
    model.zero_grad(set_to_none=True)
    jacobian_sq_norm(model, case.inputs(), params=subset, method="layerwise").backward()
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    eps = 1e-6
    for name, p in model.named_parameters():
        for k in (0, p.numel() - 1):
            with torch.no_grad():
                old = p.view(-1)[k].item()
                p.view(-1)[k] = old + eps
                hi = jacobian_sq_norm(model, case.inputs(), params=subset).item()
                p.view(-1)[k] = old - eps
                lo = jacobian_sq_norm(model, case.inputs(), params=subset).item()
                p.view(-1)[k] = old
            fd = (hi - lo) / (2 * eps)
            assert abs(fd - got[name].view(-1)[k].item()) < 1e-6 * max(1.0, abs(fd)), (name, k)


def test_task_loss_plus_penalty() -> None:
    """The documented training pattern: (task_loss + lam * S).backward()."""
    model = zoo_model("mlp_vectors")
    x = torch.randn(4, 5, dtype=DTYPE)
    model.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    (loss + 0.1 * jacobian_sq_norm(model, x)).backward()
    both = grads_of(model)
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    jacobian_sq_norm_backward(model, x, scale=0.1)
    for n, g in grads_of(model).items():
        torch.testing.assert_close(g, both[n], atol=1e-12, rtol=0)
    model.zero_grad(set_to_none=True)


def test_one_pass_for_value_and_gradient(monkeypatch) -> None:
    """Where the result needs a gradient, one pass computes value and gradient (no value-only
    pass before the backward); under no_grad only the value; a second backward of the same
    result is refused rather than returning zeros."""
    from multiscale_jac import jacnorm

    passes: list[bool] = []
    run = jacnorm._Job.run

    def counted(self, *, with_grad: bool):
        passes.append(with_grad)
        return run(self, with_grad=with_grad)

    monkeypatch.setattr(jacnorm._Job, "run", counted)
    model = zoo_model("mlp_vectors")
    x = torch.randn(4, 5, dtype=DTYPE)
    s = jacobian_sq_norm(model, x)
    assert s.requires_grad and passes == [True]
    s.backward(retain_graph=True)
    assert passes == [True]
    with pytest.raises(RuntimeError, match="call jacobian_sq_norm again"):
        s.backward()
    with torch.no_grad():
        value = jacobian_sq_norm(model, x)
    assert passes == [True, False] and not value.requires_grad
    torch.testing.assert_close(value, s.detach(), atol=1e-12, rtol=0)
    model.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_hutchinson_is_unbiased_and_consistent() -> None:
    case = CASE_BY_ID["seed_convblock_levels"]
    model = zoo_model(case.id)
    subset = make_subset(model, "elements", case)
    exact = jacobian_sq_norm(model, case.inputs(), params=subset).item()

    def est(seed: int, k: int = 16, method: str = "auto") -> torch.Tensor:
        return jacobian_sq_norm(
            model,
            case.inputs(),
            params=subset,
            estimator="hutchinson",
            num_probes=k,
            generator=torch.Generator().manual_seed(seed),
            method=method,
        )

    mean = sum(est(s).item() for s in range(40)) / 40
    # 640 Rademacher probes per sample: the relative error of the mean is a few percent
    assert abs(mean - exact) < 0.05 * exact, (mean, exact)
    # the gradient is the gradient of the estimate: the same probes give the same numbers
    model.zero_grad(set_to_none=True)
    est(7).backward()
    g1 = grads_of(model)
    model.zero_grad(set_to_none=True)
    jacobian_sq_norm_backward(
        model,
        case.inputs(),
        params=subset,
        estimator="hutchinson",
        num_probes=16,
        generator=torch.Generator().manual_seed(7),
    )
    for n, g in grads_of(model).items():
        torch.testing.assert_close(g, g1[n], atol=1e-10, rtol=0)
    # both methods give the same estimate and gradient for the same probes
    model.zero_grad(set_to_none=True)
    est(7, method="hvp").backward()
    for n, g in grads_of(model).items():
        torch.testing.assert_close(g, g1[n], atol=1e-10, rtol=0)
    torch.testing.assert_close(est(7, method="hvp"), est(7, method="layerwise"), atol=1e-10, rtol=0)
    model.zero_grad(set_to_none=True)


def test_layerwise_fallback_warns(monkeypatch) -> None:
    """``auto`` that chose ``layerwise`` (forced here; normally by timing) and met a model whose
    batched run mixes samples falls back to ``vmap``, warns, and ``strict=True`` raises."""
    from multiscale_jac import jacnorm
    from multiscale_jac.enums import JacNormMethod

    def tune(self, tune) -> None:
        if self.plan is not None:
            self.method = JacNormMethod.LAYERWISE

    monkeypatch.setattr(jacnorm._Job, "tune", tune)
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2).to(DTYPE)

    class Mix(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h - h.mean(0, keepdim=True) + h

    model, x = Mix(), torch.randn(4, 3, dtype=DTYPE)
    with pytest.warns(mj.FallbackWarning, match="mixes samples"):
        got = jacobian_sq_norm(model, x)
    torch.testing.assert_close(got, jacobian_sq_norm(model, x, method="hvp"), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="mixes samples"):
        jacobian_sq_norm(model, x, strict=True)
    with pytest.raises(ValueError, match="mixes samples"):
        jacobian_sq_norm(model, x, method="layerwise")


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"estimator": "sketch"}, ValueError, "estimator"),
        ({"num_probes": 0, "estimator": "hutchinson"}, ValueError, "num_probes"),
        ({"num_probes": 4}, ValueError, "hutchinson"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"generator": 1}, TypeError, "generator"),
    ],
)
def test_bad_arguments(kwargs, err, match) -> None:
    model = zoo_model("mlp_vectors")
    with pytest.raises(err, match=match):
        jacobian_sq_norm(model, torch.randn(2, 5, dtype=DTYPE), **kwargs)


def test_attention_in_float32_is_differentiated_twice() -> None:
    """``F.scaled_dot_product_attention``'s fused CPU kernel (float32) has no double backward:
    the regulariser runs attention by its math form and matches the float64 result."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(layer, torch.nn.Flatten(), torch.nn.Linear(8 * 5, 1)).eval()
    x = torch.randn(3, 5, 8)
    s = jacobian_sq_norm(model, x, method="vmap")
    s.backward()
    got = model[2].weight.grad.clone()
    ref = model.double()
    ref.zero_grad(set_to_none=True)
    s64 = jacobian_sq_norm(ref, x.double(), method="vmap")
    s64.backward()
    torch.testing.assert_close(s.double(), s64, rtol=1e-4, atol=0)
    torch.testing.assert_close(got.double(), ref[2].weight.grad, rtol=1e-3, atol=1e-5)


class _Norms(torch.nn.Module):
    """Layer and instance normalisation (torch's batched double backward of both is wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.inorm = torch.nn.InstanceNorm2d(4, affine=True)
        self.lnorm = torch.nn.LayerNorm([4, 3, 3])
        self.head = torch.nn.Linear(36, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lnorm(torch.tanh(self.inorm(self.conv(x)))).flatten(1))


class _Attention(torch.nn.Module):
    """Tokens ``(B, T, 3)``: LayerNorm, one attention head (fused kernel: no double backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(3)
        self.qkv = torch.nn.Linear(3, 6)
        self.head = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).unsqueeze(1).chunk(3, dim=-1)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.head(att.squeeze(1).mean(1))


@pytest.mark.parametrize("method", ["vmap", "hvp"])
@pytest.mark.parametrize("which", ["norms", "attention"])
@pytest.mark.parametrize("dtype", [DTYPE, torch.float32], ids=["float64", "float32"])
def test_normalisation_and_attention_gradients_match_the_loop(which, method, dtype) -> None:
    """The routes that differentiate twice under ``vmap`` run layer/instance normalisation by
    their formulas and attention by its math form: exact against plain double backward (in
    float64; float32 against float64, where the fused attention kernel is used)."""
    torch.manual_seed(0)
    model = (_Norms() if which == "norms" else _Attention()).to(dtype)
    g = torch.Generator().manual_seed(1)
    x = (
        torch.randn(3, 2, 5, 5, generator=g)
        if which == "norms"
        else torch.randn(3, 4, 3, generator=g)
    )
    case = type("Case", (), {"inputs": lambda: x.to(DTYPE), "output_fn": None})
    model.zero_grad(set_to_none=True)
    jacobian_sq_norm(model, x.to(dtype), method=method).backward()
    got = grads_of(model)
    model = model.to(DTYPE)
    with sdpa_kernel([SDPBackend.MATH]):  # the reference: plain autograd, math attention
        ref = double_backward(model, case, mj.ParamSubset.all(model))
    tol = dict(atol=1e-10, rtol=0) if dtype is DTYPE else dict(atol=1e-4, rtol=1e-3)
    for n in ref:
        torch.testing.assert_close(got[n].to(DTYPE), ref[n], **tol, msg=n)


def test_layerwise_runs_are_freed_after_the_call(monkeypatch) -> None:
    """The layer-wise route's runs (their per-sample products and the model's tensors) are
    freed once the call and its backward are done: the gradient hooks on the layers' outputs
    are removed, so no reference cycle through the autograd graph keeps them (each call
    leaked about a parameter copy per chunk)."""
    import gc
    import weakref

    from multiscale_jac import layerwise

    runs: list[weakref.ref] = []
    init = layerwise.LayerwiseRun.__init__

    def keep(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        runs.append(weakref.ref(self))

    monkeypatch.setattr(layerwise.LayerwiseRun, "__init__", keep)
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2))
    x = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    model = model.to(torch.float64)
    jacobian_sq_norm(model, x, method="layerwise", chunk_size=2).backward()
    gc.collect()
    assert len(runs) == 3 and all(r() is None for r in runs)


@pytest.mark.parametrize(
    ("params", "chunk_size", "vmap_chunk", "hvp_chunk"),
    [
        ("*", None, 7, 7),  # 2 rows x 4 MiB of the 512x512 weight per sample: 32 MiB / 4.0
        ("0.*", None, 32, 7),  # the subset's largest tensor (vmap), every parameter (hvp)
        ("*", 24, 24, 24),  # a given chunk_size is the user's to choose
    ],
    ids=["capped", "subset_of_small_tensors", "chunk_size_given"],
)
def test_cpu_chunks_keep_per_sample_tensors_under_32_mib(
    monkeypatch, params: str, chunk_size: int | None, vmap_chunk: int, hvp_chunk: int
) -> None:
    """On CPU the default ``vmap`` / ``hvp`` chunk keeps a chunk's per-sample gradients of
    one tensor under 32 MiB (glibc maps larger allocations afresh on every call), and so
    does the larger chunk ``auto`` also times; the value is the one-sample loop's."""
    from multiscale_jac._memory import CPU_TENSOR_BYTES

    jobs = jacnorm_jobs(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh()
    )
    model = torch.nn.Sequential(*model, torch.nn.Linear(512, 2)).to(DTYPE)
    x = torch.randn(9, 3, dtype=DTYPE)
    with torch.no_grad():
        got = jacobian_sq_norm(model, x, params=[params], chunk_size=chunk_size, tune="estimate")
        ref = jacobian_sq_norm(model, x, params=[params], method="vmap", chunk_size=1)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-12)
    loop = mj.reference.per_sample_jacobian_loop(model, x, params=[params]).jacobian
    torch.testing.assert_close(got, (loop**2).sum(), atol=1e-10, rtol=1e-12)
    job = jobs[0]
    assert job.chunk_for(mj.JacNormMethod.VMAP) == vmap_chunk
    assert job.chunk_for(mj.JacNormMethod.HVP) == hvp_chunk
    per_sample = max(job.fn.params[n].numel() for n in job.mask) * 2 * 8  # rows x float64
    larger = job._larger(vmap_chunk, 400)
    assert larger == vmap_chunk if chunk_size else larger * per_sample < CPU_TENSOR_BYTES


def test_auto_with_a_budget_only_layerwise_fits(monkeypatch) -> None:
    """A ``memory_budget`` that ``vmap`` (and ``hvp``) cannot meet but ``layerwise`` can:
    ``auto`` runs layer-wise (noted) with no route left to time against, exact."""
    jobs = jacnorm_jobs(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Tanh(), torch.nn.Linear(64, 6))
    model = model.to(DTYPE)
    x = torch.randn(12, 3, dtype=DTYPE)
    budget = None
    for b in (2**k for k in range(12, 24)):
        try:
            jacobian_sq_norm(model, x, method="layerwise", memory_budget=b)
        except mj.MemoryBudgetError:
            continue
        with pytest.raises(mj.MemoryBudgetError):
            jacobian_sq_norm(model, x, method="vmap", memory_budget=b)
        budget = b
        break
    if budget is None:
        pytest.skip("no budget between layerwise's and vmap's working sets on this platform")
    got = jacobian_sq_norm(model, x, memory_budget=budget, tune="measure")
    assert jobs[-1].method is mj.JacNormMethod.LAYERWISE
    assert "memory_budget: 'vmap' does not fit it; ran 'layerwise'" in jobs[-1].notes
    ref = jacobian_sq_norm(model, x, method="hvp")
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-12)
    loop = mj.reference.per_sample_jacobian_loop(model, x).jacobian
    torch.testing.assert_close(got.detach(), (loop**2).sum(), atol=1e-10, rtol=1e-12)
