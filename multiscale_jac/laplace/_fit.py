"""What a curvature hands the posterior: one fit signature for the subset GGN, the diagonal and
the Kronecker factors (:class:`Curvature`), and the record of one pass over the data
(:class:`CurvatureFit`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import torch

from ..enums import Likelihood

__all__ = ["Curvature", "CurvatureFit", "refuse_unsupported"]


class CurvatureFit(NamedTuple):
    """One pass over the data: the curvature ``h`` in its form's layout, the negative
    log-likelihood at the MAP (``sigma = 1``), the samples, the regression output entries seen
    (the marginal likelihood's ``n_out``; 0 for classification) and ``n_outputs``
    (laplace-torch's: classes or regression outputs, dim 1 of the output)."""

    h: Any
    loss: float
    n_data: int
    n_entries: int
    n_outputs: int | None


class Curvature(Protocol):
    """A curvature over the data, in its form's layout (``(P, P)``, ``(P,)`` or Kronecker
    factors). Every one takes the same :meth:`fit` arguments; one that cannot honour an
    argument refuses it by name (:func:`refuse_unsupported`)."""

    def fit(
        self,
        data: Iterable[tuple[Any, Any]],
        likelihood: Likelihood,
        *,
        progress: bool,
        process_group: Any,
        max_outputs_per_sample: int | None,
        generator: torch.Generator | None,
    ) -> CurvatureFit:
        """One pass over ``data`` (``(inputs, targets)`` pairs)."""
        ...

    def combine(self, old: CurvatureFit, new: CurvatureFit) -> Any:
        """The curvature of ``old`` and ``new`` together (``fit(..., override=False)``)."""
        ...

    def zeros(self, like: torch.Tensor) -> Any:
        """The curvature before any fit: zeros in the form's layout (laplace-torch's)."""
        ...

    def h_state(self, h: Any) -> Any:
        """``h`` as plain values (tensors, lists) for ``state_dict``."""
        ...

    def h_from_state(self, value: Any, like: torch.Tensor) -> Any:
        """:meth:`h_state`'s inverse on ``like``'s dtype and device, its shape checked."""
        ...


def refuse_unsupported(what: str, **given: Any) -> None:
    """A ``ValueError`` naming the fit arguments ``what`` cannot honour that were given (not
    ``None``)."""
    bad = {k: v for k, v in given.items() if v is not None}
    if bad:
        names = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        raise ValueError(f"{what}'s fit does not take {names} (SubnetLaplace's fit does)")
