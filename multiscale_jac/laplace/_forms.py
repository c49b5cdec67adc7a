"""The posterior's forms: ``P_post = factor * H + diag(p_0)`` held full or diagonal.

A form (:class:`PosteriorForm`) is the structure of the posterior precision: it turns the
curvature in its own layout, the factor ``1 / (sigma^s T)`` and the ``(P,)`` prior diagonal
(:class:`PrecisionTerms`) into the precision, its log-determinant, a scale (the factor that
whitens Jacobian rows and draws samples, cached by the caller), the marginal variances and the
bytes it keeps. :class:`FullForm` (``(P, P)``, a Cholesky factor) and :class:`DiagForm`
(``(P,)``) are the two here; a Kronecker-factored form (K-FAC: per-layer factors and their
eigendecompositions) implements the same protocol beside them, with ``H`` its factors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from .._memory import laplace_kept
from ..subset import ParamSubset

__all__ = [
    "DiagForm",
    "FullForm",
    "NotPositiveDefinite",
    "PosteriorForm",
    "PrecisionTerms",
    "cholesky",
]


class NotPositiveDefinite(ValueError):
    """The posterior precision has no Cholesky factor."""


def cholesky(mat: Tensor) -> Tensor:
    """The lower Cholesky factor of ``mat``; :class:`NotPositiveDefinite` without one."""
    chol, info = torch.linalg.cholesky_ex(mat)
    if int(info) != 0:
        raise NotPositiveDefinite(
            "the posterior precision is not positive definite (leading minor "
            f"{int(info)}); increase prior_precision"
        )
    return chol


class PrecisionTerms(NamedTuple):
    """``P_post = factor * h + diag(prior)``: the curvature ``h`` in the form's layout, the
    factor ``1 / (sigma^s T)`` and the prior precision's ``(P,)`` diagonal (tensors that
    require grad keep the graph)."""

    h: Any
    factor: Tensor | float
    prior: Tensor


class PosteriorForm(Protocol):
    """The structure of the posterior precision (the seam for another one, such as K-FAC's
    Kronecker factors). ``scale`` arguments are what :meth:`scale` returned, cached by the
    caller; ``scale`` callables compute it on demand (a form that does not need it never
    calls them)."""

    def precision(self, terms: PrecisionTerms) -> Any:
        """``P_post`` in the form's layout."""
        ...

    def scale(self, terms: PrecisionTerms) -> Any:
        """The factor ``S`` of ``Sigma = P_post^{-1}`` that whitens and draws (cached by the
        caller); raises :class:`NotPositiveDefinite` where there is none."""
        ...

    def logdet(self, terms: PrecisionTerms) -> Tensor:
        """``log det P_post`` (differentiable in the terms)."""
        ...

    def variance(self, terms: PrecisionTerms, scale: Callable[[], Any]) -> Tensor:
        """``diag(Sigma)``, ``(P,)``."""
        ...

    def covariance(self, terms: PrecisionTerms, scale: Callable[[], Any]) -> Tensor:
        """``Sigma`` as a dense ``(P, P)`` matrix."""
        ...

    def whiten(self, scale: Any, jac: Tensor) -> Tensor:
        """``V`` ``(P, rows)`` with ``V^T V = J Sigma J^T`` for Jacobian rows ``jac``."""
        ...

    def draw(self, scale: Any, z: Tensor) -> Tensor:
        """Standard normals ``z`` ``(P, S)`` -> draws ``(P, S)`` from ``N(0, Sigma)``."""
        ...

    def kept_bytes(self, subset: ParamSubset, itemsize: int) -> int:
        """Bytes of what the posterior keeps (the curvature and its scale) over ``subset``."""
        ...


class FullForm:
    """``P_post`` ``(P, P)``; the scale is its lower Cholesky factor ``L`` (``Sigma = L^{-T}
    L^{-1}``)."""

    def precision(self, terms: PrecisionTerms) -> Tensor:
        return terms.h * terms.factor + torch.diag_embed(terms.prior)

    def scale(self, terms: PrecisionTerms) -> Tensor:
        return cholesky(self.precision(terms))

    def logdet(self, terms: PrecisionTerms) -> Tensor:
        return 2 * cholesky(self.precision(terms)).diagonal().log().sum()

    def variance(self, terms: PrecisionTerms, scale: Callable[[], Tensor]) -> Tensor:
        return self.covariance(terms, scale).diagonal()

    def covariance(self, terms: PrecisionTerms, scale: Callable[[], Tensor]) -> Tensor:
        return torch.cholesky_inverse(scale())

    def whiten(self, scale: Tensor, jac: Tensor) -> Tensor:
        return torch.linalg.solve_triangular(scale, jac.T, upper=False)

    def draw(self, scale: Tensor, z: Tensor) -> Tensor:
        return torch.linalg.solve_triangular(scale.T, z, upper=True)

    def kept_bytes(self, subset: ParamSubset, itemsize: int) -> int:
        return laplace_kept("full", subset.numel, itemsize)


class DiagForm:
    """``P_post``'s diagonal ``(P,)``; the scale is ``diag(Sigma)^(1/2)``."""

    def precision(self, terms: PrecisionTerms) -> Tensor:
        return terms.h * terms.factor + terms.prior

    def scale(self, terms: PrecisionTerms) -> Tensor:
        return self.precision(terms).rsqrt()

    def logdet(self, terms: PrecisionTerms) -> Tensor:
        return self.precision(terms).log().sum()

    def variance(self, terms: PrecisionTerms, scale: Callable[[], Tensor]) -> Tensor:
        return 1 / self.precision(terms)

    def covariance(self, terms: PrecisionTerms, scale: Callable[[], Tensor]) -> Tensor:
        return torch.diag(self.variance(terms, scale))

    def whiten(self, scale: Tensor, jac: Tensor) -> Tensor:
        return (jac * scale).T

    def draw(self, scale: Tensor, z: Tensor) -> Tensor:
        return scale.unsqueeze(1) * z

    def kept_bytes(self, subset: ParamSubset, itemsize: int) -> int:
        return laplace_kept("diag", subset.numel, itemsize)
