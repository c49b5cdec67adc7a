"""Small built-in models for the demo, examples, benchmarks and tests.

Nothing here is needed to use the library; the engine works on any ``nn.Module``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ConvBlock", "MultiBranchNet", "SharedHeadFPN", "TinyFPN"]


class ConvBlock(nn.Module):
    """A multi-scale conv block as users write it (one conv stack over a list of feature maps).

    Three 3x3 convs (no padding) applied to every feature map of a list; each level's output is
    viewed as ``(batch_size, -1, 8)`` and the levels are concatenated (``out_ch * H * W`` must
    be divisible by 8). Input: a list of ``(B, in_ch, H_l, W_l)``; output
    ``(B, sum_l out_ch (H_l - 6) (W_l - 6) / 8, 8)``.
    """

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_ch, in_ch, 3, 1),
            nn.Conv2d(in_ch, in_ch, 3, 1),
            nn.Conv2d(in_ch, out_ch, 3, 1),
        )

    def forward(self, x_list: Sequence[Tensor]) -> Tensor:
        batch_size = x_list[0].shape[0]
        final_out = [self.conv(x).view(batch_size, -1, 8) for x in x_list]
        return torch.cat(final_out, dim=1)


class TinyFPN(nn.Module):
    """A small FPN/RetinaNet-style network over a list of backbone feature maps.

    * lateral 1x1 convs on every input level ``C_l`` (channels ``in_channels[l]``);
    * top-down pathway: nearest upsampling of the coarser level, added to the lateral. With
      ``upsample="size"`` (torchvision's choice) it is resized to the lateral's size, which works
      for any level sizes; with ``upsample="scale"`` it is upsampled by 2, which needs every
      level to be exactly half the one before (images padded to a multiple of the largest
      stride, as detection pipelines do) and is what masked (padded) execution can run exactly;
    * bottom-up strided 3x3 convs from the coarsest input that add ``extra_levels`` levels;
    * one shared head (3x3 conv, ReLU, 3x3 conv to ``num_outputs`` channels) applied to every
      pyramid level; per-level outputs ``(B, num_outputs * H * W)`` are concatenated.

    Input: a list of ``(B, C_l, H_l, W_l)`` (any sizes, finest first). Output:
    ``(B, num_outputs * sum over pyramid levels of H * W)``, so its size follows the input.
    """

    def __init__(
        self,
        in_channels: Sequence[int] = (8, 16),
        width: int = 16,
        num_outputs: int = 4,
        extra_levels: int = 1,
        upsample: str = "size",
    ) -> None:
        super().__init__()
        if upsample not in ("size", "scale"):
            raise ValueError(f"upsample must be 'size' or 'scale'; got {upsample!r}")
        self.upsample = upsample
        self.lateral = nn.ModuleList(nn.Conv2d(c, width, 1) for c in in_channels)
        self.extra = nn.ModuleList(
            nn.Conv2d(in_channels[-1] if k == 0 else width, width, 3, stride=2, padding=1)
            for k in range(extra_levels)
        )
        self.head = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, num_outputs, 3, padding=1),
        )

    def forward(self, feats: Sequence[Tensor]) -> Tensor:
        laterals = [conv(x) for conv, x in zip(self.lateral, feats)]
        pyramid = [laterals[-1]]
        for lat in reversed(laterals[:-1]):
            resize = {"size": lat.shape[-2:]} if self.upsample == "size" else {"scale_factor": 2}
            pyramid.insert(0, lat + F.interpolate(pyramid[0], mode="nearest", **resize))
        x = feats[-1]
        for k, conv in enumerate(self.extra):
            x = conv(x if k == 0 else F.relu(x))
            pyramid.append(x)
        return torch.cat([self.head(p).flatten(1) for p in pyramid], dim=1)


class SharedHeadFPN(nn.Module):
    """A RetinaNet/FCOS-style head shared by every pyramid level.

    Lateral 1x1 convs bring every input level to ``width`` channels; one tower (``depth`` times
    3x3 conv, GroupNorm, ReLU, then a 3x3 conv to ``num_outputs``) runs on every level through
    :func:`multiscale_jac.map_levels` (``packing="canvas"``: one call on a canvas of all levels;
    ``"loop"``: the usual list comprehension; ``"auto"``: by device). Output: the per-level maps flattened and
    concatenated, ``(B, num_outputs * sum_l H_l W_l)``.
    """

    def __init__(
        self,
        in_channels: Sequence[int] = (8, 8, 8),
        width: int = 8,
        num_outputs: int = 4,
        depth: int = 2,
        packing: str = "auto",
    ) -> None:
        super().__init__()
        self.packing = packing
        self.lateral = nn.ModuleList(nn.Conv2d(c, width, 1) for c in in_channels)
        tower: list[nn.Module] = []
        for _ in range(depth):
            tower += [nn.Conv2d(width, width, 3, padding=1), nn.GroupNorm(2, width), nn.ReLU()]
        self.head = nn.Sequential(*tower, nn.Conv2d(width, num_outputs, 3, padding=1))

    def forward(self, feats: Sequence[Tensor]) -> Tensor:
        from .levels import map_levels

        laterals = [conv(x) for conv, x in zip(self.lateral, feats)]
        outs = map_levels(self.head, laterals, packing=self.packing)
        return torch.cat([o.flatten(1) for o in outs], dim=1)


class _Branch(nn.Module):
    """Residual blocks of two 3x3 convs with GroupNorm, at one resolution."""

    def __init__(self, ch: int, blocks: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(ch, ch, 3, padding=1) for _ in range(2 * blocks))
        self.norms = nn.ModuleList(nn.GroupNorm(4, ch) for _ in range(2 * blocks))

    def forward(self, x: Tensor) -> Tensor:
        for i in range(0, len(self.convs), 2):
            h = F.relu(self.norms[i](self.convs[i](x)))
            x = F.relu(x + self.norms[i + 1](self.convs[i + 1](h)))
        return x


class _Fuse(nn.Module):
    """Every branch into every other: a 1x1 conv and nearest upsampling from a coarser one,
    strided 3x3 convs from a finer one, summed."""

    def __init__(self, chans: Sequence[int]) -> None:
        super().__init__()
        self.ops = nn.ModuleDict()
        for i, ci in enumerate(chans):
            for j, cj in enumerate(chans):
                if j > i:
                    self.ops[f"{j}to{i}"] = nn.Conv2d(cj, ci, 1)
                elif j < i:
                    steps = [
                        nn.Conv2d(cj if k == 0 else ci, ci, 3, stride=2, padding=1)
                        for k in range(i - j)
                    ]
                    self.ops[f"{j}to{i}"] = nn.Sequential(*steps)

    def forward(self, xs: list[Tensor]) -> list[Tensor]:
        out = []
        for i, y in enumerate(xs):
            for j, x in enumerate(xs):
                if j != i:
                    z = self.ops[f"{j}to{i}"](x)
                    if j > i:
                        z = F.interpolate(z, size=y.shape[-2:], mode="nearest")
                    y = y + z
            out.append(F.relu(y))
        return out


class MultiBranchNet(nn.Module):
    """An HRNet-style backbone: parallel branches at three resolutions (``ch``, ``2 ch``,
    ``4 ch`` channels), exchanged by fuse layers after each of ``stages`` stages, and a
    low-dimensional readout (global average pooling of every branch, one linear layer).

    Input ``(B, 3, H, W)`` (``H, W`` divisible by 8); output ``(B, outputs)``.
    """

    def __init__(self, ch: int = 16, outputs: int = 10, stages: int = 3, blocks: int = 2) -> None:
        super().__init__()
        chans = [ch, 2 * ch, 4 * ch]
        self.stem = nn.Conv2d(3, ch, 3, stride=2, padding=1)
        self.down = nn.ModuleList(
            nn.Conv2d(chans[k], chans[k + 1], 3, stride=2, padding=1) for k in range(2)
        )
        self.branches = nn.ModuleList(
            nn.ModuleList(_Branch(c, blocks) for c in chans) for _ in range(stages)
        )
        self.fuses = nn.ModuleList(_Fuse(chans) for _ in range(stages))
        self.head = nn.Linear(sum(chans), outputs)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.stem(x))
        xs = [x]
        for down in self.down:
            xs.append(F.relu(down(xs[-1])))
        for branch, fuse in zip(self.branches, self.fuses, strict=True):
            xs = fuse([b(t) for b, t in zip(branch, xs, strict=True)])
        return self.head(torch.cat([t.mean((-2, -1)) for t in xs], -1))
