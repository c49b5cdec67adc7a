"""The posterior's forms: ``P_post = factor * H + diag(p_0)`` held full or diagonal.

A form (:class:`PosteriorForm`) is the structure of the posterior precision: it turns the
curvature in its own layout, the factor ``1 / (sigma^s T)`` and the ``(P,)`` prior diagonal
(:class:`PrecisionTerms`) into the precision, its log-determinant, a scale (the factor that
whitens Jacobian rows and draws samples, cached by the caller), the marginal variances and the
bytes it keeps. :class:`FullForm` (``(P, P)``, a Cholesky factor) and :class:`DiagForm`
(``(P,)``) are the two here; a Kronecker-factored form (K-FAC: per-layer factors and their
eigendecompositions) implements the same protocol beside them, with ``H`` its factors.

:class:`Posterior` is the mixin that answers a Laplace class's posterior calls
(``posterior_precision``, ``posterior_scale``, ...) through the class's ``form``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from torch import Tensor

from .._memory import laplace_kept
from ..enums import HessianKind, Likelihood
from ..subset import ParamSubset
from ._base import LaplaceBase

__all__ = [
    "DiagForm",
    "FullForm",
    "NotPositiveDefinite",
    "Posterior",
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


class Posterior(LaplaceBase):
    """The posterior calls of a Laplace class, answered by its ``form`` from the fitted
    curvature ``H``, the prior precision, ``sigma_noise`` and the temperature."""

    #: the structure of the posterior precision (set by each Laplace class)
    form: ClassVar[PosteriorForm]

    def _factor(self, sigma: Tensor | float) -> Tensor | float:
        """``1 / (sigma^s T)``: ``s = 4`` for a regression's empirical Fisher, else 2; with a
        laplace-torch EF backend named (``backend=``) a regression's empirical Fisher takes
        laplace-torch's convention, ``2 / (sigma^2 T)`` (its curvature is twice the textbook
        value and divided by ``sigma^2``), so the posterior's numbers are laplace-torch's."""
        if self.hessian is HessianKind.EMPIRICAL and self.likelihood is Likelihood.REGRESSION:
            if self._backend_name is not None:
                return 2.0 / (sigma**2 * self.temperature)
            return 1.0 / (sigma**4 * self.temperature)
        return 1.0 / (sigma**2 * self.temperature)

    def _terms(self, prior_precision: Any = None, sigma_noise: Any = None) -> PrecisionTerms:
        """``P_post``'s terms at a prior precision and a noise (``None``: the stored ones)."""
        h = self._fitted()
        prior = self._prior(prior_precision)
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        return PrecisionTerms(h, self._factor(sigma), prior)

    def posterior_precision_matrix(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Tensor:
        """``P_post`` in the form's layout: ``(P, P)`` (:class:`SubnetLaplace`), its diagonal
        ``(P,)`` (:class:`DiagLaplace`); differentiable in tensor-valued arguments."""
        return self.form.precision(self._terms(prior_precision, sigma_noise))

    @property
    def posterior_precision(self) -> Tensor:
        """``P_post`` at the current prior precision and noise, in the form's layout."""
        return self.posterior_precision_matrix()

    @property
    def posterior_scale(self) -> Tensor:
        """The scale of ``Sigma``, cached: the lower Cholesky factor ``L`` of ``P_post``
        (``Sigma = L^{-T} L^{-1}``; :class:`SubnetLaplace`) or ``diag(Sigma)^(1/2)`` ``(P,)``
        (:class:`DiagLaplace`)."""
        if self._scale is None:
            self._scale = self.form.scale(self._terms())
        return self._scale

    @property
    def posterior_covariance(self) -> Tensor:
        """``Sigma = P_post^{-1}`` as a dense ``(P, P)`` matrix (:class:`DiagLaplace`: for small
        ``P`` only)."""
        return self.form.covariance(self._terms(), lambda: self.posterior_scale)

    @property
    def posterior_variance(self) -> Tensor:
        """``diag(Sigma)`` ``(P,)``."""
        return self.form.variance(self._terms(), lambda: self.posterior_scale)

    def _posterior_logdet(self, prior: Tensor, sigma_noise: Any) -> Tensor:
        """``log det P_post`` at a ``(P,)`` prior and a noise (differentiable in both)."""
        return self.form.logdet(self._terms(prior, sigma_noise))

    def _whiten(self, jac: Tensor) -> Tensor:
        """``V`` ``(P, rows)`` with ``V^T V = J Sigma J^T`` for Jacobian rows ``jac``."""
        return self.form.whiten(self.posterior_scale, jac)

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J Sigma J^T`` per sample, ``(N, O, O)``, for Jacobians ``Js`` ``(N, O, P)`` over
        this posterior's entries (laplace-torch's call)."""
        v = self._whitened(Js)  # (N, P, O)
        return v.transpose(1, 2) @ v

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """``J Sigma J^T`` across samples, ``(N O, N O)`` (sample-major), for ``Js``
        ``(N, O, P)`` (laplace-torch's call)."""
        v = self._whitened(Js)
        flat = v.transpose(0, 1).reshape(v.shape[1], -1)  # (P, N O)
        return flat.T @ flat

    def _whitened(self, js: Tensor) -> Tensor:
        if not isinstance(js, Tensor) or js.dim() != 3 or js.shape[-1] != self.subset.numel:
            what = tuple(js.shape) if isinstance(js, Tensor) else type(js).__name__
            raise ValueError(f"Js must be (N, O, P={self.subset.numel}); got {what}")
        return torch.stack([self._whiten(j.to(self.mean)) for j in js])

    def _draw(self, z: Tensor) -> Tensor:
        """Standard normals ``z`` ``(P, S)`` -> draws ``(P, S)`` from ``N(0, Sigma)``."""
        return self.form.draw(self.posterior_scale, z)

    def _kept_bytes(self) -> int:
        """Bytes of what the posterior keeps: the curvature and its scale."""
        return self.form.kept_bytes(self.subset, self.mean.element_size())
