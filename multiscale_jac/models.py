"""Small built-in models for the demo, examples, benchmarks and tests.

Nothing here is needed to use the library; the engine works on any ``nn.Module``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ConvBlock", "SharedHeadFPN", "TinyFPN"]


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
