"""The model/case zoo, as data.

Every case builds a small float64 model (in eval mode) and a batch of inputs in one of the forms
``pack`` accepts. Output sizes stay small so that the loop reference is quick.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import multiscale_jac as mj
from multiscale_jac.models import ConvBlock, TinyFPN

DTYPE = torch.float64


# ---------------------------------------------------------------------- zoo models
class BNCNN(nn.Module):
    """conv-BN-ReLU x2, global average pooling per level, mean over levels, linear classifier."""

    def __init__(self, in_ch: int = 3, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_ch, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, stride=2),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        self.fc = nn.Linear(width, classes)

    def forward(self, levels: Sequence[Tensor]) -> Tensor:
        pooled = [self.features(x).mean(dim=(2, 3)) for x in levels]
        return self.fc(torch.stack(pooled).mean(0))


class DenseHead(nn.Module):
    """Per-pixel logits whose size follows the input: (B, K, H, W). Takes a tensor or a list."""

    def __init__(self, in_ch: int = 2, width: int = 3, classes: int = 2) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_ch, width, 3, padding=1), nn.Tanh())
        self.cls = nn.Conv2d(width, classes, 1)

    def forward(self, x: Tensor | Sequence[Tensor]) -> Tensor:
        if isinstance(x, (list, tuple)):
            x = x[0]
        return self.cls(self.body(x))


class MLP(nn.Module):
    def __init__(self, d_in: int = 5, hidden: int = 6, d_out: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(2, 3, 3, padding=1)
        self.c2 = nn.Conv1d(3, 2, 3, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.c2(torch.tanh(self.c1(x))).flatten(1)


class Conv3dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(1, 2, 2)
        self.fc = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.c1(x)).amax(dim=(2, 3, 4)))


class SharedDictHead(nn.Module):
    """A shared module called on every level; returns a dict of per-level outputs."""

    def __init__(self, channels: Sequence[int] = (2, 3), width: int = 3) -> None:
        super().__init__()
        self.proj = nn.ModuleList(nn.Conv2d(c, width, 1) for c in channels)
        self.shared = nn.Conv2d(width, 2, 3, padding=1)

    def forward(self, levels: Sequence[Tensor]) -> dict[str, Tensor]:
        return {
            f"p{k}": torch.tanh(self.shared(F.relu(p(x)))).amax(dim=(2, 3))
            for k, (p, x) in enumerate(zip(self.proj, levels))
        }


class TiedLinear(nn.Module):
    """Two layers sharing one weight (``b.weight`` is ``a.weight``): one parameter, two names."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


class TinyTransformer(nn.Module):
    """Pre-norm transformer block over tokens ``(B, T, C)`` (inputs packed with
    ``layout="nested"``), then a per-token head and a masked-mean classifier."""

    def __init__(self, c_in: int = 3, d: int = 4, heads: int = 2, classes: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Linear(c_in, d)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.token_head = nn.Linear(d, 1)
        self.cls = nn.Linear(d, classes)

    def forward(self, levels: Sequence[Tensor]) -> dict[str, Tensor]:
        x = self.embed(levels[0])
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        x = x + self.mlp(self.ln2(x))
        return {"tokens": self.token_head(x).squeeze(-1), "class": self.cls(x.mean(dim=1))}


# ---------------------------------------------------------------------- detection-library styles
def make_anchors(feats: Sequence[Tensor], strides: Sequence[float], offset: float = 0.5) -> Tensor:
    """Anchor points of every level's cells, scaled by its stride, as ultralytics writes them:
    ``(sum_l h_l * w_l, 2)``."""
    points = []
    for f, stride in zip(feats, strides):
        h, w = f.shape[2:]
        sx = torch.arange(end=w, device=f.device, dtype=f.dtype) + offset
        sy = torch.arange(end=h, device=f.device, dtype=f.dtype) + offset
        sy, sx = torch.meshgrid(sy, sx, indexing="ij")
        points.append(torch.stack((sx, sy), -1).view(-1, 2) * stride)
    return torch.cat(points)


class AnchorCacheHead(nn.Module):
    """A detection head in the style of ultralytics' ``Detect``: per-level conv branches, box
    and class outputs flattened over every level's cells, anchors decoded into boxes. Like
    ``Detect`` it caches ``anchors`` and ``shape`` on the module in its forward and rebuilds
    them only when the input shape changes; it also counts its calls (a tensor attribute
    written in place)."""

    def __init__(self, channels: Sequence[int] = (2, 3), classes: int = 2) -> None:
        super().__init__()
        self.box = nn.ModuleList(nn.Conv2d(c, 2, 3, padding=1) for c in channels)
        self.cls = nn.ModuleList(nn.Conv2d(c, classes, 1) for c in channels)
        self.strides = (8.0, 16.0)
        self.shape: Any = None
        self.anchors = torch.empty(0)
        self.calls = torch.zeros((), dtype=torch.int64)

    def forward(self, levels: Sequence[Tensor]) -> Tensor:
        self.calls += 1
        n = levels[0].shape[0]
        box = torch.cat([b(x).view(n, 2, -1) for b, x in zip(self.box, levels)], 2)
        cls = torch.cat([c(x).view(n, c.out_channels, -1) for c, x in zip(self.cls, levels)], 2)
        shape = levels[0].shape
        if self.shape != shape:
            self.anchors = make_anchors(levels, self.strides).transpose(0, 1).type_as(box)
            self.shape = shape
        return torch.cat([self.anchors.unsqueeze(0) + box, cls.sigmoid()], 1)


class CoordGridHead(nn.Module):
    """CoordConv-style: every level gets two channels of normalised coordinates made in the
    forward from ``arange(w).type_as(x)`` and ``linspace``, then a shared conv; per-level
    global mean."""

    def __init__(self, in_ch: int = 2, width: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_ch + 2, width, 3, padding=1)
        self.out = nn.Linear(width, 2)

    def forward(self, levels: Sequence[Tensor]) -> Tensor:
        pooled = []
        for x in levels:
            n, _, h, w = x.shape
            gx = torch.arange(w).type_as(x) / max(w - 1, 1)
            gy = torch.linspace(0, 1, h, dtype=x.dtype)
            grid = torch.stack(torch.meshgrid(gy, gx, indexing="ij")).expand(n, 2, h, w)
            y = torch.tanh(self.conv(torch.cat([x, grid * x.new_ones(1)], 1)))
            pooled.append(y.sum(dim=(2, 3)) / (h * w))
        return self.out(torch.stack(pooled).mean(0))


# ---------------------------------------------------------------------- zoo models: BiFPN (effdet)
# Written the way effdet (rwightman/efficientdet-pytorch) writes its BiFPN: every node fuses
# resampled inputs with learnable non-negative edge weights ("fastattn": relu, then divided by
# their sum + eps), then swish and a depthwise-separable conv with BatchNorm; the head's convs
# are shared over the levels, its BatchNorms are per level.
class SeparableConv2d(nn.Module):
    """effdet's ``SeparableConv2d``: depthwise 3x3, pointwise 1x1, then BatchNorm (``norm``)
    and swish (``act``) where asked."""

    def __init__(
        self, in_ch: int, out_ch: int, bias: bool = False, norm: bool = True, act: bool = False
    ) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(in_ch, in_ch, 3, padding=1, groups=in_ch, bias=False)
        self.conv_pw = nn.Conv2d(in_ch, out_ch, 1, bias=bias)
        self.bn = nn.BatchNorm2d(out_ch) if norm else nn.Identity()
        self.act = nn.SiLU() if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.bn(self.conv_pw(self.conv_dw(x))))


class ResampleFeatureMap(nn.Sequential):
    """effdet's: a 1x1 conv + BatchNorm where the channels differ, then a stride-2 max pool
    (``scale=2``: to a coarser level) or a nearest upsampling by ``scale_factor=2``
    (``scale=0.5``)."""

    def __init__(self, in_ch: int, out_ch: int, scale: float) -> None:
        super().__init__()
        if in_ch != out_ch:
            self.add_module("conv", nn.Conv2d(in_ch, out_ch, 1))
            self.add_module("bn", nn.BatchNorm2d(out_ch))
        if scale > 1:
            self.add_module("downsample", nn.MaxPool2d(3, stride=2, padding=1))
        elif scale < 1:
            self.add_module("upsample", nn.Upsample(scale_factor=2, mode="nearest"))


class FpnCombine(nn.Module):
    """effdet's ``FpnCombine`` with ``weight_method="fastattn"``: ``sum_i w_i x_i / (sum w + eps)``
    with ``w = relu(edge_weights)``, over the resampled inputs (``inputs``: ``(node, in_ch,
    scale)`` of each edge)."""

    def __init__(self, inputs: Sequence[tuple[int, int, float]], out_ch: int) -> None:
        super().__init__()
        self.inputs = [node for node, _, _ in inputs]
        self.resample = nn.ModuleList(ResampleFeatureMap(c, out_ch, s) for _, c, s in inputs)
        self.edge_weights = nn.Parameter(torch.ones(len(inputs)))

    def forward(self, nodes: Sequence[Tensor]) -> Tensor:
        x = [r(nodes[i]) for i, r in zip(self.inputs, self.resample)]
        edge_weights = F.relu(self.edge_weights)
        weights_sum = torch.sum(edge_weights)
        out = torch.stack(
            [(x[i] * edge_weights[i]) / (weights_sum + 0.0001) for i in range(len(x))], dim=-1
        )
        return torch.sum(out, dim=-1)


class Fnode(nn.Module):
    """A BiFPN node: combine, then (effdet's ``after_combine``) swish and a separable conv."""

    def __init__(self, combine: FpnCombine, width: int) -> None:
        super().__init__()
        self.combine = combine
        self.after_combine = nn.Sequential(nn.SiLU(), SeparableConv2d(width, width))

    def forward(self, nodes: Sequence[Tensor]) -> Tensor:
        return self.after_combine(self.combine(nodes))


class BiFpnLayer(nn.Module):
    """One BiFPN cell over L levels (0 finest): top-down nodes from the coarsest level to the
    finest (each fuses its level with the upsampled node above), then bottom-up nodes (each
    fuses its level, its top-down node where there is one and the pooled node below). The
    nodes list grows as effdet's does: inputs first, then every node's output."""

    def __init__(self, in_channels: Sequence[int], width: int) -> None:
        super().__init__()
        n = len(in_channels)
        chans = list(in_channels)
        self.fnode = nn.ModuleList()
        top = n - 1  # the node index that holds the current coarser feature
        td = {}
        for lvl in range(n - 2, -1, -1):
            edges = [(lvl, chans[lvl], 1.0), (top, chans[top], 0.5)]
            self.fnode.append(Fnode(FpnCombine(edges, width), width))
            chans.append(width)
            top = td[lvl] = len(chans) - 1
        below = td[0]
        for lvl in range(1, n):
            edges = [(lvl, chans[lvl], 1.0)]
            if lvl in td:
                edges.append((td[lvl], width, 1.0))
            edges.append((below, width, 2.0))
            self.fnode.append(Fnode(FpnCombine(edges, width), width))
            chans.append(width)
            below = len(chans) - 1
        self.num_levels = n

    def forward(self, x: Sequence[Tensor]) -> list[Tensor]:
        nodes = list(x)
        for fn in self.fnode:
            nodes.append(fn(nodes))
        n = self.num_levels
        return [nodes[2 * n - 2], *nodes[-(n - 1) :]]  # the finest top-down node, bottom-up


class HeadNet(nn.Module):
    """effdet's ``HeadNet``: separable convs shared over the levels with a BatchNorm per level,
    swish, then a shared separable predictor; the per-level maps flattened and concatenated
    (as the loss's anchor assignment reads them), so outputs follow the pyramid."""

    def __init__(self, width: int, levels: int, outputs: int, repeats: int = 1) -> None:
        super().__init__()
        self.conv_rep = nn.ModuleList(
            SeparableConv2d(width, width, norm=False) for _ in range(repeats)
        )
        self.bn_rep = nn.ModuleList(
            nn.ModuleList(nn.BatchNorm2d(width) for _ in range(levels)) for _ in range(repeats)
        )
        self.act = nn.SiLU()
        self.predict = SeparableConv2d(width, outputs, bias=True, norm=False)

    def forward(self, x: Sequence[Tensor]) -> Tensor:
        outs = []
        for lvl, y in enumerate(x):
            for conv, bns in zip(self.conv_rep, self.bn_rep):
                y = self.act(bns[lvl](conv(y)))
            outs.append(self.predict(y).flatten(1))
        return torch.cat(outs, 1)


class BiFPN(nn.Module):
    """An EfficientDet-style detector's neck and head over a backbone's pyramid: ``cells``
    stacked BiFPN cells (the first resamples the backbone's channels with 1x1 conv + BN) and a
    class head shared over the levels. Level ``l`` must be ``2**l`` times coarser than level 0
    (max pool 3/2/1 and nearest upsampling by 2 meet again)."""

    def __init__(
        self,
        in_channels: Sequence[int] = (2, 4, 4),
        width: int = 4,
        cells: int = 2,
        outputs: int = 2,
        head_repeats: int = 1,
    ) -> None:
        super().__init__()
        chans = list(in_channels)
        self.cells = nn.Sequential()
        for _ in range(cells):
            self.cells.append(BiFpnLayer(chans, width))
            chans = [width] * len(in_channels)
        self.class_net = HeadNet(width, len(in_channels), outputs, head_repeats)

    def forward(self, levels: Sequence[Tensor]) -> Tensor:
        return self.class_net(self.cells(list(levels)))


# ---------------------------------------------------------------------- inputs
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ragged_samples(
    sizes: Sequence[Sequence[tuple[int, ...]]], channels: Sequence[int], seed: int = 0
) -> list[list[Tensor]]:
    """``sizes[i][l]`` is the spatial size of sample i at level l."""
    g = _gen(seed)
    return [
        [torch.randn(c, *s, generator=g, dtype=DTYPE) for c, s in zip(channels, sig)]
        for sig in sizes
    ]


def batched_levels(n: int, shapes: Sequence[tuple[int, ...]], seed: int = 0) -> list[Tensor]:
    g = _gen(seed)
    return [torch.randn(n, *s, generator=g, dtype=DTYPE) for s in shapes]


def batched_tensor(n: int, shape: tuple[int, ...], seed: int = 0) -> Tensor:
    return torch.randn(n, *shape, generator=_gen(seed), dtype=DTYPE)


# ---------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One zoo entry: ``model()`` builds the float64 eval-mode model, ``inputs()`` the batch."""

    id: str
    model: Callable[[], nn.Module]
    inputs: Callable[[], Any]
    glob: str
    ragged: bool = False
    ragged_outputs: bool = False
    output_fn: Callable[[Any], Any] | None = None
    #: regex of the UnsupportedOpError that makes strategy='padded' fall back, if any
    padded_unsupported: str | None = None
    #: the model has an op without a forward-mode derivative (mode='fwd' falls back to 'rev')
    fwd_unsupported: bool = False

    def build(self) -> nn.Module:
        torch.manual_seed(sum(map(ord, self.id)))
        return self.model().to(DTYPE).eval()


def _seed_convblock() -> nn.Module:
    return ConvBlock(3, 8)


def _fpn() -> nn.Module:
    return TinyFPN((3, 4), width=3, num_outputs=2, extra_levels=1)


def _fpn_scale() -> nn.Module:
    return TinyFPN((3, 4), width=3, num_outputs=2, extra_levels=1, upsample="scale")


def _bn_cnn() -> nn.Module:
    m = BNCNN()
    # non-trivial running statistics, so that eval mode differs from a fresh layer
    for bn in (m.features[1], m.features[4]):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return m


# ---------------------------------------------------------------------- BiFPN (effdet) inputs
BIFPN_CHANNELS = (2, 4, 4)


def bifpn_pyramids(
    bases: Sequence[tuple[int, int]],
    channels: Sequence[int] = BIFPN_CHANNELS,
    seed: int = 0,
    dtype: torch.dtype = DTYPE,
) -> list[list[Tensor]]:
    """One sample per ``(H, W)`` of its finest level, level ``l`` at ``(H, W) / 2**l`` (a
    backbone's strides; ``H, W`` divisible by ``2**(L-1)``)."""
    g = _gen(seed)
    return [
        [
            torch.randn(c, h >> lvl, w >> lvl, generator=g, dtype=dtype)
            for lvl, c in enumerate(channels)
        ]
        for h, w in bases
    ]


def bifpn_spread(model: nn.Module) -> mj.ParamSubset:
    """Single entries spread through the cells: an edge weight of a top-down node in the first
    cell, depthwise and pointwise conv entries of the last cell, BatchNorm scale and shift
    entries in different cells, an edge weight of a bottom-up node of the last cell."""
    last = len(model.cells) - 1
    picks = {
        "cells.0.fnode.0.combine.edge_weights": [1],
        f"cells.{last}.fnode.1.after_combine.1.conv_dw.weight": [0, 5],
        f"cells.{last}.fnode.3.after_combine.1.conv_pw.weight": [2],
        "cells.0.fnode.2.after_combine.1.bn.weight": [1],
        f"cells.{last}.fnode.2.after_combine.1.bn.bias": [0],
        f"cells.{last}.fnode.3.combine.edge_weights": [0],
    }
    return mj.ParamSubset.from_indices(model, {k: torch.tensor(v) for k, v in picks.items()})


#: zoo cases whose forward-mode routes over most of their parameter tensors take seconds (one
#: vectorised forward pass per selected tensor through a deep model): the tests that run them
#: so put those combinations in the slow tier
FWD_HEAVY = {"bifpn_ragged"}

#: zoo cases that a test over the whole zoo runs in the slow tier only: the deep BiFPN takes
#: seconds per test where the other cases take tenths (the fast tier still runs it in the
#: engine's matrix, tests/test_engine.py, and in the tests that name it)
SLOW_TIER = {"bifpn_ragged"}


def _bifpn() -> nn.Module:
    m = BiFPN()
    with torch.no_grad():  # non-trivial running statistics and edge weights
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
            if isinstance(mod, FpnCombine):
                mod.edge_weights.uniform_(0.2, 1.5)
    return m


CASES: list[Case] = [
    Case(
        "seed_convblock_levels",
        _seed_convblock,
        lambda: batched_levels(3, [(3, 8, 8), (3, 7, 9)]),
        glob="conv.2.*",
    ),
    Case(
        "seed_convblock_ragged",
        _seed_convblock,
        lambda: ragged_samples([[(8, 8), (7, 7)], [(9, 7), (7, 7)], [(8, 8), (7, 7)]], [3, 3]),
        glob="conv.0.*",
        ragged=True,
        ragged_outputs=True,
        output_fn=lambda y: y.sum(dim=1),  # the user's "operation to reduce the outputs"
        padded_unsupported="Tensor.sum: a reduction over part of a flattened padded group",
    ),
    Case(
        "fpn_ragged",
        _fpn,
        lambda: ragged_samples(
            [[(4, 4), (2, 2)], [(3, 5), (2, 3)], [(4, 4), (2, 2)], [(1, 1), (1, 1)]], [3, 4]
        ),
        glob="head.*",
        ragged=True,
        ragged_outputs=True,
        padded_unsupported="F.interpolate.*size=",
    ),
    Case(
        "fpn_scale_ragged",
        _fpn_scale,
        lambda: ragged_samples(
            [
                [(4, 4), (2, 2)],
                [(6, 2), (3, 1)],
                [(4, 4), (2, 2)],
                [(2, 2), (1, 1)],
                [(2, 6), (1, 3)],
            ],
            [3, 4],
        ),
        glob="head.*",
        ragged=True,
        ragged_outputs=True,
    ),
    Case(
        "bn_cnn_multicrop",
        _bn_cnn,
        lambda: ragged_samples([[(5, 5), (3, 3)], [(6, 4), (2, 3)], [(5, 5), (3, 3)]], [3, 3]),
        glob="features.*",
        ragged=True,
    ),
    Case(
        "dense_per_pixel",
        DenseHead,
        lambda: ragged_samples([[(3, 4)], [(2, 2)], [(3, 4)], [(4, 3)], [(1, 2)]], [2]),
        glob="cls.*",
        ragged=True,
        ragged_outputs=True,
    ),
    Case("dense_tensor", DenseHead, lambda: batched_tensor(2, (2, 3, 3)), glob="body.*"),
    Case("mlp_vectors", MLP, lambda: batched_tensor(5, (5,)), glob="net.0.*"),
    Case("conv1d", Conv1dNet, lambda: batched_tensor(3, (2, 7)), glob="c2.*"),
    Case("conv3d", Conv3dNet, lambda: batched_tensor(2, (1, 3, 3, 2)), glob="c1.weight"),
    Case(
        "shared_dict_head",
        SharedDictHead,
        lambda: ragged_samples([[(3, 3), (2, 2)], [(4, 2), (1, 3)]], [2, 3]),
        glob="shared.*",
        ragged=True,
    ),
    Case("tied_weights", TiedLinear, lambda: batched_tensor(3, (4,)), glob="*.weight"),
    Case(
        "transformer_tokens",
        TinyTransformer,
        lambda: mj.pack(
            ragged_samples([[(6,)], [(4,)], [(6,)], [(1,)]], [3]),
            layout="nested",
        ),
        glob="qkv.*",
        ragged=True,
        ragged_outputs=True,
        fwd_unsupported=True,
    ),
    Case(
        "transformer_tokens_2d",
        TinyTransformer,
        lambda: mj.pack(ragged_samples([[(2, 3)], [(3, 1)], [(2, 3)]], [3]), layout="nested"),
        glob="mlp.*",
        ragged=True,
        ragged_outputs=True,
        fwd_unsupported=True,
    ),
    Case(
        "anchor_cache_head",
        AnchorCacheHead,
        lambda: ragged_samples([[(4, 4), (2, 2)], [(3, 5), (2, 3)], [(4, 4), (2, 2)]], [2, 3]),
        glob="box.*",
        ragged=True,
        ragged_outputs=True,
    ),
    Case(
        "coord_grid",
        CoordGridHead,
        lambda: ragged_samples([[(4, 5), (2, 3)], [(3, 3), (1, 2)], [(4, 5), (2, 3)]], [2, 2]),
        glob="conv.*",
        ragged=True,
    ),
    # ------------------------------------------------------------------ BiFPN (effdet)
    Case(
        "bifpn_ragged",
        _bifpn,
        lambda: bifpn_pyramids([(4, 4), (8, 4), (4, 4)]),
        glob="cells.1.fnode.*.after_combine.1.conv_pw.weight",
        ragged=True,
        ragged_outputs=True,
    ),
]

CASE_IDS = [c.id for c in CASES]

SUBSET_KINDS = ["all", "names", "elements", "flat", "mask"]


def make_subset(model: nn.Module, kind: str, case: Case, seed: int = 0) -> mj.ParamSubset:
    """A subset of the given kind; element kinds pick a few entries across several tensors."""
    g = _gen(seed)
    params = dict(model.named_parameters())
    if kind == "all":
        return mj.ParamSubset.all(model)
    if kind == "names":
        return mj.ParamSubset.from_names(model, case.glob)
    if kind == "elements":
        chosen = {}
        for n, p in list(params.items())[::2] or list(params.items()):
            k = min(3, p.numel())
            chosen[n] = torch.randperm(p.numel(), generator=g)[:k]
        # the first and last entry of the last tensor are edge cases
        last, p = list(params.items())[-1]
        chosen[last] = torch.tensor([0, p.numel() - 1]).unique()
        return mj.ParamSubset.from_indices(model, chosen)
    if kind == "flat":
        total = sum(p.numel() for p in params.values())
        return mj.ParamSubset.from_flat_indices(
            model, torch.randperm(total, generator=g)[: min(7, total)]
        )
    if kind == "mask":
        masks = {}
        for n, p in list(params.items())[:2]:
            m = torch.rand(p.shape, generator=g) < 0.4
            m.view(-1)[0] = True
            masks[n] = m
        return mj.ParamSubset.from_mask(model, masks)
    raise ValueError(kind)
