"""Padded (masked) execution of transformer blocks over ragged tokens: ``F.rms_norm``
(``nn.RMSNorm``), ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) and the
masks of ``F.scaled_dot_product_attention``, against the loop reference in float64."""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from cases import DTYPE, ragged_samples
from torch import Tensor, nn

import multiscale_jac as mj
from multiscale_jac.adapter import PerSampleFunction
from multiscale_jac.enums import Layout
from multiscale_jac.masked import (
    SUPPORTED_OPS,
    MaskedMode,
    PaddedFunction,
    Region,
    UnsupportedOpError,
)
from multiscale_jac.reference import per_sample_jacobian_loop

DOCS = Path(__file__).resolve().parent.parent / "docs" / "padded.md"
#: ``auto`` decided by the cost model alone, so that padded is always planned (no shortcut for
#: small jobs, no timing probe), where the engine has that option
AUTO = (
    {"tune": "estimate"} if "tune" in inspect.signature(mj.per_sample_jacobian).parameters else {}
)

ATOL = 1e-10
TOKENS_1D = [[(6,)], [(4,)], [(1,)], [(5,)]]  # padded at the end of the sequence (a box)
TOKENS_2D = [[(2, 3)], [(3, 1)], [(2, 2)]]  # interleaved padded tokens (an ordered region)


# ---------------------------------------------------------------------- models
class RMSBlock(nn.Module):
    """Pre-norm transformer block over tokens ``(1, T, C)``: ``nn.RMSNorm`` and
    ``nn.MultiheadAttention`` (``batch_first`` either way), an MLP, a per-token head and a
    masked-mean head. ``user_kpm``: a key-padding mask computed from the tokens (bool, from
    their first feature); ``attn_mask``: ``"band"`` (each token sees its neighbours; padded
    query rows see no real key) or ``"causal"``, both built from the padded shape;
    ``weights``: the attention weights are an output too (``need_weights=True``)."""

    def __init__(
        self,
        batch_first: bool = True,
        user_kpm: bool = False,
        need_weights: bool = False,
        attn_mask: str | None = None,
        c_in: int = 3,
        d: int = 4,
        heads: int = 2,
        **mha: Any,
    ) -> None:
        super().__init__()
        self.batch_first, self.user_kpm, self.attn_mask = batch_first, user_kpm, attn_mask
        self.need_weights = need_weights
        self.embed = nn.Linear(c_in, d)
        self.norm1 = nn.RMSNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=batch_first, **mha)
        self.norm2 = nn.RMSNorm(d, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.token_head = nn.Linear(d, 1)
        self.cls = nn.Linear(d, 2)

    def masks(self, tokens: Tensor) -> tuple[Tensor | None, Tensor | None]:
        kpm = tokens[..., 0] > 1.0 if self.user_kpm else None
        t = tokens.shape[1]
        i = torch.arange(t)
        am = None
        if self.attn_mask == "band":
            am = (i[:, None] - i[None, :]).abs() > 1  # True: blocked
        elif self.attn_mask == "causal":
            am = nn.Transformer.generate_square_subsequent_mask(t, dtype=tokens.dtype)
        return kpm, am

    def forward(self, levels: list[Tensor]) -> dict[str, Tensor]:
        kpm, am = self.masks(levels[0])
        x = self.embed(levels[0])
        h = self.norm1(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        a, w = self.attn(
            h, h, h, key_padding_mask=kpm, attn_mask=am, need_weights=self.need_weights
        )
        if not self.batch_first:
            a = a.transpose(0, 1)
        x = x + a
        x = x + self.mlp(self.norm2(x))
        out = {"tokens": self.token_head(x).squeeze(-1), "class": self.cls(x.mean(dim=1))}
        if w is not None:
            out["weights"] = w
        return out


class CrossPool(nn.Module):
    """Attention pooling: learned queries (unpadded) attend to the ragged tokens (keys and
    values from another projection width: ``kdim``/``vdim``)."""

    def __init__(self, c_in: int = 3, d: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(1, 2, d))
        self.norm = nn.RMSNorm(c_in)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, kdim=c_in, vdim=c_in)

    def forward(self, levels: list[Tensor]) -> Tensor:
        t = self.norm(levels[0])
        out, w = self.attn(self.queries, t, t)
        return torch.cat([out.flatten(1), w.flatten(1)], dim=1)


class SDPABlock(nn.Module):
    """``F.scaled_dot_product_attention`` with ``is_causal`` or a user mask over the padded
    shape (``"band"``: bool, True where allowed; ``"alibi"``: a float distance bias), or a
    float bias computed from the tokens (``"token_bias"``: padded, real where query and key
    are)."""

    def __init__(self, how: str, c_in: int = 3, d: int = 4) -> None:
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(c_in, 3 * d)
        self.norm = nn.RMSNorm(d)

    def forward(self, levels: list[Tensor]) -> Tensor:
        q, k, v = self.qkv(levels[0]).chunk(3, dim=-1)
        t = q.shape[1]
        i = torch.arange(t, dtype=q.dtype)
        if self.how == "causal":
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.how == "band":
            allowed = (i[:, None] - i[None, :]).abs() <= 1
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        elif self.how == "alibi":
            bias = -(i[:, None] - i[None, :]).abs()
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            bias = torch.einsum("bld,bsd->bls", torch.tanh(q), torch.tanh(k))
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.norm(att).flatten(1)


class RMSOverPadded(nn.Module):
    """RMS norm over padded dims (masked statistics): conv maps normalised over ``(H, W)``
    (``torch.rms_norm``, per-pixel outputs), or 2-d tokens over ``(T, C)`` (``F.rms_norm``,
    then a sum over the tokens)."""

    def __init__(self, tokens: bool) -> None:
        super().__init__()
        self.tokens = tokens
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.lin = nn.Linear(3, 3)

    def forward(self, levels: list[Tensor]) -> Tensor:
        if self.tokens:
            x = self.lin(levels[0])
            return F.rms_norm(x, x.shape[1:]).sum(dim=1)
        y = self.conv(levels[0])
        return torch.rms_norm(torch.tanh(y), y.shape[-2:], eps=1e-3).flatten(1)


class EncoderLayer(nn.Module):
    """PyTorch's own ``nn.TransformerEncoderLayer`` (pre-norm; its fast path is skipped under
    the mode, so it runs as LayerNorm, ``nn.MultiheadAttention`` and an MLP)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, d)
        self.layer = nn.TransformerEncoderLayer(
            d, 2, dim_feedforward=8, dropout=0.0, batch_first=True, norm_first=True
        )

    def forward(self, levels: list[Tensor]) -> Tensor:
        return self.layer(self.embed(levels[0])).mean(dim=1)


# ---------------------------------------------------------------------- cases (zoo style)
@dataclass(frozen=True)
class TCase:
    id: str
    model: Callable[[], nn.Module]
    sizes: list = field(default_factory=lambda: TOKENS_1D)
    nested: bool = True
    #: reaches SDPA, whose fused CPU kernel has no forward-mode derivative (which kernel runs
    #: depends on the mask): fwd may fall back to rev
    fwd_unsupported: bool = False

    def build(self) -> nn.Module:
        torch.manual_seed(sum(map(ord, self.id)))
        return self.model().to(DTYPE).eval()

    def inputs(self) -> Any:
        channels = [3] if self.nested else [2]
        samples = ragged_samples(self.sizes, channels, seed=1)
        return mj.pack(samples, layout="nested") if self.nested else samples


def _block(**kw: Any) -> Callable[[], nn.Module]:
    return functools.partial(RMSBlock, **kw)


TCASES = [
    TCase("bf", _block(batch_first=True), fwd_unsupported=True),
    TCase("seq_first", _block(batch_first=False), fwd_unsupported=True),
    TCase("bf_kpm", _block(batch_first=True, user_kpm=True), fwd_unsupported=True),
    TCase("seq_first_kpm_weights", _block(batch_first=False, user_kpm=True, need_weights=True)),
    TCase("bf_2d", _block(batch_first=True), TOKENS_2D, fwd_unsupported=True),
    TCase("seq_first_2d_kpm", _block(batch_first=False, user_kpm=True), TOKENS_2D, True, True),
    TCase("bf_2d_weights", _block(batch_first=True, need_weights=True), TOKENS_2D),
    TCase("band_mask_weights", _block(attn_mask="band", need_weights=True, user_kpm=True)),
    TCase(
        "causal_bias_kv",
        _block(attn_mask="causal", add_bias_kv=True, add_zero_attn=True),
        fwd_unsupported=True,
    ),
    TCase("cross_pool", CrossPool),
    TCase("cross_pool_2d", CrossPool, TOKENS_2D),
    TCase("sdpa_causal", functools.partial(SDPABlock, "causal"), fwd_unsupported=True),
    TCase("sdpa_band", functools.partial(SDPABlock, "band"), fwd_unsupported=True),
    TCase("sdpa_alibi", functools.partial(SDPABlock, "alibi"), fwd_unsupported=True),
    TCase("sdpa_token_bias", functools.partial(SDPABlock, "token_bias"), fwd_unsupported=True),
    TCase("sdpa_token_bias_2d", functools.partial(SDPABlock, "token_bias"), TOKENS_2D, True, True),
    TCase("rms_maps", functools.partial(RMSOverPadded, False), [[(4, 3)], [(2, 5)]], False),
    TCase("rms_tokens_2d", functools.partial(RMSOverPadded, True), TOKENS_2D),
    TCase("encoder_layer", EncoderLayer, fwd_unsupported=True),
]
BY_ID = {c.id: c for c in TCASES}


@functools.cache
def model_of(case_id: str) -> nn.Module:
    return BY_ID[case_id].build()


def entries(model: nn.Module) -> mj.ParamSubset:
    """Single entries: the first and last of every other tensor, and of the last one."""
    params = list(model.named_parameters())
    chosen = {n: sorted({0, p.numel() - 1}) for n, p in params[::2]}
    last, p = params[-1]
    chosen[last] = sorted({0, p.numel() // 2, p.numel() - 1})
    return mj.ParamSubset.from_indices(model, chosen)


@functools.cache
def reference(case_id: str, subset_kind: str) -> tuple[mj.ParamSubset, mj.JacobianResult]:
    model = model_of(case_id)
    subset = mj.ParamSubset.all(model) if subset_kind == "all" else entries(model)
    return subset, per_sample_jacobian_loop(model, BY_ID[case_id].inputs(), params=subset)


def assert_same(res: mj.JacobianResult, ref: mj.JacobianResult) -> None:
    assert torch.isfinite(res.jacobian).all()
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=ATOL, rtol=0)
    assert res.output_sizes == ref.output_sizes


# ---------------------------------------------------------------------- exactness
def _case_kinds() -> list:
    """Every case x subset kind; the fast tier runs one kind per case (alternating down the
    list, one loop reference per case, shared by rev and fwd), the slow tier the other."""
    return [
        pytest.param(c.id, kind, id=f"{c.id}-{kind}", marks=[pytest.mark.slow] * (i % 2 != k))
        for i, c in enumerate(TCASES)
        for k, kind in enumerate(("all", "entries"))
    ]


@pytest.mark.parametrize(("case_id", "subset_kind"), _case_kinds())
def test_padded_rev_equals_loop(case_id: str, subset_kind: str) -> None:
    subset, ref = reference(case_id, subset_kind)
    assert torch.isfinite(ref.jacobian).all()
    res = mj.per_sample_jacobian(
        model_of(case_id), BY_ID[case_id].inputs(), params=subset, strategy="padded",
        mode="rev", strict=True,
    )  # fmt: skip
    assert (res.strategy, res.mode, res.fallback) == ("padded", "rev", None)
    assert_same(res, ref)


@pytest.mark.parametrize(("case_id", "subset_kind"), _case_kinds())
def test_padded_fwd_equals_loop_or_records_its_fallback(case_id: str, subset_kind: str) -> None:
    """Forward mode runs padded; where the model reaches SDPA's fused kernel (no forward-mode
    derivative) it may fall back to rev, and then says so: one warning, ``result.fallback``,
    and an error with ``strict=True``. Models without SDPA must run fwd."""
    case = BY_ID[case_id]
    subset, ref = reference(case_id, subset_kind)
    kwargs = dict(params=subset, strategy="padded", mode="fwd")
    model = model_of(case_id)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", mj.FallbackWarning)
        res = mj.per_sample_jacobian(model, case.inputs(), **kwargs)
    warned = [str(w.message) for w in caught if w.category is mj.FallbackWarning]
    assert res.strategy == "padded"
    assert_same(res, ref)
    if res.mode == "fwd":
        assert res.fallback is None and not warned
        return
    assert case.fwd_unsupported, res.fallback
    assert res.mode == "rev" and len(warned) == 1
    assert re.match(r"mode 'fwd' failed \(.*forward AD.*\); ran mode 'rev'$", res.fallback)
    assert res.fallback in warned[0]
    with pytest.raises(RuntimeError, match=r"mode 'fwd' failed.*forward AD"):
        mj.per_sample_jacobian(model, case.inputs(), strict=True, **kwargs)


@pytest.mark.parametrize("sizes", [TOKENS_1D, TOKENS_2D])
def test_user_key_padding_mask_hides_a_real_token(sizes) -> None:
    """The ``user_kpm`` cases combine a mask that hides some real token (never all of one
    sample's) with the padding."""
    samples = ragged_samples(sizes, [3], seed=1)
    hidden = [int((s[0][0] > 1.0).sum()) for s in samples]
    assert any(hidden)
    assert all(h < s[0][0].numel() for h, s in zip(hidden, samples))


@pytest.mark.parametrize("case_id", ["bf", "seq_first_kpm_weights", "bf_2d", "rms_maps"])
def test_auto_keeps_padded_execution(case_id: str) -> None:
    """``strategy="auto"`` does not fall back to buckets because of these ops: padded planning
    succeeds (the choice between the two is the cost model's)."""
    case = BY_ID[case_id]
    _, ref = reference(case_id, "all")
    with warnings.catch_warnings():
        warnings.simplefilter("error", mj.FallbackWarning)
        res = mj.per_sample_jacobian(model_of(case_id), case.inputs(), mode="rev", **AUTO)
    said = " ".join([*res.notes, res.fallback or ""])
    assert "not possible" not in said, said
    assert not re.search(r"rms_norm|multi_head_attention|scaled_dot_product", said), said
    assert res.strategy in ("padded", "bucketed") and res.fallback is None
    assert_same(res, ref)


@pytest.mark.parametrize(
    "case_id", ["bf_2d_weights", "band_mask_weights", "causal_bias_kv", "cross_pool_2d"]
)
def test_padded_forward_is_the_unpadded_one(case_id: str) -> None:
    """The padded forward pass itself: every sample's real outputs (attention weights among
    them) equal its unpadded outputs, the rest is exactly zero."""
    case = BY_ID[case_id]
    model, packed = model_of(case_id), case.inputs()
    fn = PerSampleFunction(
        model, mj.ParamSubset.all(model), packed.structure, tokens=packed.layout is Layout.NESTED
    )
    pf, values, padded = PaddedFunction(fn, packed), fn.values(), False
    for i in range(packed.num_samples):
        expected = fn(values, *packed.sample(i))
        out = pf(values, *(t[i] for t in packed.levels), torch.tensor(i))
        real = pf.output_table[i]
        torch.testing.assert_close(out[real], expected, atol=ATOL, rtol=0)
        assert torch.all(out[~real] == 0)
        padded |= bool((~real).any())
    assert padded


def test_fast_path_is_not_taken_under_the_mode() -> None:
    """In eval mode without grad, ``nn.MultiheadAttention`` may run
    ``torch._native_multi_head_attention``; under the mode (a torch-function override) it
    calls ``F.multi_head_attention_forward``, whose rule runs."""
    mha = nn.MultiheadAttention(4, 2, batch_first=True).to(DTYPE).eval()
    x = torch.randn(1, 5, 4, dtype=DTYPE)
    x[:, 3:] = 0
    seen: list[str] = []
    rule = MaskedMode.rules[F.multi_head_attention_forward]

    def spy(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
        seen.append(func.__name__)
        return rule(mode, func, args, kwargs)

    mode = MaskedMode(torch.tensor(0), mha)
    MaskedMode.rules[F.multi_head_attention_forward] = spy
    try:
        with torch.no_grad(), mode:
            mode.track(x, Region.box(torch.tensor([[3]]), [5], [1]))
            out, _ = mha(x, x, x)
    finally:
        MaskedMode.rules[F.multi_head_attention_forward] = rule
    assert seen == ["multi_head_attention_forward"]
    with torch.no_grad():
        want, _ = mha(x[:, :3], x[:, :3], x[:, :3])
    torch.testing.assert_close(out[:, :3], want, atol=ATOL, rtol=0)
    assert torch.all(out[:, 3:] == 0)


# ---------------------------------------------------------------------- refusals
class Flattened(nn.Module):
    """RMS norm over the positions of flattened channels: ``(1, C, H, W)`` flattened and split
    again into ``(1, C, H*W)`` is one flattened group; normalising its last dim only cuts it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1)

    def forward(self, levels: list[Tensor]) -> Tensor:
        x = self.conv(levels[0])
        y = x.flatten(1).unflatten(1, (x.shape[1], -1))
        return F.rms_norm(y, y.shape[-1:]).flatten(1)


REFUSED = [
    (
        "mha_causal_2d",
        lambda: RMSBlock(attn_mask="causal"),
        TOKENS_2D,
        "F.multi_head_attention_forward",
        # the causal mask is made of the token count, a padded size: a prefix box per sample,
        # while the flattened tokens' real positions are interleaved
        "an attn_mask whose padding differs from the query's and the key's",
    ),
    (
        "sdpa_causal_2d",
        lambda: SDPABlock("causal"),
        TOKENS_2D,
        "F.scaled_dot_product_attention",
        "is_causal over flattened padded tokens",
    ),
    (
        "rms_cuts_group",
        Flattened,
        [[(3, 3)], [(2, 3)]],
        "F.rms_norm",
        "a normalisation over part of a flattened padded group",
    ),
]


@pytest.mark.parametrize(
    ("build", "sizes", "op", "why"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_refused_cases_name_the_op(build, sizes, op: str, why: str) -> None:
    torch.manual_seed(0)
    model = build().to(DTYPE).eval()
    nested = not isinstance(model, Flattened)
    samples = ragged_samples(sizes, [3], seed=1)
    inputs = mj.pack(samples, layout="nested") if nested else samples
    with pytest.raises(UnsupportedOpError, match=re.escape(why)) as info:
        mj.per_sample_jacobian(model, inputs, strategy="padded", strict=True)
    assert info.value.op == op and op in str(info.value)
    ref = per_sample_jacobian_loop(model, inputs)
    with pytest.warns(mj.FallbackWarning, match=f"cannot run this model.*{re.escape(op)}"):
        res = mj.per_sample_jacobian(model, inputs, strategy="padded")
    assert res.strategy == "bucketed" and why in res.fallback
    torch.testing.assert_close(res.jacobian, ref.jacobian, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------- catalogue
def test_catalogue_and_docs_table_agree() -> None:
    for name in [
        "F.rms_norm",
        "torch.rms_norm",
        "F.multi_head_attention_forward",
        "F.scaled_dot_product_attention",
        "Tensor.masked_fill_",
    ]:
        assert name in SUPPORTED_OPS
    text = DOCS.read_text()
    rules = text.split("## Rules", 1)[1].split("## Unsupported ops", 1)[0]
    missing = [n for n in SUPPORTED_OPS if f"`{n}`" not in rules]
    assert not missing, missing
