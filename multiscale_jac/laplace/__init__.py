"""Laplace approximations for multiscale networks: subnetwork, diagonal and the GLM predictive.

The posterior over a :class:`~multiscale_jac.subset.ParamSubset` ``theta`` (``P`` entries,
everything else fixed at the MAP) is ``N(theta_MAP, Sigma)`` with precision

    ``P_post = H / (sigma^s T) + diag(prior_precision)``

where ``H = sum_i J_i^T Lambda_i J_i`` is accumulated over the data by :meth:`SubnetLaplace.fit`
(``J_i`` ``(O_i, P)``: the per-sample Jacobian of the outputs on the subset; ``Lambda_i``: the
Hessian of the negative log-likelihood w.r.t. the outputs at ``sigma = 1``), ``T`` the
temperature and ``s = 2`` (``s = 4`` for the empirical Fisher of a regression, whose gradients
carry ``1/sigma^2`` each). Conventions follow laplace-torch (Immer et al. 2021, Daxberger et al.
2021) so the numbers agree with it where it can run:

* classification: ``Lambda_i`` per output position is ``diag(p) - p p^T`` (softmax over dim 1
  of the model output, so vector logits ``(C,)`` and dense logits ``(C, *spatial)`` per sample);
  positions whose label is ``ignore_index`` contribute nothing; ``sigma_noise`` must be 1.
* regression: ``Lambda_i = I``; the loss is ``0.5 sum (f - y)^2``.
* ``log_marginal_likelihood = -loss / (sigma^2 T) - c - 0.5 (log det P_post - log det P_0 +
  (theta - mu_0)^T P_0 (theta - mu_0))`` with ``c = n_out log(sigma sqrt(2 pi))`` for regression
  (``n_out``: output entries seen by :meth:`~SubnetLaplace.fit`), 0 for classification.

Only a chunk of Jacobian rows is ever held (``memory_budget``): never ``N x O x P`` and never
the model's full Jacobian. Padded positions of ragged multi-level batches do not exist in the
per-sample outputs (every sample runs unpadded through the engine), so they contribute nothing.

:class:`DiagLaplace` keeps only the diagonal of ``H`` (``(P,)``, from
:func:`~multiscale_jac.diag_fisher`'s closed forms), so it scales to every weight of a network.
:func:`Laplace` is laplace-torch's front door: ``subset_of_weights`` and ``hessian_structure``
choose the class, and both classes answer laplace-torch's calls (``la(x)``,
``predictive_samples``, ``optimize_prior_precision(method=...)``).

A posterior is made of parts, one module each (private; the names above are the public ones),
held by :class:`LaplaceBase` (composition: no class has more than one base here):

* ``_options``: :class:`LaplaceOptions`, the one options object, checked once;
* ``_prior``: the prior precision's forms (one value, one per tensor, one per entry) and mean;
* ``_forms``: the posterior's forms (full, diagonal; a ``PosteriorForm`` each): precision,
  log-determinant, whitening, sampling, kept bytes; ``_kron``: the Kronecker-factored form;
* ``_posterior``: the Gaussian (form, prior, noise, temperature) and the record of its fits;
* ``_fit``: the one fit signature every curvature answers; ``_subset_ggn`` (the GGN of a
  subset, ``(P, P)``), ``_diag`` (the diagonal from :func:`~multiscale_jac.diag_fisher`) and
  ``_kronlaplace`` (K-FAC factors from :func:`~multiscale_jac._kfac.kron_factors`): the
  curvatures, each beside its class;
* ``_jacobian_rows``: streaming Jacobian rows in shape buckets under the memory budget;
* ``_predictive``: :class:`GLMPredictive`, the link approximations, predictive samples;
* ``_marglik``: prior tuning (marglik, grid search); ``_saving``: ``state_dict``;
* ``_base``: :class:`LaplaceBase`, the parts put together; ``_subnet``, ``_diag``,
  ``_kronlaplace``: :class:`SubnetLaplace`, :class:`DiagLaplace` and :class:`KronLaplace`,
  each naming its form and curvature;
* ``_frontdoor``: laplace-torch's ``Laplace()`` and its option translation;
* ``_gp``, ``_gp_context``, ``_gp_kernel``: :class:`GPLaplace` (``hessian_structure="gp"``,
  laplace-torch's ``FunctionalLaplace``): the neural tangent kernel of a context of training
  samples, the context's Jacobians kept or streamed, the GP algebra;
* ``_masks``: laplace-torch's subnetwork masks (``LargestMagnitudeSubnetMask`` ...);
* ``_marglik_training``: laplace-torch's ``marglik_training`` (on a copy of the model).
"""

from __future__ import annotations

import abc

from ._base import LaplaceBase
from ._diag import DiagLaplace
from ._frontdoor import Laplace
from ._gp import GPLaplace
from ._kronlaplace import KronLaplace
from ._marglik_training import marglik_training
from ._masks import (
    LargestMagnitudeSubnetMask,
    LargestVarianceDiagLaplaceSubnetMask,
    LargestVarianceSWAGSubnetMask,
    LastLayerSubnetMask,
    ModuleNameSubnetMask,
    ParamNameSubnetMask,
    RandomSubnetMask,
    ScoreBasedSubnetMask,
    SubnetMask,
)
from ._options import LaplaceOptions
from ._predictive import GLMPredictive
from ._subnet import SubnetLaplace

#: laplace-torch's parametric base (a Gaussian over weights), for ``isinstance`` and hints
ParametricLaplace = LaplaceBase


class BaseLaplace(abc.ABC):  # noqa: B024 - an isinstance target, nothing to implement
    """laplace-torch's ``BaseLaplace`` for ``isinstance``: every posterior here, parametric
    (:class:`LaplaceBase`) or in function space (:class:`GPLaplace`)."""


BaseLaplace.register(LaplaceBase)
BaseLaplace.register(GPLaplace)
#: laplace-torch's name of :class:`GPLaplace`
FunctionalLaplace = GPLaplace

__all__ = [
    "BaseLaplace",
    "DiagLaplace",
    "FunctionalLaplace",
    "GLMPredictive",
    "GPLaplace",
    "KronLaplace",
    "Laplace",
    "LaplaceBase",
    "LaplaceOptions",
    "LargestMagnitudeSubnetMask",
    "LargestVarianceDiagLaplaceSubnetMask",
    "LargestVarianceSWAGSubnetMask",
    "LastLayerSubnetMask",
    "ModuleNameSubnetMask",
    "ParamNameSubnetMask",
    "ParametricLaplace",
    "RandomSubnetMask",
    "ScoreBasedSubnetMask",
    "SubnetLaplace",
    "SubnetMask",
    "marglik_training",
]
