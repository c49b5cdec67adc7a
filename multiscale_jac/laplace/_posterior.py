"""The posterior ``N(theta_MAP, Sigma)``: a form, a prior, the noise and temperature, and the
record of the fits; ``P_post = H / (sigma^s T) + diag(p_0)`` and what follows from it (scale,
covariance, log-determinant, whitening, draws, the log marginal likelihood).

:class:`Posterior` owns this state; a Laplace class holds one and answers laplace-torch's
calls through it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from .._checks import check_bool, check_noise, check_positive_number
from ..enums import HessianKind, Likelihood, parse_enum
from ..subset import ParamSubset
from ._fit import CurvatureFit
from ._forms import PosteriorForm, PrecisionTerms
from ._prior import Prior

__all__ = ["REWARD_MODELING", "Posterior"]

#: laplace-torch's likelihood for preference learning: a classification of the pair's rewards
#: ``(N, 2)`` in the fit, a regression of one reward ``(N, 1)`` in the predictive
REWARD_MODELING = "reward_modeling"


class Posterior:
    """A Gaussian posterior over ``subset``'s entries and the record of its fits.

    Args:
        owner: The Laplace class's name (for messages).
        subset: The entries.
        form: The structure of ``P_post``.
        prior: The prior.
        theta: The MAP ``(P,)`` (the model's values of the subset).
        likelihood: ``classification``, ``regression`` or ``"reward_modeling"``.
        hessian: ``ggn`` or ``empirical`` (the factor's power of ``sigma``).
        backend_name: A laplace-torch backend named by the caller (its factor convention).
        sigma_noise: The noise scale.
        temperature: ``T``.
    """

    def __init__(
        self,
        owner: str,
        subset: ParamSubset,
        form: PosteriorForm,
        prior: Prior,
        theta: Tensor,
        *,
        likelihood: Any,
        hessian: HessianKind,
        backend_name: str | None,
        sigma_noise: Any,
        temperature: Any,
    ) -> None:
        self._owner, self._subset, self._form, self._prior = owner, subset, form, prior
        self._map = theta
        self._hessian, self._backend_name = hessian, backend_name
        self._scale: Any = None
        self.set_likelihood(likelihood)
        self._temperature = check_positive_number(temperature, "temperature")
        self.set_sigma_noise(sigma_noise)
        #: the prior mean until a fit (an unfitted posterior is the prior), the MAP after
        self._mean = prior.mean.detach().clone()
        self._h: Any = None
        self._loss, self._n_data, self._n_entries = 0.0, 0, 0
        self._n_outputs: int | None = None

    # ------------------------------------------------------------------ state
    @property
    def likelihood(self) -> Likelihood:
        """The likelihood (``reward_modeling``: classification in a fit, regression else)."""
        return self._likelihood

    @property
    def reward_modeling(self) -> bool:
        """Built with laplace-torch's ``"reward_modeling"``."""
        return self._reward

    def set_likelihood(self, value: Any) -> None:
        """``classification``, ``regression`` or laplace-torch's ``"reward_modeling"``."""
        reward = value == REWARD_MODELING
        try:
            parsed = (
                Likelihood.REGRESSION if reward else parse_enum(Likelihood, value, "likelihood")
            )
        except ValueError as err:
            raise ValueError(f"{err}, or {REWARD_MODELING!r} (laplace-torch's)") from None
        self._reward, self._likelihood, self._scale = reward, parsed, None

    @property
    def sigma_noise(self) -> Tensor:
        """The noise scale, a 0-d tensor."""
        return self._sigma_noise

    def set_sigma_noise(self, value: Any) -> None:
        """A number or a tensor (kept as it is, e.g. one that requires grad); 1 for
        classification."""
        noise = check_noise(value, "sigma_noise")
        if self._likelihood is Likelihood.CLASSIFICATION and float(noise) != 1.0:
            raise ValueError(f"sigma_noise must be 1 for classification; got {value!r}")
        if not isinstance(noise, Tensor):
            noise = torch.tensor(noise, dtype=self._map.dtype, device=self._map.device)
        self._sigma_noise, self._scale = noise, None

    @property
    def temperature(self) -> float:
        """``T``."""
        return self._temperature

    def set_temperature(self, value: Any) -> None:
        """A positive number."""
        self._temperature, self._scale = check_positive_number(value, "temperature"), None

    @property
    def subset(self) -> ParamSubset:
        """The entries."""
        return self._subset

    @property
    def form(self) -> PosteriorForm:
        """The structure of ``P_post``."""
        return self._form

    @property
    def prior(self) -> Prior:
        """The prior (change it through :meth:`set_prior_precision`, :meth:`set_prior_mean`)."""
        return self._prior

    def set_prior_precision(self, value: Any) -> None:
        """Any form :class:`Prior` takes; the cached scale is recomputed."""
        self._prior.set_precision(value)
        self._scale = None

    def set_prior_mean(self, value: Any) -> None:
        """A number or ``(P,)``."""
        self._prior.set_mean(value)

    @property
    def mean(self) -> Tensor:
        """``mu_0`` before a fit, ``theta_MAP`` after."""
        return self._mean

    @property
    def map(self) -> Tensor:
        """The MAP ``(P,)``."""
        return self._map

    @property
    def h(self) -> Any:
        """The curvature in the form's layout (``None`` before a fit)."""
        return self._h

    @property
    def loss(self) -> float:
        """The negative log-likelihood at the MAP over the fitted data (``sigma = 1``)."""
        return self._loss

    @property
    def n_data(self) -> int:
        return self._n_data

    @property
    def n_entries(self) -> int:
        """Regression output entries seen (the marginal likelihood's ``n_out``)."""
        return self._n_entries

    @property
    def n_outputs(self) -> int | None:
        return self._n_outputs

    @contextlib.contextmanager
    def fitting(self) -> Iterator[None]:
        """Inside a fit: the mean becomes the MAP; ``reward_modeling`` is a classification (of
        preference pairs)."""
        self._mean = self._map
        if not self._reward:
            yield
            return
        self._likelihood = Likelihood.CLASSIFICATION
        try:
            yield
        finally:
            self._likelihood = Likelihood.REGRESSION

    def record(
        self, fit: CurvatureFit, override: bool, combine: Callable[[CurvatureFit], Any]
    ) -> None:
        """Store a fit: it replaces the previous one (``override``, or none yet) or joins it
        (``combine(previous)`` gives the joint curvature; the counts add up)."""
        if override or self._h is None:
            self._h, self._loss, self._n_data, self._n_entries = fit.h, 0.0, 0, 0
        else:
            old = CurvatureFit(self._h, self._loss, self._n_data, self._n_entries, None)
            self._h = combine(old)
        self._loss += fit.loss
        self._n_data += fit.n_data
        self._n_entries += fit.n_entries
        self._n_outputs = fit.n_outputs
        self._scale = None

    def forget(self) -> None:
        """Back to no fit: the posterior is the prior (laplace-torch's ``_init_H``)."""
        self._h, self._loss, self._n_data, self._n_entries = None, 0.0, 0, 0
        self._n_outputs, self._scale = None, None
        self._mean = self._prior.mean.detach().clone()

    def restore(self, fit: CurvatureFit) -> None:
        """A saved fit in place of this one (``load_state_dict``)."""
        self._h, self._loss = fit.h, fit.loss
        self._n_data, self._n_entries, self._n_outputs = fit.n_data, fit.n_entries, fit.n_outputs
        self._mean, self._scale = self._map, None

    def fitted(self) -> Any:
        """The curvature; ``RuntimeError`` before a fit."""
        if self._h is None:
            raise RuntimeError(f"{self._owner} is not fitted: call fit(data) first")
        return self._h

    # ------------------------------------------------------------------ precision
    def factor(self, sigma: Tensor | float) -> Tensor | float:
        """``1 / (sigma^s T)``: ``s = 4`` for a regression's empirical Fisher, else 2; with a
        laplace-torch EF backend named (``backend=``) a regression's empirical Fisher takes
        laplace-torch's convention, ``2 / (sigma^2 T)`` (its curvature is twice the textbook
        value and divided by ``sigma^2``), so the posterior's numbers are laplace-torch's."""
        t = self._temperature
        if self._hessian is HessianKind.EMPIRICAL and self._likelihood is Likelihood.REGRESSION:
            if self._backend_name is not None:
                return 2.0 / (sigma**2 * t)
            return 1.0 / (sigma**4 * t)
        return 1.0 / (sigma**2 * t)

    def terms(self, prior_precision: Any = None, sigma_noise: Any = None) -> PrecisionTerms:
        """``P_post``'s terms at a prior precision and a noise (``None``: the stored ones)."""
        h = self.fitted()
        sigma = self._sigma_noise if sigma_noise is None else sigma_noise
        return PrecisionTerms(h, self.factor(sigma), self._prior.at(prior_precision))

    def precision(self, prior_precision: Any = None, sigma_noise: Any = None) -> Any:
        """``P_post`` in the form's layout; differentiable in tensor-valued arguments."""
        return self._form.precision(self.terms(prior_precision, sigma_noise))

    @property
    def scale(self) -> Any:
        """The form's scale of ``Sigma`` (cached until the curvature, prior or noise change)."""
        if self._scale is None:
            self._scale = self._form.scale(self.terms())
        return self._scale

    def covariance(self) -> Tensor:
        """``Sigma`` ``(P, P)``."""
        return self._form.covariance(self.terms(), lambda: self.scale)

    def variance(self) -> Tensor:
        """``diag(Sigma)`` ``(P,)``."""
        return self._form.variance(self.terms(), lambda: self.scale)

    def logdet(self, prior: Tensor, sigma_noise: Any) -> Tensor:
        """``log det P_post`` at a ``(P,)`` prior and a noise (differentiable in both)."""
        return self._form.logdet(self.terms(prior, sigma_noise))

    def whiten(self, jac: Tensor) -> Tensor:
        """``V`` ``(P, rows)`` with ``V^T V = J Sigma J^T`` for Jacobian rows ``jac``."""
        return self._form.whiten(self.scale, jac)

    def whitened(self, js: Tensor) -> Tensor:
        """:meth:`whiten` per sample of ``Js`` ``(N, O, P)`` -> ``(N, P, O)``."""
        if not isinstance(js, Tensor) or js.dim() != 3 or js.shape[-1] != self._subset.numel:
            what = tuple(js.shape) if isinstance(js, Tensor) else type(js).__name__
            raise ValueError(f"Js must be (N, O, P={self._subset.numel}); got {what}")
        return torch.stack([self.whiten(j.to(self._mean)) for j in js])

    def draw(self, z: Tensor) -> Tensor:
        """Standard normals ``z`` ``(P, S)`` -> draws ``(P, S)`` from ``N(0, Sigma)``."""
        return self._form.draw(self.scale, z)

    def kept_bytes(self) -> int:
        """Bytes of what the posterior keeps: the curvature and its scale."""
        return self._form.kept_bytes(self._subset, self._map.element_size())

    # ------------------------------------------------------------------ evidence
    def log_likelihood(self, sigma_noise: Any = None) -> Tensor:
        """``log p(D | theta_MAP)`` with the temperature applied."""
        self.fitted()
        sigma = self._sigma_noise if sigma_noise is None else sigma_noise
        sigma_t = torch.as_tensor(sigma, dtype=self._mean.dtype, device=self._mean.device)
        ll = -self._loss / (sigma_t**2 * self._temperature)
        if self._likelihood is Likelihood.REGRESSION:
            ll = ll - self._n_entries * torch.log(sigma_t * math.sqrt(2 * math.pi))
        return ll

    def scatter(self, prior: Tensor | None = None) -> Tensor:
        """``(theta - mu_0)^T P_0 (theta - mu_0)`` at a ``(P,)`` prior (``None``: stored)."""
        prior = self._prior.diag if prior is None else prior
        delta = self._mean - self._prior.mean
        return (delta * prior) @ delta

    def log_marginal_likelihood(self, sigma_noise: Any = None) -> Tensor:
        """The Laplace approximation of ``log p(D)`` at the stored prior (differentiable in
        it) and a noise (``None``: the stored one)."""
        prior = self._prior.diag
        logdet_post = self.logdet(prior, sigma_noise)
        return self.log_likelihood(sigma_noise) - 0.5 * (
            logdet_post - prior.log().sum() + self.scatter(prior)
        )

    def log_prob(self, value: Tensor, normalized: bool = True) -> Tensor:
        """The posterior's log density at ``value`` ``(P,)`` (the prior's before a fit)."""
        if not isinstance(value, Tensor) or value.shape != (self._subset.numel,):
            what = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"value must be (P={self._subset.numel},); got {what}")
        d = value.to(self._mean) - self._mean
        prior = self._prior.diag
        if self._h is None:
            quad, logdet = (d * prior) @ d, prior.log().sum()
        else:
            post = self.precision()
            if isinstance(post, Tensor):
                quad = d @ (post @ d) if post.dim() == 2 else (d * post) @ d
            else:
                quad = d @ post.matmul(d)
            logdet = self.logdet(prior, None)
        out = -0.5 * quad
        if check_bool(normalized, "normalized"):
            out = out + 0.5 * (logdet - d.numel() * math.log(2 * math.pi))
        return out
