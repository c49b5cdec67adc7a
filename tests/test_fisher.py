"""diag_fisher against a per-sample loop with plain autograd (float64, 1e-10)."""

from __future__ import annotations

import pytest
import torch
from cases import DTYPE, make_subset
from conftest import CASE_BY_ID, zoo_model

import multiscale_jac as mj
from multiscale_jac.fisher import diag_fisher
from multiscale_jac.reference import per_sample_jacobian_loop

TOL = 1e-10


def samples_of(case_id: str) -> list:
    """The case's inputs as a list of samples (each a list of levels or one tensor)."""
    packed = mj.pack(CASE_BY_ID[case_id].inputs())
    return [list(packed.sample(i)) for i in range(packed.num_samples)], packed.kind


def as_model_input(sample: list, kind) -> object:
    batched = [t.unsqueeze(0) for t in sample]
    return batched[0] if kind is mj.InputKind.TENSOR else batched


def make_targets(outputs: list[torch.Tensor], likelihood: str, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    targets = []
    for out in outputs:
        if likelihood == "regression":
            targets.append(torch.randn(out.shape[1:], generator=g, dtype=DTYPE))
        elif out.dim() == 2:
            targets.append(torch.randint(out.shape[1], (), generator=g))
        else:
            y = torch.randint(out.shape[1], out.shape[2:], generator=g)
            y.view(-1)[0] = -100  # an ignored position
            targets.append(y)
    return targets


def nll(out, y, likelihood, sigma=1.0):
    if likelihood == "regression":
        return 0.5 * ((out[0] - y) ** 2).sum() / sigma**2
    logits = out[0].reshape(out.shape[1], -1)
    y = y.reshape(-1)
    keep = y != -100
    return torch.nn.functional.cross_entropy(logits.T[keep], y[keep], reduction="sum")


def loop_fisher(model, samples, kind_in, targets, subset, likelihood, kind):
    params = dict(model.named_parameters())
    names = subset.names
    total = torch.zeros(subset.numel, dtype=DTYPE)
    for x, y in zip(samples, targets):
        out = model(as_model_input(x, kind_in))
        if kind == "empirical":
            g = torch.autograd.grad(nll(out, y, likelihood), [params[n] for n in names])
            total += subset.flatten(dict(zip(names, g))) ** 2
            continue
        ref = per_sample_jacobian_loop(model, _one(x, kind_in), params=subset).jacobian[0]
        if likelihood == "regression":
            total += (ref**2).sum(0)
            continue
        c = out.shape[1]
        j = ref.view(c, -1, subset.numel)
        p = torch.softmax(out[0].reshape(c, -1), dim=0)
        yv = y.reshape(-1) if y.dim() else None
        for pos in range(j.shape[1]):
            if yv is not None and yv[pos] == -100:
                continue
            lam = torch.diag(p[:, pos]) - torch.outer(p[:, pos], p[:, pos])
            total += torch.einsum("cp,cd,dp->p", j[:, pos], lam, j[:, pos])
    return total / len(samples)


def _one(x, kind_in):
    if kind_in is mj.InputKind.TENSOR:
        return x[0].unsqueeze(0)
    return [t.unsqueeze(0) for t in x]


CASES = [
    ("mlp_vectors", "classification"),
    ("bn_cnn_multicrop", "classification"),
    ("dense_per_pixel", "classification"),
    ("seed_convblock_levels", "regression"),
    ("fpn_ragged", "regression"),
]


def batches(samples, targets, kind_in, size):
    """The data as an iterable of (inputs, targets) batches (ragged: lists of samples)."""
    out = []
    for s in range(0, len(samples), size):
        xs, ys = samples[s : s + size], targets[s : s + size]
        if kind_in is mj.InputKind.TENSOR:
            out.append((torch.stack([x[0] for x in xs]), torch.stack(ys)))
        else:
            out.append((xs, ys if ys[0].dim() else torch.stack(ys)))
    return out


@pytest.mark.parametrize("kind", ["empirical", "exact"])
@pytest.mark.parametrize("case_id, likelihood", CASES)
def test_diag_fisher_matches_loop(case_id: str, likelihood: str, kind: str) -> None:
    model = zoo_model(case_id)
    samples, kind_in = samples_of(case_id)
    outs = [model(as_model_input(x, kind_in)).detach() for x in samples]
    targets = make_targets(outs, likelihood)
    subset = make_subset(model, "elements", CASE_BY_ID[case_id])
    ref = loop_fisher(model, samples, kind_in, targets, subset, likelihood, kind)
    res = diag_fisher(
        model,
        batches(samples, targets, kind_in, 2),
        params=subset,
        likelihood=likelihood,
        kind=kind,
        progress=False,
    )
    assert res.num_samples == len(samples)
    torch.testing.assert_close(res.flat, ref, atol=TOL, rtol=0)
    assert set(res.as_dict()) == set(subset.names)


@pytest.mark.parametrize(
    "case_id, likelihood, kind, method",
    [
        # the fast tier: one method per case and kind, alternating; the slow tier the other
        pytest.param(c, lk, kind, method, marks=[pytest.mark.slow] * ((p + k + m) % 2))
        for p, (c, lk) in enumerate(CASES)
        for k, kind in enumerate(["empirical", "mc", "exact"])
        for m, method in enumerate(["auto", "vmap"])
    ],
)
def test_return_loss_is_the_nll_of_the_data(
    case_id: str, likelihood: str, kind: str, method: str
) -> None:
    """``return_loss=True``: the NLL of the data's own targets at ``sigma_noise``, whichever
    route ran (layer-wise passes, ``vmap``, per-sample Jacobians); outputs counted."""
    model = zoo_model(case_id)
    samples, kind_in = samples_of(case_id)
    outs = [model(as_model_input(x, kind_in)).detach() for x in samples]
    targets = make_targets(outs, likelihood)
    sigma = 0.5 if likelihood == "regression" else 1.0
    data = batches(samples, targets, kind_in, 2)
    kw = {"likelihood": likelihood, "kind": kind, "method": method, "sigma_noise": sigma}
    seeded = {"generator": torch.Generator().manual_seed(0)} if kind == "mc" else {}
    res = diag_fisher(model, data, return_loss=True, progress=False, **kw, **seeded)
    ref = sum(float(nll(o, y, likelihood, sigma)) for o, y in zip(outs, targets))
    assert res.loss == pytest.approx(ref, rel=1e-12)
    assert res.num_outputs == sum(o.numel() for o in outs)
    seeded = {"generator": torch.Generator().manual_seed(0)} if kind == "mc" else {}
    plain = diag_fisher(model, data, progress=False, **kw, **seeded)  # the same draws
    assert plain.loss is None and plain.num_outputs == res.num_outputs
    torch.testing.assert_close(plain.flat, res.flat, atol=0, rtol=0)


def test_return_loss_counts_a_timed_batch_once() -> None:
    """``tune=True`` times the routes on the first batch: the dropped runs add no loss."""
    mj.clear_plan_cache()
    model = zoo_model("mlp_vectors")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 5, generator=g, dtype=DTYPE), torch.randint(3, (20,), generator=g)
    data = [(x[:17], y[:17]), (x[17:], y[17:])]
    res = diag_fisher(model, data, return_loss=True, progress=False, tune=True)
    assert any(n.startswith("tune: timed") for n in res.notes), res.notes
    ref = torch.nn.functional.cross_entropy(model(x).detach(), y, reduction="sum")
    assert res.loss == pytest.approx(float(ref), rel=1e-12)


@pytest.mark.slow
def test_mc_is_seeded_and_unbiased() -> None:
    case_id = "mlp_vectors"
    model = zoo_model(case_id)
    samples, kind_in = samples_of(case_id)
    outs = [model(as_model_input(x, kind_in)).detach() for x in samples]
    targets = make_targets(outs, "classification")
    data = batches(samples, targets, kind_in, 5)

    def mc(seed: int, n: int) -> torch.Tensor:
        return diag_fisher(
            model,
            data,
            kind="mc",
            mc_samples=n,
            generator=torch.Generator().manual_seed(seed),
            progress=False,
        ).flat

    torch.testing.assert_close(mc(1, 3), mc(1, 3), atol=0, rtol=0)
    assert not torch.equal(mc(1, 3), mc(2, 3))
    exact = diag_fisher(model, data, kind="exact", progress=False).flat
    est = mc(0, 4000)
    # E_y[g g^T] = GGN for the categorical likelihood: within a few percent at 4000 draws
    assert torch.allclose(est, exact, rtol=0.1, atol=1e-3 * float(exact.max()))


def test_mean_of_squares_not_square_of_mean() -> None:
    model = zoo_model("mlp_vectors")
    x = torch.randn(6, 5, dtype=DTYPE)
    y = torch.randint(3, (6,))
    res = diag_fisher(model, [(x, y)], params="net.0.weight", progress=False)
    g = torch.autograd.grad(
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum"), model.net[0].weight
    )[0]
    square_of_mean = (g / 6) ** 2
    assert not torch.allclose(res.flat, square_of_mean.reshape(-1))


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"kind": "diag"}, ValueError, "kind"),
        ({"likelihood": "poisson"}, ValueError, "likelihood"),
        ({"mc_samples": 0}, ValueError, "mc_samples"),
        ({"sigma_noise": -1.0}, ValueError, "sigma_noise"),
        ({"generator": 3}, TypeError, "generator"),
        ({"return_loss": "yes"}, TypeError, "return_loss"),
    ],
)
def test_bad_arguments(kwargs, err, match) -> None:
    model = zoo_model("mlp_vectors")
    data = [(torch.randn(2, 5, dtype=DTYPE), torch.tensor([0, 1]))]
    with pytest.raises(err, match=match):
        diag_fisher(model, data, progress=False, **kwargs)


def test_bad_data() -> None:
    model = zoo_model("mlp_vectors")
    with pytest.raises(ValueError, match="no samples"):
        diag_fisher(model, [], progress=False)
    with pytest.raises(ValueError, match="leading batch dim of 2"):
        diag_fisher(
            model, [(torch.randn(2, 5, dtype=DTYPE), torch.tensor([0, 1, 2]))], progress=False
        )
    with pytest.raises(ValueError, match="pairs"):
        diag_fisher(model, [torch.randn(2, 5, dtype=DTYPE)], progress=False)


@pytest.mark.parametrize("kind", ["empirical", "exact"])
def test_train_mode_batch_norm_runs_with_running_statistics(kind: str) -> None:
    """batch_norm='eval' on a train-mode model equals the eval-mode model, for every kind."""
    import copy

    case_id = "bn_cnn_multicrop"
    model = zoo_model(case_id)
    samples, kind_in = samples_of(case_id)
    outs = [model(as_model_input(x, kind_in)).detach() for x in samples]
    data = batches(samples, make_targets(outs, "classification"), kind_in, 2)
    ref = diag_fisher(model, data, kind=kind, progress=False).flat
    train = copy.deepcopy(model).train()
    with pytest.raises(ValueError, match="BatchNorm"):
        diag_fisher(train, data, kind=kind, progress=False)
    got = diag_fisher(train, data, kind=kind, batch_norm="eval", progress=False).flat
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    ("chunk_size", "step"),
    [(None, 15), (24, 24)],
    ids=["capped_on_cpu", "chunk_size_given"],
)
def test_vmap_chunks_keep_per_sample_gradients_under_32_mib(
    monkeypatch, chunk_size: int | None, step: int
) -> None:
    """On CPU the ``vmap`` route's default call keeps one tensor's per-sample gradients under
    32 MiB (a 512x512 float64 weight, 2 MiB a sample: 15 samples, not 32); a given
    ``chunk_size`` is kept; the sums match the one-sample loop."""
    from multiscale_jac import fisher

    steps = []
    chunk = fisher._FisherRun._vmap_chunk

    def spy(self, fn, levels, y, noise, n):
        steps.append(n)
        return chunk(self, fn, levels, y, noise, n)

    monkeypatch.setattr(fisher._FisherRun, "_vmap_chunk", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh()
    )
    model = torch.nn.Sequential(*model, torch.nn.Linear(512, 4)).to(DTYPE)
    data = [(torch.randn(40, 3, dtype=DTYPE), torch.randint(0, 4, (40,)))]
    got = diag_fisher(model, data, method="vmap", chunk_size=chunk_size)
    assert set(steps) == {step}
    ref = diag_fisher(model, data, method="vmap", chunk_size=1)
    torch.testing.assert_close(got.flat, ref.flat, atol=TOL, rtol=0)
    (x, y), kind_in = data[0], mj.InputKind.TENSOR
    samples, targets = [[x[i]] for i in range(len(x))], list(y)
    loop = loop_fisher(
        model, samples, kind_in, targets, mj.ParamSubset.all(model), "classification", "empirical"
    )
    torch.testing.assert_close(got.flat, loop, atol=TOL, rtol=0)  # the plain autograd loop


@pytest.mark.parametrize(
    "tune, probes",
    [("measure", True), (True, True), ("auto", False), ("estimate", False), (False, False)],
)
def test_tune_decides_whether_the_fisher_measures(tune, probes: bool) -> None:
    """``tune``: ``measure``/``True`` times the routes on the first batch (here 6 samples),
    ``auto`` and ``estimate``/``False`` never; the values are the same either way."""
    from multiscale_jac._planning import COUNTS

    mj.clear_plan_cache()
    model = zoo_model("mlp_vectors")
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 5, generator=g, dtype=DTYPE), torch.randint(3, (6,), generator=g)
    before = COUNTS["probe"]
    res = diag_fisher(model, [(x, y)], tune=tune, progress=False)
    assert (COUNTS["probe"] > before) is probes
    assert any(n.startswith("tune: timed") for n in res.notes) is probes
    ref = diag_fisher(model, [(x, y)], method="layerwise", progress=False)
    torch.testing.assert_close(res.flat, ref.flat, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="unknown tune 'sometimes'"):
        diag_fisher(model, [(x, y)], tune="sometimes")
