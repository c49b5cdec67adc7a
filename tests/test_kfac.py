"""K-FAC factors (``multiscale_jac._kfac``) against a plain per-sample loop, on ragged
multi-level batches, shared heads and every conv flavour; bad inputs.

The reference (:func:`kfac_loop`) runs one unpadded sample at a time (a batch of one), takes
the output gradients of every call of every selected module from ``torch.autograd.grad``, one
objective at a time, and sums outer products position by position; the conv patches are read
index by index from the explicitly padded input and checked against the module's own output
before they are used.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from cases import ragged_samples
from conftest import CASE_BY_ID, smallest_budget, zoo_model
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import multiscale_jac as mj
from multiscale_jac._kfac import KronResult, kron_factors

DTYPE = torch.float64
TOL = 1e-10


# ---------------------------------------------------------------------- the reference
def _padded(m: nn.Module, x: Tensor) -> Tensor:
    """``x`` ``(C, *spatial)`` padded as the convolution pads it, from the definition of
    ``padding`` (``'same'``: ``dilation (k - 1)`` in all, the odd one on the right)."""
    d = x.dim() - 1
    pads = []
    for i in range(d):
        k, dil = m.kernel_size[i], m.dilation[i]
        if m.padding == "same":
            total = dil * (k - 1)
            pads.append((total // 2, total - total // 2))
        elif m.padding == "valid":
            pads.append((0, 0))
        else:
            pads.append((m.padding[i], m.padding[i]))
    flat = [p for pair in reversed(pads) for p in pair]
    mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
    return F.pad(x.unsqueeze(0), flat, mode=mode).squeeze(0)


def _conv_patches(m: nn.Module, x: Tensor, out: Tensor) -> list[Tensor]:
    """Per output position (row-major), the patch the weight reads, index by index, averaged
    over the channel groups; every group's patch is first checked against ``out``."""
    xp = _padded(m, x)
    d = x.dim() - 1
    sizes = out.shape[1:]
    cg, og = m.in_channels // m.groups, m.out_channels // m.groups
    patches = []
    for pos in itertools.product(*(range(s) for s in sizes)):
        per_group = []
        for gi in range(m.groups):
            vals = [
                xp[(gi * cg + c, *(pos[i] * m.stride[i] + k[i] * m.dilation[i] for i in range(d)))]
                for c in range(cg)
                for k in itertools.product(*(range(kk) for kk in m.kernel_size))
            ]
            patch = torch.stack(vals)
            rows = slice(gi * og, (gi + 1) * og)
            want = m.weight[rows].reshape(og, -1) @ patch
            if m.bias is not None:
                want = want + m.bias[rows]
            got = out[(rows, *pos)]
            assert (want - got).abs().max() < 1e-9, (
                "the reference patch does not reproduce the conv"
            )
            per_group.append(patch)
        patches.append(torch.stack(per_group).mean(0))
    return patches


def _positions(m: nn.Module, x: Tensor, out: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """Per position of one call on one sample (batch of one): input vectors and the slicers
    of the output gradient."""
    if isinstance(m, nn.Linear):
        rows = x.reshape(-1, x.shape[-1])
        return list(rows), [lambda g, r=r: g.reshape(-1, g.shape[-1])[r] for r in range(len(rows))]
    patches = _conv_patches(m, x[0], out[0])
    sizes = out.shape[2:]
    picks = [
        lambda g, pos=pos: g[(0, slice(None), *pos)]
        for pos in itertools.product(*(range(s) for s in sizes))
    ]
    return patches, picks


def _objectives(
    out: Tensor, y: Tensor, likelihood: str, kind: str, sigma: float, ignore: int, draw: Any
) -> list[tuple[Tensor, float]]:
    """One sample's objectives: ``ggn`` from a root of ``Lambda`` built explicitly (the
    symmetric root, not the library's), ``empirical`` the NLL at ``y``, ``mc`` the NLL at
    labels ``draw(out)`` gives."""
    if kind == "empirical" or kind == "mc":
        labels = [y] if kind == "empirical" else draw(out)
        w = 1.0 / len(labels)
        if likelihood == "regression":
            return [
                (0.5 * ((out.reshape(-1) - t.reshape(-1)) ** 2).sum() / sigma**2, w) for t in labels
            ]
        logits = out.reshape(1, out.shape[1], -1)
        return [
            (F.cross_entropy(logits, t.reshape(1, -1), reduction="sum", ignore_index=ignore), w)
            for t in labels
        ]
    if likelihood == "regression":
        flat = out.reshape(-1)
        return [(flat[o] / sigma, 1.0) for o in range(flat.numel())]
    logits = out.reshape(out.shape[1], -1)
    objs = []
    for j in range(logits.shape[1]):
        if int(y.reshape(-1)[j]) == ignore:
            continue
        p = torch.softmax(logits[:, j].detach(), 0)
        lam = torch.diag(p) - torch.outer(p, p)
        vals, vecs = torch.linalg.eigh(lam)
        root = vecs * vals.clamp(min=0).sqrt()
        objs += [((logits[:, j] * root[:, k]).sum(), 1.0) for k in range(root.shape[1])]
    return objs


def kfac_loop(
    model: nn.Module,
    samples: Sequence[Callable[[], Any]],
    targets: Sequence[Tensor],
    modules: Sequence[str],
    *,
    no_bias: Sequence[str] = (),
    likelihood: str = "classification",
    kind: str = "ggn",
    sigma: float = 1.0,
    ignore: int = -100,
    output_fn: Callable[[Any], Tensor] | None = None,
    draw: Any = None,
) -> dict[str, tuple[Tensor, Tensor]]:
    """``{module: (A, G)}``, each module its own layer with its bias row when it has a bias
    (unless named in ``no_bias``). ``samples[i]()`` runs the model on sample ``i`` as a batch of one and returns its output."""
    mods = {name: model.get_submodule(name) for name in modules}
    acc = {name: [0.0, 0.0] for name in modules}
    for run, y in zip(samples, targets):
        calls: list[tuple[str, Tensor, Tensor]] = []
        hooks = [
            m.register_forward_hook(
                lambda m, a, o, n=n, calls=calls: calls.append((n, a[0].detach(), o))
            )
            for n, m in mods.items()
        ]
        try:
            out = run()
        finally:
            for h in hooks:
                h.remove()
        out = output_fn(out) if output_fn is not None else out
        per_call = []
        for name, x, o in calls:
            m = mods[name]
            vecs, picks = _positions(m, x, o.detach())
            if m.bias is not None and name not in no_bias:
                vecs = [torch.cat([v, v.new_ones(1)]) for v in vecs]
            acc[name][0] = acc[name][0] + sum(torch.outer(v, v) for v in vecs) / len(vecs)
            per_call.append((name, o, picks))
        for obj, w in _objectives(out, y, likelihood, kind, sigma, ignore, draw):
            grads = torch.autograd.grad(obj, [o for _, o, _ in per_call], retain_graph=True)
            for (name, _, picks), g in zip(per_call, grads):
                acc[name][1] = acc[name][1] + w * sum(torch.outer(p(g), p(g)) for p in picks)
    n = len(samples)
    return {name: (a / n, g) for name, (a, g) in acc.items()}


def assert_matches(res: KronResult, ref: dict[str, tuple[Tensor, Tensor]]) -> None:
    assert len(res.layers) == len(ref)
    for name, (a, g) in ref.items():
        f = res[name]
        scale = max(1.0, float(a.abs().max()), float(g.abs().max()))
        assert f.A.shape == a.shape and f.G.shape == g.shape, name
        assert (f.A - a).abs().max() <= TOL * scale, (name, (f.A - a).abs().max())
        assert (f.G - g).abs().max() <= TOL * scale, (name, (f.G - g).abs().max())
        assert float(g.abs().max()) > 0


# ---------------------------------------------------------------------- tiny nets
class TokenMLP(nn.Module):
    """Linear layers on ``(n, T, in)`` tokens (weight sharing over T), mean-pooled logits."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x))).mean(1)


class ConvZoo2d(nn.Module):
    """Stride, grouped, asymmetric 'same' with dilation, reflect padding; pooled to logits."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=2)
        self.c2 = nn.Conv2d(4, 6, (2, 3), dilation=(1, 2), padding="same")
        self.c3 = nn.Conv2d(6, 3, 3, padding=1, padding_mode="reflect", bias=False)
        self.fc = nn.Linear(3, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.c2(torch.tanh(self.c1(x))))
        return self.fc(torch.tanh(self.c3(h)).mean((2, 3)))


class Conv1dZoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(2, 4, 4, padding="same", padding_mode="circular", groups=2)
        self.c2 = nn.Conv1d(4, 3, 3, stride=2, dilation=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.c2(torch.tanh(self.c1(x))).mean(2)


class Conv3dZoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(2, 4, 2, stride=(1, 2, 1), padding=1, groups=2)
        self.c2 = nn.Conv3d(4, 2, (1, 2, 2), padding="same")

    def forward(self, x: Tensor) -> Tensor:
        return self.c2(torch.tanh(self.c1(x))).amax(dim=(2, 3, 4))


class SharedHead(nn.Module):
    """Per-level lateral 1x1 convs, one head (conv, ReLU, conv) shared by every level, pooled
    per level and summed: the head is called once per level of the sample."""

    def __init__(self, channels: Sequence[int] = (2, 3), width: int = 3, classes: int = 3):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, width, 1) for c in channels)
        self.head = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, classes, 3, padding=1),
        )

    def forward(self, levels: Sequence[Tensor]) -> Tensor:
        return sum(self.head(lat(x)).mean((2, 3)) for lat, x in zip(self.lateral, levels))


class DenseNet(nn.Module):
    """Per-pixel outputs ``(n, K, H, W)`` whose size follows the input."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, k, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.c2(torch.tanh(self.c1(x)))


def _build(cls: type, *args: Any) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args).to(DTYPE).eval()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tensor_runs(model: nn.Module, x: Tensor) -> list[Callable[[], Any]]:
    return [lambda i=i: model(x[i : i + 1]) for i in range(len(x))]


def _level_runs(model: nn.Module, samples: list[list[Tensor]]) -> list[Callable[[], Any]]:
    return [lambda s=s: model([t.unsqueeze(0) for t in s]) for s in samples]


def _labels(n: int, classes: int, seed: int = 1, shape: tuple[int, ...] = ()) -> Tensor:
    return torch.randint(0, classes, (n, *shape), generator=_gen(seed))


# ---------------------------------------------------------------------- 1. against the loop
KINDS = ["ggn", "empirical"]


@pytest.mark.parametrize("kind", KINDS)
def test_mlp_classification_and_regression(kind: str) -> None:
    model = _build(nn.Sequential, nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x = torch.randn(7, 5, generator=_gen(0), dtype=DTYPE)
    y = _labels(7, 3)
    res = kron_factors(model, [(x[:3], y[:3]), (x[3:], y[3:])], kind=kind)
    assert_matches(res, kfac_loop(model, _tensor_runs(model, x), y, ["0", "2"], kind=kind))
    assert res.num_data == 7
    with torch.no_grad():
        want = float(F.cross_entropy(model(x), y, reduction="sum"))
    assert abs(float(res.loss) - want) < 1e-10
    yr = torch.randn(7, 3, generator=_gen(2), dtype=DTYPE)
    res = kron_factors(model, [(x, yr)], likelihood="regression", kind=kind, sigma_noise=0.7)
    ref = kfac_loop(
        model, _tensor_runs(model, x), yr, ["0", "2"], likelihood="regression", kind=kind, sigma=0.7
    )
    assert_matches(res, ref)
    with torch.no_grad():
        want = 0.5 * float(((model(x) - yr) ** 2).sum()) / 0.49
    assert abs(float(res.loss) - want) < 1e-10


@pytest.mark.parametrize("kind", KINDS)
def test_linear_weight_sharing_over_tokens(kind: str) -> None:
    model = _build(TokenMLP)
    x = torch.randn(5, 4, 3, generator=_gen(0), dtype=DTYPE)
    y = _labels(5, 3)
    res = kron_factors(model, [(x, y)], kind=kind)
    assert_matches(res, kfac_loop(model, _tensor_runs(model, x), y, ["a", "b"], kind=kind))


@pytest.mark.parametrize(
    ("cls", "shape"), [(ConvZoo2d, (4, 7, 6)), (Conv1dZoo, (2, 9)), (Conv3dZoo, (2, 3, 4, 3))]
)
@pytest.mark.parametrize("kind", KINDS)
def test_convolutions(cls: type, shape: tuple[int, ...], kind: str) -> None:
    model = _build(cls)
    x = torch.randn(3, *shape, generator=_gen(0), dtype=DTYPE)
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
    ]
    classes = model(x[:1]).shape[1]
    y = _labels(3, classes)
    res = kron_factors(model, [(x, y)], kind=kind)
    assert_matches(res, kfac_loop(model, _tensor_runs(model, x), y, names, kind=kind))


@pytest.mark.parametrize("kind", KINDS)
def test_shared_head_over_ragged_levels(kind: str) -> None:
    """The head runs on both levels of every sample; each sample has its own level sizes
    (two share theirs: a bucket of two)."""
    model = _build(SharedHead)
    sizes = [[(4, 5), (2, 3)], [(3, 3), (1, 2)], [(4, 5), (2, 3)], [(5, 2), (3, 1)]]
    samples = ragged_samples(sizes, [2, 3], seed=3)
    y = _labels(4, 3)
    names = ["lateral.0", "lateral.1", "head.0", "head.2"]
    res = kron_factors(model, [(samples[:3], y[:3]), (samples[3:], y[3:])], kind=kind)
    assert_matches(res, kfac_loop(model, _level_runs(model, samples), y, names, kind=kind))
    # the shared head's bias row: one per call, two calls per sample
    assert abs(float(res["head.0"].A[-1, -1]) - 2.0) < 1e-12
    assert abs(float(res["lateral.0"].A[-1, -1]) - 1.0) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_dense_outputs_with_ignored_positions(kind: str) -> None:
    model = _build(DenseNet)
    sizes = [[(3, 4)], [(2, 2)], [(3, 4)], [(2, 3)]]
    samples = [s[0] for s in ragged_samples(sizes, [2], seed=4)]
    labels = [torch.randint(0, 3, s.shape[1:], generator=_gen(i)) for i, s in enumerate(samples)]
    labels[0][0, 1] = labels[2][1, 2] = -1
    res = kron_factors(model, [(samples, labels)], kind=kind, ignore_index=-1)
    runs = [lambda s=s: model(s.unsqueeze(0)) for s in samples]
    assert_matches(res, kfac_loop(model, runs, labels, ["c1", "c2"], kind=kind, ignore=-1))
    targets = [
        torch.randn(3, *s.shape[1:], generator=_gen(9 + i), dtype=DTYPE)
        for i, s in enumerate(samples)
    ]
    res = kron_factors(model, [(samples, targets)], likelihood="regression", kind=kind)
    ref = kfac_loop(model, runs, targets, ["c1", "c2"], likelihood="regression", kind=kind)
    assert_matches(res, ref)


def _mc_draws(likelihood: str, draws: int, seed: int, sigma: float = 1.0) -> Any:
    """Labels as the library draws them for a chunk of one sample: ``draws`` uniforms per
    position (inverse CDF of the softmax) or standard normals per output entry."""
    g = _gen(seed)

    def draw(out: Tensor) -> list[Tensor]:
        out = out.detach()
        labels = []
        for _ in range(draws):
            if likelihood == "regression":
                labels.append(out + sigma * torch.randn(out.shape, generator=g, dtype=DTYPE))
                continue
            u = torch.rand((1, *out.shape[2:]), generator=g, dtype=DTYPE)
            cdf = torch.softmax(out, 1).cumsum(1)
            labels.append((cdf < u.unsqueeze(1)).sum(1).clamp(max=out.shape[1] - 1))
        return labels

    return draw


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_mc_with_the_same_draws(likelihood: str) -> None:
    model = _build(ConvZoo2d)
    x = torch.randn(3, 4, 6, 5, generator=_gen(0), dtype=DTYPE)
    y = _labels(3, 3) if likelihood == "classification" else torch.randn(3, 3, dtype=DTYPE)
    res = kron_factors(
        model,
        [(x, y)],
        likelihood=likelihood,
        kind="mc",
        mc_samples=2,
        chunk_size=1,
        sigma_noise=1.3,
        generator=_gen(5),
    )
    draw = _mc_draws(likelihood, 2, 5, sigma=1.3)
    names = ["c1", "c2", "c3", "fc"]
    ref = kfac_loop(
        model,
        _tensor_runs(model, x),
        y,
        names,
        likelihood=likelihood,
        kind="mc",
        sigma=1.3,
        draw=draw,
    )
    assert_matches(res, ref)


@pytest.mark.parametrize(
    "case_id",
    [
        "fpn_ragged",
        "conv1d",
        "conv3d",
        "shared_dict_head",
        "seed_convblock_ragged",
        "dense_per_pixel",
        "transformer_tokens",
        "mlp_vectors",
    ],
)
def test_zoo_regression_ggn(case_id: str) -> None:
    """The zoo's models as they are (TinyFPN's head shared by the pyramid levels, the token
    transformer's qkv, ragged outputs): the Gaussian GGN of the case's tensors."""
    case = CASE_BY_ID[case_id]
    model = zoo_model(case_id)
    subset = mj.ParamSubset.from_names(model, case.glob)
    modules = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in subset.names))
    output_fn = case.output_fn
    if case_id == "shared_dict_head":
        output_fn = lambda d: torch.cat(list(d.values()), 1)  # noqa: E731
    if case_id == "transformer_tokens":
        output_fn = lambda d: d["class"]  # noqa: E731
    inputs = case.inputs()
    packed = inputs if isinstance(inputs, mj.PackedBatch) else mj.pack(inputs)
    fn = mj.PerSampleFunction(
        model, subset, packed.structure, output_fn, tokens=packed.layout is mj.Layout.NESTED
    )
    runs = [
        lambda i=i: fn.call_batch([t.unsqueeze(0) for t in packed.sample(i)])
        for i in range(len(packed))
    ]
    targets = [
        torch.randn(r().shape[1:], generator=_gen(i), dtype=DTYPE) for i, r in enumerate(runs)
    ]
    res = kron_factors(
        model, [(packed, targets)], params=subset, likelihood="regression", output_fn=output_fn
    )
    no_bias = [m for m in modules if f"{m}.bias" not in subset.names]
    ref = kfac_loop(model, runs, targets, modules, likelihood="regression", no_bias=no_bias)
    assert_matches(res, ref)


# ---------------------------------------------------------------------- 2. ragged property
class LevelsNet(nn.Module):
    """``levels`` lateral 1x1 convs, a strided 3x3 head shared by every level, a classifier."""

    def __init__(self, levels: int, stride: int) -> None:
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(2, 3, 1) for _ in range(levels))
        self.head = nn.Conv2d(3, 3, 3, stride=stride, padding=1)
        self.fc = nn.Linear(3, 3)

    def forward(self, levels: Sequence[Tensor]) -> Tensor:
        pooled = [
            torch.tanh(self.head(lat(x))).mean((2, 3)) for lat, x in zip(self.lateral, levels)
        ]
        return self.fc(torch.stack(pooled).sum(0))


@st.composite
def _ragged_batches(draw: Any) -> tuple[int, int, list[list[tuple[int, int]]], list[int], str]:
    levels = draw(st.integers(1, 3))
    n = draw(st.sampled_from([1, 3, 5]))
    side = st.integers(1, 5)
    shapes = [[(draw(side), draw(side)) for _ in range(levels)] for _ in range(n)]
    if n > 1 and draw(st.booleans()):
        shapes[-1] = shapes[0]  # a bucket of two
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
    return levels, draw(st.sampled_from([1, 2])), shapes, cuts, draw(st.sampled_from(KINDS))


@given(_ragged_batches())
def test_ragged_batch_equals_its_samples_one_at_a_time(spec: Any) -> None:
    """K-FAC of a ragged multi-level batch (in any split into batches) is the K-FAC of its
    samples run alone, unpadded: ``A`` their mean, ``G`` their sum."""
    levels, stride, shapes, cuts, kind = spec
    model = _build(LevelsNet, levels, stride)
    samples = ragged_samples(shapes, [2] * levels, seed=len(shapes))
    y = _labels(len(samples), 3)
    bounds = [0, *cuts, len(samples)]
    data = [(samples[a:b], y[a:b]) for a, b in itertools.pairwise(bounds)]
    res = kron_factors(model, data, kind=kind)
    alone = [kron_factors(model, [([s], y[i : i + 1])], kind=kind) for i, s in enumerate(samples)]
    for f in res.layers:
        a = sum(r[f.weight].A for r in alone) / len(alone)
        g = sum(r[f.weight].G for r in alone)
        assert (f.A - a).abs().max() <= TOL and (f.G - g).abs().max() <= TOL * max(
            1.0, float(g.abs().max())
        )
    assert abs(float(res.loss) - sum(float(r.loss) for r in alone)) < 1e-10
    assert res.num_data == len(samples)


# ---------------------------------------------------------------------- 3. more properties
def test_chunks_and_memory_budgets_give_the_same_factors() -> None:
    model = _build(SharedHead)
    samples = ragged_samples([[(4, 4), (2, 2)]] * 5 + [[(3, 5), (2, 2)]] * 2, [2, 3], seed=2)
    y = _labels(7, 3)
    ref = kron_factors(model, [(samples, y)])
    for kwargs in ({"chunk_size": 1}, {"chunk_size": 2}, {"memory_budget": 2**20}):
        res = kron_factors(model, [(samples, y)], **kwargs)
        for f, r in zip(res.layers, ref.layers):
            assert (f.A - r.A).abs().max() < 1e-12 and (f.G - r.G).abs().max() < 1e-12
    with pytest.raises(mj.MemoryBudgetError, match=r"memory_budget=100 bytes"):
        kron_factors(model, [(samples, y)], memory_budget=100)
    least = smallest_budget(lambda b: kron_factors(model, [(samples, y)], memory_budget=b))
    res = kron_factors(model, [(samples, y)], memory_budget=least)  # runs, one sample a chunk
    for f, r in zip(res.layers, ref.layers):
        assert (f.A - r.A).abs().max() < 1e-12 and (f.G - r.G).abs().max() < 1e-12


def test_inplace_activation_after_a_layer() -> None:
    """``ReLU(inplace=True)`` overwrites the conv's output: the gradient is still the one at
    the conv's output (the same as without the in-place op)."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 3)]
    plain = nn.Sequential(*layers).to(DTYPE)
    inplace = nn.Sequential(layers[0], nn.ReLU(inplace=True), *layers[2:]).to(DTYPE)
    x = torch.randn(4, 2, 4, 4, generator=_gen(0), dtype=DTYPE)
    y = _labels(4, 3)
    a, b = kron_factors(plain, [(x, y)]), kron_factors(inplace, [(x, y)])
    for f, r in zip(a.layers, b.layers):
        assert (f.A - r.A).abs().max() < 1e-14 and (f.G - r.G).abs().max() < 1e-14


def test_tied_weight_is_one_layer_over_both_modules() -> None:
    """``b.weight is a.weight``: the weight's factors count both modules' calls; each bias
    keeps its own module's."""
    model = zoo_model("tied_weights")
    x = torch.randn(5, 4, generator=_gen(0), dtype=DTYPE)
    y = torch.randn(5, 4, generator=_gen(1), dtype=DTYPE)
    res = kron_factors(model, [(x, y)], likelihood="regression")
    assert [f.names for f in res.layers] == [("a.weight",), ("a.bias",), ("b.bias",)]
    assert res["a.weight"].modules == ("a", "b")
    ref = kfac_loop(
        model, _tensor_runs(model, x), y, ["a", "b"], likelihood="regression", no_bias=["a", "b"]
    )
    w = res["a.weight"]
    assert (w.A - (ref["a"][0] + ref["b"][0])).abs().max() < TOL
    assert (w.G - (ref["a"][1] + ref["b"][1])).abs().max() < TOL
    assert (res["a.bias"].G - ref["a"][1]).abs().max() < TOL
    assert float(res["b.bias"].A) == 1.0


def test_dense_and_laplace_layouts() -> None:
    model = _build(nn.Sequential, nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1, bias=False))
    x = torch.randn(4, 3, generator=_gen(0), dtype=DTYPE)
    y = torch.randn(4, 1, generator=_gen(1), dtype=DTYPE)
    res = kron_factors(model, [(x, y)], likelihood="regression")
    f = res["0.weight"]
    dense = f.dense()
    assert dense.shape == (8, 8)
    # the weight block is G (x) A_w, the bias block A[-1, -1] G, the cross block G (x) A[:-1, -1]
    assert torch.allclose(dense[:6, :6], torch.kron(f.G, f.weight_A))
    assert torch.allclose(dense[6:, 6:], f.G * f.A[-1, -1])
    assert torch.allclose(dense[:6, 6:], torch.kron(f.G, f.A[:-1, -1:]))
    kfacs = res.laplace_torch_kfacs()
    assert [len(k) for k in kfacs] == [2, 1, 2]  # weight, bias, a 1 x 2 weight alone
    assert torch.allclose(kfacs[0][0], math.sqrt(2) * f.G) and torch.allclose(
        kfacs[0][1], f.weight_A / math.sqrt(2)
    )
    assert torch.allclose(kfacs[1][0], f.G)
    assert kfacs[2][0].shape == (1, 1) and kfacs[2][1].shape == (2, 2)
    one = kron_factors(_build(nn.Linear, 1, 1, False), [(x[:, :1], y)], likelihood="regression")
    assert [k[0].shape for k in one.laplace_torch_kfacs()] == [(1, 1)]  # [G * A], as curvlinops
    with pytest.raises(KeyError, match=r"no layer holds"):
        res["nope"]


@pytest.mark.slow
def test_mc_converges_to_the_ggn() -> None:
    model = _build(nn.Sequential, nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))
    x = torch.randn(6, 3, generator=_gen(0), dtype=DTYPE)
    y = _labels(6, 3)
    ggn = kron_factors(model, [(x, y)])
    mc = kron_factors(model, [(x, y)], kind="mc", mc_samples=4000, generator=_gen(3))
    for f, r in zip(mc.layers, ggn.layers):
        assert (f.A - r.A).abs().max() < 1e-14
        assert (f.G - r.G).abs().max() < 0.05 * float(r.G.abs().max())


# ---------------------------------------------------------------------- 4. bad inputs
def _mlp_data() -> tuple[nn.Module, list[tuple[Tensor, Tensor]]]:
    model = _build(nn.Sequential, nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, [(torch.randn(3, 3, dtype=DTYPE), torch.tensor([0, 1, 1]))]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"kind": "exact"},
            ValueError,
            "kind must be one of 'ggn', 'mc', 'empirical'; got 'exact'.*kind='ggn'",
        ),
        ({"kind": 3}, ValueError, "got 3"),
        ({"likelihood": "poisson"}, ValueError, "poisson"),
        ({"mc_samples": 0, "kind": "mc"}, ValueError, "mc_samples"),
        ({"mc_samples": 2.0, "kind": "mc"}, TypeError, "mc_samples"),
        ({"mc_samples": 3}, ValueError, "mc_samples=3 applies to kind='mc' only"),
        ({"sigma_noise": -1.0}, ValueError, "sigma_noise"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"memory_budget": "1GB"}, TypeError, "memory_budget"),
        ({"generator": 3}, TypeError, "generator"),
        ({"randomness": "same"}, ValueError, "randomness='same'"),
        ({"params": ["0.weight[0]"]}, ValueError, "0.weight"),
        (
            {"params": mj.ParamSubset.from_indices(_mlp_data()[0], {"0.weight": [0, 1]})},
            ValueError,
            "whole tensors, but '0.weight' has 2 of its 12",
        ),
        ({"progress": 1}, TypeError, "progress"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    model, data = _mlp_data()
    with pytest.raises(error, match=match):
        kron_factors(model, data, **kwargs)


def test_bad_data() -> None:
    model, data = _mlp_data()
    with pytest.raises(ValueError, match=r"data yielded no samples"):
        kron_factors(model, [])
    with pytest.raises(TypeError, match=r"iterable of \(inputs, targets\) pairs; got int"):
        kron_factors(model, 3)
    with pytest.raises(ValueError, match=r"\(inputs, targets\) pairs; got a Tensor"):
        kron_factors(model, data[0][0])
    with pytest.raises(ValueError, match=r"label 5 .*out of range for 2 classes"):
        kron_factors(model, [(data[0][0], torch.tensor([0, 5, 1]))])
    with pytest.raises(TypeError, match=r"integer class indices"):
        kron_factors(model, [(data[0][0], torch.zeros(3))])
    with pytest.raises(ValueError, match=r"regression target has 1 entries, the output 2"):
        kron_factors(model, [(data[0][0], torch.zeros(3, 1))], likelihood="regression")
    with pytest.raises(ValueError, match=r"hold nan in sample 1"):
        x = data[0][0].clone()
        x[1, 0] = math.nan
        kron_factors(model, [(x, data[0][1])])


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.ln = nn.LayerNorm(4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.ln(self.fc(x)))


class _Outside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(self.fc(x)), self.fc.weight)


class _MyLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 2


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.spare = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


class _Mixing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x - x.mean(0))


class _DeviceRead(nn.Module):
    """Reads a parameter's metadata only (``next(self.parameters()).device``), as Hugging
    Face style models do: not a use of its values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        p = next(self.parameters())
        assert p.dim() == 2 and p.size(0) == 2
        return self.fc(x.to(device=p.device, dtype=p.dtype))


class _PlainFc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


def test_a_parameters_metadata_read_is_not_a_use() -> None:
    x, y = torch.randn(3, 3, dtype=DTYPE), torch.tensor([0, 1, 1])
    got = kron_factors(_build(_DeviceRead), [(x, y)])
    ref = kron_factors(_build(_PlainFc), [(x, y)])  # the same weights, no metadata read
    torch.testing.assert_close(got["fc.weight"].A, ref["fc.weight"].A, atol=0, rtol=0)
    torch.testing.assert_close(got["fc.weight"].G, ref["fc.weight"].G, atol=0, rtol=0)


def test_parameters_without_kronecker_factors_are_refused() -> None:
    x, y = torch.randn(3, 3, dtype=DTYPE), torch.tensor([0, 1, 1])
    with pytest.raises(
        ValueError, match=r"'ln.weight' belongs to module 'ln' \(LayerNorm\), not a Linear"
    ):
        kron_factors(_build(_Norm), [(x, y)])
    res = kron_factors(_build(_Norm), [(x, y)], params=["fc.*", "out.*"])
    assert [f.modules for f in res.layers] == [("fc",), ("out",)]
    emb = _build(nn.Sequential, nn.Embedding(5, 3), nn.Flatten(), nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"'0.weight' belongs to module '0' \(Embedding\)"):
        kron_factors(emb, [(torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 1]))])
    res = kron_factors(emb, [(torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 1]))], params="2.*")
    assert res["2.weight"].A.shape == (7, 7)
    with pytest.raises(ValueError, match=r"'fc.weight' are also read outside"):
        kron_factors(_build(_Outside), [(x, y)], params="fc.weight")
    with pytest.raises(ValueError, match=r"overrides Linear.forward"):
        kron_factors(_build(_MyLinear, 3, 2), [(x, y)])
    with pytest.raises(ValueError, match=r"'spare' were never called"):
        kron_factors(_build(_Unused), [(x, y)])
    with pytest.raises(ValueError, match=r"mixes samples in a batch"):
        kron_factors(_build(_Mixing), [(x, y)])


def test_batch_norm_policy_and_the_model_left_as_found() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2)
    ).to(DTYPE)
    model[1].running_mean.uniform_(-0.5, 0.5)
    x, y = torch.randn(3, 2, 4, 4, dtype=DTYPE), torch.tensor([0, 1, 1])
    params = ["0.*", "4.*"]
    with pytest.raises(ValueError, match=r"in train mode"):
        kron_factors(model, [(x, y)], params=params)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = kron_factors(model, [(x, y)], params=params, batch_norm="eval")
    assert model.training and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    ref = kron_factors(model.eval(), [(x, y)], params=params)
    for f, r in zip(res.layers, ref.layers):
        assert (f.A - r.A).abs().max() < 1e-14 and (f.G - r.G).abs().max() < 1e-14


def test_dropout_in_train_mode() -> None:
    model = _build(nn.Sequential, nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).train()
    x, y = torch.randn(4, 3, dtype=DTYPE), torch.tensor([0, 1, 1, 0])
    with pytest.raises(ValueError, match=r"randomness"):
        kron_factors(model, [(x, y)])
    res = kron_factors(model, [(x, y)], randomness="different")
    assert res.layers[1].A.shape == (5, 5)


# ---------------------------------------------------------------------- curvlinops (optional)
def _curvlinops_factors(model: nn.Module, data: list, loss: nn.Module, fisher_type: str) -> Any:
    curvlinops = pytest.importorskip("curvlinops")
    op = curvlinops.KFACLinearOperator(
        model,
        loss,
        [p for p in model.parameters()],
        data,
        fisher_type=fisher_type,
        check_deterministic=False,
        separate_weight_and_bias=False,
    )
    op.compute_kronecker_factors()
    return op


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize(("kind", "fisher_type"), [("ggn", "type-2"), ("empirical", "empirical")])
def test_against_curvlinops_kfac(likelihood: str, kind: str, fisher_type: str) -> None:
    """curvlinops' KFACLinearOperator (expand, sum reduction, weight and bias joint) on a conv
    net with stride, groups, dilation and a head shared by two resolutions, over two batches.
    Its MSELoss(sum) is twice the Gaussian NLL at sigma = 1: its G is 2x (ggn) or 4x
    (empirical) ours."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2)
            self.c2 = nn.Conv2d(4, 4, 3, dilation=2, padding=2)
            self.fc = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.relu(self.c1(x))
            pooled = self.c2(h).mean((2, 3)) + self.c2(h[:, :, ::2, ::2]).mean((2, 3))
            return self.fc(pooled)

    model = _build(Shared)
    x = torch.randn(6, 2, 8, 8, generator=_gen(0), dtype=DTYPE)
    if likelihood == "classification":
        y, loss, g_scale = _labels(6, 3), nn.CrossEntropyLoss(reduction="sum"), 1.0
    else:
        y, loss = torch.randn(6, 3, generator=_gen(1), dtype=DTYPE), nn.MSELoss(reduction="sum")
        g_scale = 2.0 if kind == "ggn" else 4.0
    data = [(x[:4], y[:4]), (x[4:], y[4:])]
    ops = _curvlinops_factors(model, [(x, y)], loss, fisher_type)
    res = kron_factors(model, data, likelihood=likelihood, kind=kind)
    for f in res.layers:
        name = f.modules[0]
        assert (f.A - ops._input_covariances[name]).abs().max() < 1e-12
        assert (g_scale * f.G - ops._gradient_covariances[name]).abs().max() < 1e-12


def test_map_levels_canvas_runs_as_the_per_level_loop() -> None:
    """A head run through ``map_levels`` on a canvas (the default on CUDA) counts each level's
    call with its own positions, as the list comprehension does."""
    torch.manual_seed(0)
    canvas = mj.models.SharedHeadFPN((2, 2), width=4, num_outputs=2, depth=1, packing="canvas")
    canvas = canvas.to(DTYPE).eval()
    loop = mj.models.SharedHeadFPN((2, 2), width=4, num_outputs=2, depth=1, packing="loop")
    loop = loop.to(DTYPE).eval()
    loop.load_state_dict(canvas.state_dict())
    samples = ragged_samples([[(6, 6), (3, 3)], [(5, 7), (3, 4)], [(6, 6), (3, 3)]], [2, 2], seed=1)
    targets = [
        torch.randn(loop([t.unsqueeze(0) for t in s]).shape[1:], dtype=DTYPE) for s in samples
    ]
    params = ["lateral.*", "head.0.*", "head.3.*"]
    a = kron_factors(canvas, [(samples, targets)], params=params, likelihood="regression")
    b = kron_factors(loop, [(samples, targets)], params=params, likelihood="regression")
    for f, r in zip(a.layers, b.layers):
        assert (f.A - r.A).abs().max() < 1e-12 and (f.G - r.G).abs().max() < 1e-12
