"""Models that fold a dimension into the batch (private): the zoo's folding cases and the
models :func:`multiscale_jac.testing.folding_models` draws.

A :class:`FoldingNet` takes a batch, turns it into *rows* (``R`` of them, several per sample, or
one per sample in another order), runs a body of layers on the rows, turns the rows back into a
per-sample tensor ``(N, K, E)`` and classifies it with a linear head. The fold is the point: the
body's layers see a batch whose rows are not the samples in order.

Folds (``kind``), on inputs ``(N, K, D)`` (vector bodies) or ``(N, T, C, H, W)`` / a list of
levels ``(N, C, H, W)`` (conv bodies):

* ``items``: ``x.reshape(N K, D)`` (pairs, as laplace-torch's reward-modelling example);
* ``items_minor``: the same sample-minor, ``x.transpose(0, 1).reshape(K N, D)``;
* ``perm``: ``items``, the rows permuted by a fixed permutation and put back after the body;
* ``sort``: ``items``, the rows sorted by a value of their data and put back (a permutation no
  fixed rule describes: the layer-wise routes must refuse or fall back);
* ``token``: a learned token expanded over the batch and put in front of every sample's items;
  the body runs on every position, then an attention over each sample's positions;
* ``mix``: ``items`` with the batch mean subtracted after the body (samples mixed: routes that
  run batches must refuse or fall back);
* ``plain``: the body on ``(N, K, D)`` as it is;
* ``frames``: ``(N, T, C, H, W) -> (N T, C, H, W)``; ``frames_minor``: the same sample-minor;
* ``levels``: same-size levels ``torch.cat(levels, 0)``, split back after the body;
* ``stack``: the levels ``torch.stack(levels, 1).flatten(0, 1)``;
* ``tta``: a map and its mirror image ``torch.cat([x, x.flip(-1)], 0)``.

Bodies: ``linear`` (Linear, tanh, Linear), ``linear_ln`` (with a LayerNorm), ``conv`` (Conv2d,
tanh, Conv2d), ``conv_gn`` (with a GroupNorm), ``conv_bn`` (with a BatchNorm in eval mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["CONV_FOLDS", "VECTOR_FOLDS", "FoldingNet"]

VECTOR_FOLDS = ("items", "items_minor", "perm", "sort", "token", "mix", "plain")
CONV_FOLDS = ("frames", "frames_minor", "levels", "stack", "tta")
VECTOR_BODIES = ("linear", "linear_ln")
CONV_BODIES = ("conv", "conv_gn", "conv_bn")


def _body(body: str, d: int, e: int) -> nn.Sequential:
    if body == "linear":
        return nn.Sequential(nn.Linear(d, e), nn.Tanh(), nn.Linear(e, e))
    if body == "linear_ln":
        return nn.Sequential(nn.Linear(d, e), nn.LayerNorm(e), nn.Tanh(), nn.Linear(e, e))
    norm: nn.Module = nn.Identity()
    if body == "conv_gn":
        norm = nn.GroupNorm(1, e)
    elif body == "conv_bn":
        norm = nn.BatchNorm2d(e)
        with torch.no_grad():  # running statistics that are not the identity
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 1.5)
    elif body != "conv":
        raise ValueError(f"unknown body {body!r}")
    return nn.Sequential(nn.Conv2d(d, e, 3, padding=1), norm, nn.Tanh(), nn.Conv2d(e, e, 1))


class FoldingNet(nn.Module):
    """A body of layers run on the rows of a folded batch (module docstring).

    Args:
        kind: The fold (``VECTOR_FOLDS`` or ``CONV_FOLDS``).
        body: ``linear``/``linear_ln`` for vector folds, ``conv``/``conv_gn``/``conv_bn``
            for conv folds.
        items: ``K``: items, frames or levels per sample (2 for ``tta``).
        features: ``D`` (vector) or the input channels ``C`` (conv).
        width: ``E``, the body's width.
        classes: Outputs of the head.
        pool: ``mean`` over the items before the head, or ``flat`` (concatenated).
    """

    def __init__(
        self,
        kind: str,
        body: str,
        *,
        items: int = 2,
        features: int = 3,
        width: int = 4,
        classes: int = 3,
        pool: str = "mean",
    ) -> None:
        super().__init__()
        conv = kind in CONV_FOLDS
        if kind not in VECTOR_FOLDS + CONV_FOLDS:
            raise ValueError(f"unknown fold {kind!r}")
        if (body in CONV_BODIES) != conv:
            raise ValueError(f"fold {kind!r} takes a {'conv' if conv else 'vector'} body")
        self.kind, self.items, self.pool = kind, (2 if kind == "tta" else items), pool
        self.body = _body(body, features, width)
        if kind == "token":
            self.token = nn.Parameter(torch.randn(1, 1, features) * 0.5)
        head_in = width * (self.items + (kind == "token")) if pool == "flat" else width
        self.head = nn.Linear(head_in, classes)

    def forward(self, x: Tensor | Sequence[Tensor]) -> Tensor:
        rows = self._items(x)  # (N, K', E)
        return self.head(rows.flatten(1) if self.pool == "flat" else rows.mean(1))

    def _items(self, x: Any) -> Tensor:
        kind = self.kind
        if kind in CONV_FOLDS:
            return self._conv_items(x)
        n, k, d = x.shape
        if kind == "plain":
            return self.body(x)
        if kind == "token":
            h = self.body(torch.cat([self.token.expand(n, 1, d), x], 1))  # (N, K + 1, E)
            att = torch.softmax(h @ h.transpose(1, 2) / h.shape[-1] ** 0.5, -1)
            return att @ h
        if kind == "items_minor":
            h = self.body(x.transpose(0, 1).reshape(k * n, d))
            return h.reshape(k, n, -1).transpose(0, 1)
        rows = x.reshape(n * k, d)
        if kind in ("perm", "sort"):
            if kind == "perm":  # odd rows first, then even, reversed: a fixed permutation
                idx = torch.arange(n * k, device=x.device)
                order = torch.cat([idx[1::2], idx[0::2]]).flip(0)
            else:  # by a value of the data: no fixed rule says where a row goes
                order = torch.argsort(rows.detach().sum(-1))
            h = self.body(rows[order])[torch.argsort(order)]
        else:
            h = self.body(rows)
            if kind == "mix":
                h = h - h.mean(0)
        return h.reshape(n, k, -1)

    def _conv_items(self, x: Any) -> Tensor:
        kind = self.kind
        if kind in ("levels", "stack"):
            levels = list(x)
            n = levels[0].shape[0]
            if kind == "levels":
                h = self._pooled(torch.cat(levels, 0))  # (L N, E), level-major
                return h.reshape(len(levels), n, -1).transpose(0, 1)
            h = self._pooled(torch.stack(levels, 1).flatten(0, 1))  # sample-major
            return h.reshape(n, len(levels), -1)
        if kind == "tta":
            n = x.shape[0]
            h = self._pooled(torch.cat([x, x.flip(-1)], 0))
            return h.reshape(2, n, -1).transpose(0, 1)
        n, t = x.shape[:2]
        if kind == "frames":
            return self._pooled(x.flatten(0, 1)).reshape(n, t, -1)
        h = self._pooled(x.transpose(0, 1).flatten(0, 1))  # frames_minor
        return h.reshape(t, n, -1).transpose(0, 1)

    def _pooled(self, rows: Tensor) -> Tensor:
        return self.body(rows).mean((2, 3))


def folding_inputs(
    model: FoldingNet, n: int, *, features: int, size: int, generator: torch.Generator
) -> Any:
    """A batch of ``n`` samples for ``model`` (float64)."""
    kw = {"generator": generator, "dtype": torch.float64}
    k = model.items
    if model.kind in VECTOR_FOLDS:
        return torch.randn(n, k, features, **kw)
    if model.kind in ("levels", "stack"):
        return [torch.randn(n, features, size, size, **kw) for _ in range(k)]
    if model.kind == "tta":
        return torch.randn(n, features, size, size, **kw)
    return torch.randn(n, k, features, size, size, **kw)
