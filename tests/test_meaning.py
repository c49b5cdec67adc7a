"""The user's meaning wins: each input gets the answer the user meant or a clear refusal.

One test per finding (column order, dropout, targets, ambiguous lists, mappings, batch
statistics, messages, integer inputs, the model never changed, equal-length sequences), each
against a plain-autograd loop in float64.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

import multiscale_jac as mj
from multiscale_jac.models import ConvBlock

D = torch.float64


def full_jacobian(model: nn.Module, samples: list, call=None) -> torch.Tensor | list:
    """``(N, O, P_all)``: rows of every sample by plain autograd w.r.t. all parameters, in
    ``parameters_to_vector`` order (a list of ``(O_i, P_all)`` when the ``O_i`` differ);
    ``call(model, sample)`` gives the sample's flat output."""
    call = call or (lambda m, s: m(s).reshape(-1))
    params = list(model.parameters())
    rows = []
    for s in samples:
        out = call(model, s)
        rows.append(
            torch.stack(
                [
                    parameters_to_vector(
                        [
                            g if g is not None else torch.zeros_like(p)
                            for g, p in zip(
                                torch.autograd.grad(
                                    o, params, retain_graph=True, allow_unused=True
                                ),
                                params,
                            )
                        ]
                    )
                    for o in out
                ]
            )
        )
    return torch.stack(rows) if len({r.shape for r in rows}) == 1 else rows


# ---------------------------------------------------------------------- 1. column order
@pytest.mark.parametrize("mode", ["rev", "fwd"])
@pytest.mark.parametrize("entries", ["structured", "generic"])
@pytest.mark.parametrize("strategy", ["auto", "bucketed", "padded", "loop"])
def test_columns_follow_the_order_given(mode: str, entries: str, strategy: str) -> None:
    torch.manual_seed(0)
    model = ConvBlock(in_ch=2, out_ch=8).to(D).eval()
    levels = [torch.randn(2, 2, 8, 8, dtype=D), torch.randn(2, 2, 7, 9, dtype=D)]
    total = sum(p.numel() for p in model.parameters())
    idx = torch.randperm(total, generator=torch.Generator().manual_seed(1))[:40]
    subset = mj.ParamSubset.from_flat_indices(model, idx)
    res = mj.per_sample_jacobian(
        model, levels, params=subset, mode=mode, entries=entries, strategy=strategy
    )
    ref = full_jacobian(model, [[lv[i : i + 1] for lv in levels] for i in range(2)])
    torch.testing.assert_close(res.jacobian, ref[..., idx], atol=1e-10, rtol=0)
    # per tensor, entries in the order given; tensors in the order named
    picks = {"conv.2.weight": [7, 3, 100, 0], "conv.0.bias": [1, 0]}
    sub = mj.ParamSubset.from_indices(model, picks)
    res = mj.per_sample_jacobian(
        model, levels, params=sub, mode=mode, entries=entries, strategy=strategy
    )
    torch.testing.assert_close(res.jacobian, ref[..., sub.flat_indices()], atol=1e-10, rtol=0)
    starts = dict(zip([n for n, _ in model.named_parameters()], _starts(model)))
    for name, block in res.as_dict().items():
        cols = [starts[name] + k for k in picks[name]]
        torch.testing.assert_close(block, ref[..., cols], atol=1e-10, rtol=0)


def _starts(model: nn.Module) -> list[int]:
    sizes = [p.numel() for p in model.parameters()]
    return [sum(sizes[:k]) for k in range(len(sizes))]


# ---------------------------------------------------------------------- 2. dropout
class DropNet(nn.Module):
    """Linear, tanh, Dropout(0.5) over 3 hidden units, Linear: 8 possible masks."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.drop, self.l2 = nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(torch.tanh(self.l1(x))))

    def with_mask(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)) * mask * 2.0)


MASKS = [torch.tensor(m, dtype=D) for m in itertools.product([0.0, 1.0], repeat=3)]


def _drop_net() -> DropNet:
    torch.manual_seed(0)
    return DropNet().to(D).train()


def _per_mask(model: DropNet, x: torch.Tensor, fn) -> list[torch.Tensor]:
    """``fn(out)`` differentiated w.r.t. all parameters for each of the 8 masks: ``(O, P)``."""
    return [
        full_jacobian(model, [x], lambda m, s, mask=mask: fn(m.with_mask(s, mask)).reshape(-1))[0]
        for mask in MASKS
    ]


def _which(value: torch.Tensor, candidates: list[torch.Tensor]) -> int:
    hits = [k for k, c in enumerate(candidates) if torch.allclose(value, c, atol=1e-10, rtol=0)]
    assert hits, "the result is none of the per-mask values"
    return hits[0]


def test_dropout_randomness_same_and_different_per_sample_jacobian() -> None:
    model = _drop_net()
    x = torch.randn(1, 3, dtype=D)
    per_mask = _per_mask(model, x, lambda out: out)
    batch = x.expand(24, 3).clone()
    same = mj.per_sample_jacobian(model, batch, randomness="same").jacobian
    assert len({_which(j, per_mask) for j in same}) == 1  # one mask for the whole call
    torch.manual_seed(1)
    diff = mj.per_sample_jacobian(model, batch, randomness="different").jacobian
    assert len({_which(j, per_mask) for j in diff}) > 1  # each sample its own mask
    assert model.training  # the model is left as it was


def test_ewc_with_dropout_in_train_mode() -> None:
    """The EWC use case as written: model.train() with Dropout, empirical Fisher over a
    loader. With randomness='different' every sample draws its own mask: the result is the
    mean of the samples' per-mask squared gradients, and over many samples the expectation
    over the 8 equally likely masks."""
    model = _drop_net()
    x = torch.randn(1, 3, dtype=D)
    y = torch.tensor([1])
    per_mask = _per_mask(model, x, lambda out: F.cross_entropy(out, y, reduction="sum"))
    squares = torch.stack([g[0] ** 2 for g in per_mask])  # (8, P)
    with pytest.raises(ValueError, match="randomness='different'"):
        mj.diag_fisher(model, [(x, y)])
    for method in ("layerwise", "vmap"):
        torch.manual_seed(0)
        three = mj.diag_fisher(
            model, [(x.expand(3, 3).clone(), y.expand(3))], randomness="different", method=method
        ).flat
        means = [
            squares[list(c)].mean(0) for c in itertools.combinations_with_replacement(range(8), 3)
        ]
        assert any(torch.allclose(three, m, atol=1e-12, rtol=0) for m in means)
        loader = [(x.expand(200, 3).clone(), y.expand(200).clone()) for _ in range(4)]
        many = mj.diag_fisher(model, loader, randomness="different", method=method).flat
        expected, spread = squares.mean(0), squares.std(0, correction=0)
        assert torch.all((many - expected).abs() <= 5 * spread / 800**0.5 + 1e-12)


def test_dropout_sq_norm_value_and_gradient_see_one_mask() -> None:
    model = _drop_net()
    x = torch.randn(1, 3, dtype=D)
    per_mask = _per_mask(model, x, lambda out: out)
    values = [(j**2).sum() for j in per_mask]
    grads = []
    for mask in MASKS:
        params = list(model.parameters())
        out = model.with_mask(x, mask).reshape(-1)
        rows = [torch.autograd.grad(o, params, create_graph=True) for o in out]
        s = sum((torch.cat([g.reshape(-1) for g in r]) ** 2).sum() for r in rows)
        got = torch.autograd.grad(s, params, allow_unused=True)
        grads.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(got, params)]
            )
        )
    for seed in range(4):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        s = mj.jacobian_sq_norm(model, x, randomness="different")
        s.backward()  # recomputes with the forward's masks
        k = _which(s.detach(), values)
        got = torch.cat(
            [
                (torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                for p in model.parameters()
            ]
        )
        torch.testing.assert_close(got, grads[k], atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match=r"hvp.*deterministic"):
        mj.jacobian_sq_norm(model, x, randomness="different", method="hvp")


def test_dropout_laplace_outputs_and_jacobians_from_one_pass() -> None:
    model = _drop_net()
    x = torch.randn(1, 3, dtype=D)
    y = torch.tensor([0])
    per_mask = _per_mask(model, x, lambda out: out)
    outs = [model.with_mask(x, m).detach()[0] for m in MASKS]
    ggns = []
    for out, j in zip(outs, per_mask):
        p = torch.softmax(out, 0)
        ggns.append(j.T @ (torch.diag(p) - torch.outer(p, p)) @ j)
    subset = mj.ParamSubset.all(model)
    for seed in range(3):
        torch.manual_seed(seed)
        la = mj.SubnetLaplace(model, "classification", subset, randomness="different")
        _which(la.fit([(x, y)]).H, ggns)
    selected = mj.largest_variance(model, [(x, y)], 3, randomness="different")
    assert selected.numel == 3


# ---------------------------------------------------------------------- 3. targets
def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(D).eval()


TARGET_CASES = [
    (torch.tensor([0.7, 1.2, 2.0]), TypeError, r"targets\[0\].*integer class indices.*float"),
    (torch.tensor([0, 7, 1]), ValueError, r"targets\[1\]: label 7 is out of range for 3 classes"),
    (torch.randn(3), TypeError, "integer class indices"),
    (torch.tensor([0, -1, 1]), ValueError, r"label -1 is out of range"),
    (torch.tensor([[0, 1], [1, 1], [2, 0]]), ValueError, "2 positions, the logits 1"),
]


@pytest.mark.parametrize("target, err, match", TARGET_CASES)
@pytest.mark.parametrize("entry", ["diag_fisher", "SubnetLaplace", "largest_variance"])
def test_classification_targets_are_checked(entry: str, target, err, match) -> None:
    model = _classifier()
    data = [(torch.randn(3, 4, dtype=D), target)]
    call = {
        "diag_fisher": lambda: mj.diag_fisher(model, data),
        "SubnetLaplace": lambda: mj.SubnetLaplace(model, "classification", "2.*").fit(data),
        "largest_variance": lambda: mj.largest_variance(model, data, 2),
    }[entry]
    with pytest.raises(err, match=match):
        call()


def test_dense_targets_name_the_position() -> None:
    torch.manual_seed(0)
    model = nn.Conv2d(2, 3, 1).to(D)
    y = torch.zeros(2, 4, 4, dtype=torch.long)
    y[1, 2, 3] = 5
    with pytest.raises(ValueError, match=r"targets\[1\]: label 5 at position 11"):
        mj.diag_fisher(model, [(torch.randn(2, 2, 4, 4, dtype=D), y)])
    y[1, 2, 3] = -100  # ignore_index is fine
    mj.diag_fisher(model, [(torch.randn(2, 2, 4, 4, dtype=D), y)])
    with pytest.raises(ValueError, match="regression target has nan at entry 0"):
        bad = torch.full((2, 3, 4, 4), float("nan"), dtype=D)
        mj.diag_fisher(model, [(torch.randn(2, 2, 4, 4, dtype=D), bad)], likelihood="regression")


# ---------------------------------------------------------------------- 4 and 10. lists
class SegNet(nn.Module):
    """A segmentation net that takes one tensor (B, 3, H, W)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"SegNet takes a tensor; got {type(x).__name__}")
        return self.body(x)


def test_ragged_single_images_into_a_tensor_model() -> None:
    torch.manual_seed(0)
    model = SegNet().to(D).eval()
    images = [torch.randn(3, 6, 6, dtype=D), torch.randn(3, 5, 7, dtype=D)]
    with pytest.raises(ValueError, match=r"reads two ways.*input_kind='tensors' or 'levels'"):
        mj.pack(images)  # without the model, both readings stand
    # the model takes tensors: only the per-sample reading runs, so no choice is needed
    res = mj.per_sample_jacobian(model, images, params="body.2.*")
    sub = mj.ParamSubset.from_names(model, "body.2.*")
    cols = sub.flat_indices()
    ref = [full_jacobian(model, [im.unsqueeze(0)])[0][..., cols] for im in images]
    for i, r in enumerate(ref):
        torch.testing.assert_close(res.jacobian[i, : r.shape[0]], r, atol=1e-10, rtol=0)
    packed = mj.pack(images, input_kind="tensors")
    assert packed.kind == "tensors" and [t.shape for t in packed.unpack()] == [
        im.shape for im in images
    ]


class EitherInput(nn.Module):
    """Takes a tensor or a list (and then its first element): both readings run."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x[0] if isinstance(x, list) else x)


def test_equal_length_sequences_are_not_levels() -> None:
    torch.manual_seed(0)
    seqs = [torch.randn(5, 4, dtype=D) for _ in range(3)]  # three (T, C) sequences, equal T
    with pytest.raises(ValueError, match="reads two ways"):
        mj.pack(seqs)
    assert mj.pack(seqs, input_kind="tensors").num_samples == 3
    assert mj.pack(seqs, input_kind="levels").num_samples == 5
    # a sequence model (B, T, C) -> (B, T, 2): only the per-sample reading runs
    seq_model = nn.Linear(4, 2).to(D)
    with pytest.raises(ValueError, match="reads two ways"):
        mj.per_sample_jacobian(EitherInput().to(D), seqs)  # both readings run: refused
    res = mj.per_sample_jacobian(seq_model, [torch.randn(5, 4, dtype=D)] * 2 + [seqs[0]])
    assert res.jacobian.shape == (3, 10, 10)


# ---------------------------------------------------------------------- 5. mappings
class DictPyramid(nn.Module):
    """A pyramid module that takes an ``OrderedDict`` of levels, like torchvision's FPN."""

    def __init__(self) -> None:
        super().__init__()
        self.lateral = nn.Conv2d(3, 2, 1)
        self.head = nn.Conv2d(2, 1, 3, padding=1)

    def forward(self, feats: OrderedDict) -> OrderedDict:
        if not isinstance(feats, OrderedDict) or list(feats) != ["p3", "p4"]:
            raise TypeError(f"expected OrderedDict with p3, p4; got {type(feats).__name__}")
        return OrderedDict((k, self.head(torch.tanh(self.lateral(v)))) for k, v in feats.items())


def test_mapping_inputs_reach_the_model_as_mappings() -> None:
    torch.manual_seed(0)
    model = DictPyramid().to(D).eval()
    batched = OrderedDict(p3=torch.randn(2, 3, 6, 6, dtype=D), p4=torch.randn(2, 3, 3, 3, dtype=D))
    res = mj.per_sample_jacobian(model, batched)

    def call(m, s):
        return torch.cat([o.reshape(-1) for o in m(s).values()])

    ref = full_jacobian(
        model, [OrderedDict((k, v[i : i + 1]) for k, v in batched.items()) for i in range(2)], call
    )
    torch.testing.assert_close(res.jacobian, ref, atol=1e-10, rtol=0)
    ragged = [
        OrderedDict(p3=torch.randn(3, 6, 6, dtype=D), p4=torch.randn(3, 3, 3, dtype=D)),
        OrderedDict(p3=torch.randn(3, 4, 8, dtype=D), p4=torch.randn(3, 2, 4, dtype=D)),
    ]
    for strategy in ("bucketed", "padded", "loop"):
        res = mj.per_sample_jacobian(model, ragged, strategy=strategy)
        ref = full_jacobian(
            model, [OrderedDict((k, v.unsqueeze(0)) for k, v in s.items()) for s in ragged], call
        )
        for i in range(2):
            o = res.output_sizes[i]
            torch.testing.assert_close(res.jacobian[i, :o], ref[i][:o], atol=1e-10, rtol=0)
    unpacked = mj.pack(ragged).unpack()
    assert all(type(u) is OrderedDict and list(u) == ["p3", "p4"] for u in unpacked)
    with pytest.raises(ValueError, match=r"samples\[1\] has the keys \['p3'\]"):
        mj.pack([ragged[0], OrderedDict(p3=ragged[1]["p3"])])


# ---------------------------------------------------------------------- 6. batch statistics
@pytest.mark.parametrize("policy", ["error", "eval"])
def test_batch_norm_without_running_stats_follows_the_policy(policy: str) -> None:
    model = nn.Sequential(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2, track_running_stats=False))
    model = model.to(D).eval()
    with pytest.raises(ValueError, match=r"module '1' .*track_running_stats=False.*eval mode"):
        mj.per_sample_jacobian(model, torch.randn(2, 2, 5, 5, dtype=D), batch_norm=policy)
    ok = nn.Sequential(nn.Conv2d(2, 2, 3), nn.GroupNorm(1, 2), nn.InstanceNorm2d(2)).to(D).eval()
    mj.per_sample_jacobian(ok, torch.randn(2, 2, 5, 5, dtype=D))  # per-sample norms: fine


# ---------------------------------------------------------------------- 7. messages
def test_messages_name_what_the_user_wrote() -> None:
    model = _classifier()
    x, y = torch.randn(3, 4, dtype=D), torch.tensor([0, 1, 2])
    x_nan = x.clone()
    x_nan[2, 1] = float("nan")
    with pytest.raises(ValueError, match="nan in sample 2, level 0"):
        mj.SubnetLaplace(model, "classification", "2.*").fit([(x_nan, y)])
    with pytest.raises(ValueError, match="nan in sample 2, level 0"):
        mj.diag_fisher(model, [(x_nan, y)])
    with pytest.raises(TypeError, match="subset must be None, a ParamSubset"):
        mj.SubnetLaplace(model, "classification", torch.tensor([1, 2]))
    with pytest.raises(TypeError, match=r"torch.float32 but the model's parameters torch.float64"):
        mj.per_sample_jacobian(model, x.float())
    with pytest.raises(mj.MemoryBudgetError, match="memory_budget=10 bytes"):
        mj.SubnetLaplace(model, "classification", "2.*", memory_budget=10).fit([(x, y)])
    conv = nn.Conv2d(3, 2, 3).to(D)
    with pytest.raises(ValueError, match=r"\(1, 3, 5, 5\), like a batch of one.*squeeze\(0\)"):
        mj.per_sample_jacobian(conv, [[torch.randn(1, 3, 5, 5, dtype=D)] for _ in range(2)])


# ---------------------------------------------------------------------- 8 and 9. token ids
@pytest.mark.parametrize("strategy", ["auto", "vmap", "loop"])
def test_token_ids_and_max_norm(strategy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2)).to(D)
    ids = torch.randint(0, 10, (4, 5))
    before = copy.deepcopy(model.state_dict())
    res = mj.per_sample_jacobian(model, ids, strategy=strategy)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # max_norm renormalised a copy, not the model
    ref_model = copy.deepcopy(model)
    ref = full_jacobian(ref_model, [ids[i : i + 1] for i in range(4)])
    torch.testing.assert_close(res.jacobian, ref, atol=1e-10, rtol=0)


class TokenNet(nn.Module):
    """Token ids ``(B, 1, T)`` -> per-token logits ``(B, T, 3)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.emb(ids[:, 0].long())))


@pytest.mark.parametrize("strategy", ["padded", "bucketed", "loop"])
def test_ragged_token_ids_every_strategy(strategy: str) -> None:
    torch.manual_seed(0)
    model = TokenNet().to(D)
    seqs = [torch.randint(0, 10, (1, t)) for t in (5, 3, 6)]
    res = mj.per_sample_jacobian(model, seqs, strategy=strategy, strict=True)
    assert res.strategy == strategy
    ref = full_jacobian(model, [s.unsqueeze(0) for s in seqs])
    for i, r in enumerate(ref):
        torch.testing.assert_close(res.jacobian[i, : r.shape[0]], r, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match=r"is passed as \(1, T\)"):
        mj.pack([s[0] for s in seqs])
