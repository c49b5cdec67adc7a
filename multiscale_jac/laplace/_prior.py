"""The prior ``N(mu_0, diag(p_0))`` over a subset: its precision as given (one value, one per
selected tensor or one per entry) and its mean, checked and expanded to the ``(P,)`` diagonal."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..enums import ArgumentTypeError
from ..subset import ParamSubset

__all__ = ["Prior"]


class Prior:
    """The prior precision (``(1,)``, ``(K,)`` per selected tensor or ``(P,)``) and mean
    ``(P,)`` of a posterior over ``subset``.

    Args:
        subset: The entries.
        like: A tensor of the dtype and device the prior takes.
        precision: Any form :meth:`form` accepts.
        mean: A number or ``(P,)``.
        per_tensor: Refuse a per-entry precision (a Kronecker-factored posterior's rule).
    """

    def __init__(
        self,
        subset: ParamSubset,
        like: Tensor,
        precision: Any,
        mean: Any,
        *,
        per_tensor: bool = False,
    ) -> None:
        self._subset = subset
        self._dtype, self._device = like.dtype, like.device
        self._per_tensor = per_tensor
        self._mean = self.vector(mean, "prior_mean", positive=False)
        self._precision = self._restricted(self.form(precision, "prior_precision", True))

    @property
    def precision(self) -> Tensor:
        """The precision as given: ``(1,)``, ``(K,)`` or ``(P,)`` (differentiable)."""
        return self._precision

    @property
    def mean(self) -> Tensor:
        """``mu_0`` ``(P,)``."""
        return self._mean

    @property
    def diag(self) -> Tensor:
        """The precision expanded to the ``(P,)`` diagonal ``p_0``."""
        return self.expand(self._precision)

    def set_precision(self, value: Any) -> None:
        """Store a new precision (any form :meth:`form` accepts), checked."""
        self._precision = self._restricted(self.form(value, "prior_precision", True))

    def set_mean(self, value: Any) -> None:
        """Store a new mean (a number or ``(P,)``), checked."""
        self._mean = self.vector(value, "prior_mean", positive=False)

    def at(self, precision: Any) -> Tensor:
        """The ``(P,)`` diagonal at ``precision`` (``None``: the stored one)."""
        if precision is None:
            return self.diag
        return self.vector(precision, "prior_precision", positive=True)

    def vector(self, value: Any, what: str, positive: bool) -> Tensor:
        """A number, ``(P,)``, one value per selected tensor (sequence or dict) -> ``(P,)``."""
        return self.expand(self.form(value, what, positive))

    def form(self, value: Any, what: str, positive: bool) -> Tensor:
        """A number, ``(P,)``, one value per selected tensor (sequence or dict), checked, as a
        1-d tensor of 1, ``K`` (selected tensors) or ``P`` values (differentiable)."""
        p, names = self._subset.numel, self._subset.names
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in names]
            missing = [k for k in names if k not in value]
            if unknown or missing:
                raise ValueError(
                    f"{what}: keys must be the selected tensors {list(names)}; unknown "
                    f"{unknown}, missing {missing}"
                )
            value = [value[k] for k in names]
        if isinstance(value, bool) or not isinstance(value, (int, float, Tensor, list, tuple)):
            raise ArgumentTypeError(
                f"{what} must be a number, a tensor or a sequence; got {value!r}"
            )
        t = (
            torch.as_tensor(value, dtype=self._dtype, device=self._device)
            if not isinstance(value, Tensor)
            else value.to(dtype=self._dtype, device=self._device)
        )
        if t.dim() > 1 or t.numel() not in (1, p, len(names)):
            raise ValueError(
                f"{what} must be a number, P={p} values or one per selected tensor "
                f"({len(names)}); got shape {tuple(t.shape)}"
            )
        if positive and not bool((t.detach() > 0).all()):
            raise ValueError(f"{what} must be positive; got {value!r}")
        return t.reshape(-1)

    def expand(self, t: Tensor) -> Tensor:
        """A checked 1-d form (:meth:`form`) -> the ``(P,)`` diagonal in flat order."""
        p = self._subset.numel
        if t.numel() == p:
            return t
        if t.numel() == 1:
            return t.reshape(()).expand(p)
        sizes = [b - a for a, b in self._subset.offsets.values()]
        return self._subset.to_flat_order(
            torch.repeat_interleave(t, torch.tensor(sizes, device=t.device))
        )

    def _restricted(self, t: Tensor) -> Tensor:
        k = len(self._subset.names)
        if self._per_tensor and t.numel() not in (1, k):
            raise ValueError(
                f"a Kronecker-factored posterior takes one prior precision or one per "
                f"selected tensor ({k}); got {t.numel()} values"
            )
        return t
