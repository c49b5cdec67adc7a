"""A Laplace posterior made of parts: a curvature, a posterior form, a prior and one options
object.

:class:`LaplaceBase` checks the arguments once, builds the parts and answers laplace-torch's
calls through them: :class:`~._posterior.Posterior` (the Gaussian and its fits, with its
:class:`~._forms.PosteriorForm` and :class:`~._prior.Prior`), the curvature (a
:class:`~._fit.Curvature`: :class:`~._subset_ggn.SubsetGGN`, :class:`~._diag.DiagGGN` or
:class:`~._kronlaplace.KronGGN`, one fit signature), :class:`~._jacobian_rows.JacobianRows`
(the Jacobian rows the fit and the predictive stream) and :class:`~._predictive.Predictive`.
A Laplace class names its form and curvature (:meth:`LaplaceBase._parts`) and nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .._checks import Prepared, check_bool, prepare
from ..enums import (
    BatchNormPolicy,
    Entries,
    FisherMethod,
    HessianKind,
    InputKind,
    Likelihood,
    LinkApprox,
    Mode,
    PredType,
    PriorStructure,
    Randomness,
    SubsetOfWeights,
    Tune,
    TuningMethod,
    parse_enum,
)
from ..subset import ParamSubset
from . import _marglik, _saving
from ._backends import CurvatureBackend
from ._batches import DictPairs
from ._fit import Curvature
from ._forms import PosteriorForm
from ._jacobian_rows import JacobianRows
from ._last_layer import check_last_layer
from ._options import LaplaceOptions
from ._posterior import Posterior
from ._predictive import GLMPredictive, Predictive
from ._prior import Prior

try:  # Python 3.11+
    from typing import Self
except ImportError:  # pragma: no cover - Python 3.10
    from typing_extensions import Self

__all__ = ["LaplaceBase", "LaplaceCalls", "Parts"]


class Parts(NamedTuple):
    """What a Laplace class is made of: its posterior ``form``, its ``curvature`` (built from
    the posterior's Jacobian rows), whether the prior precision is one value or one per tensor
    only (``per_tensor``) and whether it takes ``method`` (:func:`~multiscale_jac.diag_fisher`'s)."""

    form: PosteriorForm
    curvature: Callable[[JacobianRows], Curvature]
    per_tensor: bool = False
    takes_method: bool = False


class LaplaceCalls:
    """laplace-torch's calls on a posterior's parts: the predictive, the evidence, the prior
    and the posterior (:class:`LaplaceBase` builds the parts)."""

    _posterior: Posterior
    _curvature: Curvature
    _predictive: Predictive
    _rows: JacobianRows
    _options: LaplaceOptions

    # ------------------------------------------------------------------ the predictive
    def _graph(self) -> contextlib.AbstractContextManager[None]:
        """The predictive keeps a graph only with ``enable_backprop`` (laplace-torch's rule:
        otherwise its outputs are detached, even from a prior or noise that requires grad)."""
        return contextlib.nullcontext() if self._options.enable_backprop else torch.no_grad()

    def __call__(
        self,
        x: Any,
        pred_type: str | PredType = "glm",
        joint: bool = False,
        link_approx: str | LinkApprox = "probit",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
        **model_kwargs: Any,
    ) -> Tensor | list[Tensor] | tuple[Any, Any]:
        """laplace-torch's predictive at ``x`` (:meth:`~._predictive.Predictive.call`);
        ``fitting=True`` (laplace-torch's, for ``reward_modeling``): the predictive of the fit's
        likelihood, a classification of the pair."""
        fit = self._posterior.fitting() if check_bool(fitting, "fitting") else None
        with self._graph(), fit or contextlib.nullcontext():
            return self._predictive.call(
                x,
                pred_type,
                joint,
                link_approx,
                n_samples,
                diagonal_output,
                generator,
                model_kwargs,
            )

    def predictive(
        self,
        inputs: Any,
        *,
        link_approx: str | LinkApprox = "probit",
        n_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> GLMPredictive:
        """The GLM predictive at ``inputs`` (:meth:`~._predictive.Predictive.predictive`)."""
        with self._graph():
            return self._predictive.predictive(
                inputs, link_approx=link_approx, n_samples=n_samples, generator=generator
            )

    def predictive_samples(
        self,
        x: Any,
        pred_type: str | PredType = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor | list[Tensor]:
        """Samples of the predictive (:meth:`~._predictive.Predictive.predictive_samples`)."""
        with self._graph():
            return self._predictive.predictive_samples(
                x, pred_type, n_samples, diagonal_output, generator
            )

    def functional_samples(
        self,
        inputs: Any,
        n_samples: int = 100,
        *,
        linearized: bool | None = None,
        pred_type: str | PredType | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor | list[Tensor]:
        """Output samples (:meth:`~._predictive.Predictive.functional_samples`)."""
        with self._graph():
            return self._predictive.functional_samples(
                inputs, n_samples, linearized=linearized, pred_type=pred_type, generator=generator
            )

    def functional_variance_fast(
        self, x: Any
    ) -> tuple[Tensor | list[Tensor], Tensor | list[Tensor]]:
        """laplace-torch's call: the GLM mean and the marginal variances of ``f``."""
        with self._graph():
            return self._predictive.functional_variance_fast(x)

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J Sigma J^T`` per sample, ``(N, O, O)``, for ``Js`` ``(N, O, P)``."""
        v = self._posterior.whitened(Js)  # (N, P, O)
        return v.transpose(1, 2) @ v

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """``J Sigma J^T`` across samples, ``(N O, N O)`` (sample-major), for ``(N, O, P)``."""
        v = self._posterior.whitened(Js)
        flat = v.transpose(0, 1).reshape(v.shape[1], -1)  # (P, N O)
        return flat.T @ flat

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """Draws from the posterior (:meth:`~._predictive.Predictive.sample`)."""
        return self._predictive.sample(n_samples, generator)

    # ------------------------------------------------------------------ evidence and prior
    @property
    def log_likelihood(self) -> Tensor:
        """``log p(D | theta_MAP)`` with the temperature applied."""
        return self._posterior.log_likelihood()

    @property
    def scatter(self) -> Tensor:
        """``(theta_MAP - mu_0)^T P_0 (theta_MAP - mu_0)`` (laplace-torch's name)."""
        return self._posterior.scatter()

    def log_prob(self, value: Tensor, normalized: bool = True) -> Tensor:
        """The posterior's log density at ``value`` ``(P,)`` (the prior's before :meth:`fit`);
        ``normalized=False`` leaves out ``0.5 (log det P_post - P log 2 pi)``."""
        return self._posterior.log_prob(value, normalized)

    def log_marginal_likelihood(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Tensor:
        """The Laplace approximation of ``log p(D)``; differentiable in tensor arguments.

        Args:
            prior_precision: Stored first, as laplace-torch does (any form the constructor
                takes; a tensor that requires grad keeps the graph), then evaluated at.
            sigma_noise: Stored first likewise (regression only).
        """
        if sigma_noise is not None and self.likelihood is not Likelihood.REGRESSION:
            raise ValueError("sigma_noise can only be changed for regression")
        if prior_precision is not None:
            self._posterior.set_prior_precision(prior_precision)
        if sigma_noise is not None:
            self._posterior.set_sigma_noise(sigma_noise)
        return self._posterior.log_marginal_likelihood(sigma_noise)

    def optimize_prior_precision(
        self,
        *choices: str | TuningMethod | PredType,
        method: str | TuningMethod | None = None,
        pred_type: str | PredType | None = None,
        n_steps: int = 100,
        lr: float = 0.1,
        init_prior_prec: Any = 1.0,
        prior_structure: str | PriorStructure = "scalar",
        val_loader: Iterable[tuple[Any, Any]] | None = None,
        loss: Any = None,
        log_prior_prec_min: float = -4,
        log_prior_prec_max: float = 4,
        grid_size: int = 100,
        link_approx: str | LinkApprox = "probit",
        n_samples: int = 100,
        verbose: bool = False,
        progress_bar: bool = False,
    ) -> None:
        """Tune the prior precision, as laplace-torch does, and store it.

        Args:
            *choices: ``method`` and ``pred_type`` by position in either order, each read by its
                value (``("gridsearch")`` here, laplace-torch's ``(PredType.GLM, "gridsearch")``).
            method: ``marglik`` (default: Adam on the log prior precision, maximising the log
                marginal likelihood) or ``gridsearch`` (the validation loss at ``grid_size``
                values ``logspace(log_prior_prec_min, log_prior_prec_max)``; the least wins).
            pred_type: ``glm`` (default) or ``nn``, the predictive the grid search scores.
            n_steps: Adam steps (``marglik``).
            lr: Adam learning rate (``marglik``).
            init_prior_prec: Starting value (``marglik``): a number, or a tensor whose shape
                then fixes the structure.
            prior_structure: ``scalar`` (stored as a one-element tensor), ``layerwise`` (or
                ``tensor``: one per selected tensor) or ``diag`` (``(P,)``), for a number
                ``init_prior_prec`` (``marglik``; the grid search is scalar).
            val_loader: ``(inputs, targets)`` batches for ``gridsearch`` (read once and kept
                for the search; the Jacobians of the batches are reused across the grid while
                they fit in ``memory_budget``, default 128 MiB).
            loss: The grid search's loss: ``None`` (classification: the mean negative log
                probability of the labels; regression: the mean squared error of ``f_mu``), a
                callable ``loss(probs, targets)`` / ``loss(f_mu, f_var, targets)`` on the
                concatenated predictions, or an object with ``update``/``compute`` (a
                torchmetrics metric).
            log_prior_prec_min: ``log10`` of the grid's smallest value.
            log_prior_prec_max: ``log10`` of the grid's largest value.
            grid_size: Number of grid values.
            link_approx: ``probit``, ``mc`` or ``bridge`` for the grid search's probabilities.
            n_samples: Samples for ``link_approx="mc"`` and ``pred_type="nn"``.
            verbose: Print the result.
            progress_bar: A tqdm bar over the steps or grid values when a terminal is attached.

        Returns:
            ``None`` (as laplace-torch); the result is :attr:`prior_precision`.

        Raises:
            ValueError: an unknown ``method``/``pred_type``/``link_approx``/``prior_structure``,
                ``gridsearch`` without ``val_loader``, not fitted.
        """
        _marglik.optimize_prior_precision(
            self,
            self._rows,
            self._posterior,
            self._options,
            choices,
            method=method,
            pred_type=pred_type,
            n_steps=n_steps,
            lr=lr,
            init_prior_prec=init_prior_prec,
            prior_structure=prior_structure,
            val_loader=val_loader,
            loss=loss,
            log_prior_prec_min=log_prior_prec_min,
            log_prior_prec_max=log_prior_prec_max,
            grid_size=grid_size,
            link_approx=link_approx,
            n_samples=n_samples,
            verbose=verbose,
            progress_bar=progress_bar,
        )

    @property
    def prior_precision(self) -> Tensor:
        """The prior precision as given: ``(1,)``, ``(K,)`` (one per selected tensor) or
        ``(P,)``. Assign a number, a tensor, a sequence or ``{name: value}``."""
        return self._posterior.prior.precision

    @prior_precision.setter
    def prior_precision(self, value: Any) -> None:
        self._posterior.set_prior_precision(value)

    @property
    def prior_precision_diag(self) -> Tensor:
        """The prior precision expanded to the ``(P,)`` diagonal ``p_0``."""
        return self._posterior.prior.diag

    @property
    def prior_mean(self) -> Tensor:
        """``mu_0`` ``(P,)``; assign a number or ``(P,)``."""
        return self._posterior.prior.mean

    @prior_mean.setter
    def prior_mean(self, value: Any) -> None:
        self._posterior.set_prior_mean(value)

    @property
    def sigma_noise(self) -> Tensor:
        """The Gaussian noise scale, a 0-d tensor as laplace-torch's (a tensor given is kept,
        e.g. a tuned noise that requires grad); 1 for classification."""
        return self._posterior.sigma_noise

    @sigma_noise.setter
    def sigma_noise(self, value: Any) -> None:
        self._posterior.set_sigma_noise(value)

    @property
    def temperature(self) -> float:
        """``T``; the curvature is divided by it."""
        return self._posterior.temperature

    @temperature.setter
    def temperature(self, value: Any) -> None:
        self._posterior.set_temperature(value)

    @property
    def likelihood(self) -> Likelihood:
        """``classification`` or ``regression`` (``reward_modeling``: a classification while
        :meth:`fit` runs, a regression otherwise); assign a string or the enum."""
        return self._posterior.likelihood

    @likelihood.setter
    def likelihood(self, value: str | Likelihood) -> None:
        self._posterior.set_likelihood(value)

    # ------------------------------------------------------------------ the posterior
    def posterior_precision_matrix(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Any:
        """``P_post`` in the form's layout at a prior and a noise (``None``: the stored ones):
        ``(P, P)``, ``(P,)`` or Kronecker factors; differentiable in tensor arguments."""
        return self._posterior.precision(prior_precision, sigma_noise)

    @property
    def posterior_precision(self) -> Any:
        """``P_post`` at the current prior precision and noise, in the form's layout."""
        return self._posterior.precision()

    @property
    def posterior_scale(self) -> Any:
        """The scale of ``Sigma``, cached: the lower Cholesky factor of ``P_post`` (full), the
        ``(P,)`` standard deviations (diagonal), the factors' eigenbases (Kronecker)."""
        return self._posterior.scale

    @property
    def posterior_covariance(self) -> Tensor:
        """``Sigma = P_post^{-1}`` as a dense ``(P, P)`` matrix (small ``P`` only)."""
        return self._posterior.covariance()

    @property
    def posterior_variance(self) -> Tensor:
        """``diag(Sigma)`` ``(P,)``."""
        return self._posterior.variance()

    @property
    def H(self) -> Any:
        """The curvature in the form's layout: ``(P, P)``, ``(P,)`` or Kronecker factors; zeros
        before :meth:`fit`, as laplace-torch's (the posterior is then the prior)."""
        h = self._posterior.h
        if h is None and self._unchecked_last_layer is not None:
            return None
        return self._curvature.zeros(self._posterior.map) if h is None else h

    def _init_H(self) -> None:
        """laplace-torch's call: forget the fit (``H`` zeros, no data seen)."""
        self._posterior.forget()

    @property
    def _device(self) -> torch.device:
        """laplace-torch's name: where the posterior's tensors live."""
        return self._posterior.map.device

    @property
    def mean(self) -> Tensor:
        """The posterior's mean ``(P,)``: the prior mean before :meth:`fit`, the MAP after
        (``None`` before the fit of a last layer found without ``last_layer_name``, as
        laplace-torch's)."""
        if self._posterior.h is None and self._unchecked_last_layer is not None:
            return None  # type: ignore[return-value]
        return self._posterior.mean

    @property
    def loss(self) -> Tensor:
        """The negative log-likelihood at the MAP summed over the fitted data, at ``sigma = 1``
        (a 0-d tensor, as laplace-torch's; 0 before :meth:`fit`)."""
        mean = self._posterior.mean
        return torch.tensor(self._posterior.loss, dtype=mean.dtype, device=mean.device)

    @property
    def n_data(self) -> int:
        """Samples fitted."""
        return self._posterior.n_data

    @property
    def n_outputs(self) -> int | None:
        """laplace-torch's: dim 1 of the output after ``output_fn`` (``None`` before a fit)."""
        return self._posterior.n_outputs


class LaplaceBase(LaplaceCalls):
    """A Laplace approximation over a subset of a model's parameter entries (the arguments are
    every class's: :class:`SubnetLaplace`, :class:`DiagLaplace`, :class:`KronLaplace`).

    Args:
        model: Any ``nn.Module`` at its MAP; never changed (inputs: anything
            :func:`~multiscale_jac.pack` accepts).
        likelihood: ``classification``, ``regression`` or laplace-torch's ``reward_modeling``
            (a classification of preference pairs in the fit, a regression of one reward in the
            predictive).
        subset: A :class:`ParamSubset` (entries or whole tensors), a name/glob or list of them;
            default: every parameter that requires grad.
        prior_precision: A number, a ``(P,)`` diagonal, one value per selected tensor (a
            sequence or ``{name: value}``; :class:`KronLaplace`: a number or one per tensor).
        sigma_noise: Gaussian noise scale (regression; must be 1 for classification).
        temperature: ``T``; the curvature is divided by it.
        prior_mean: A number or a ``(P,)`` vector.
        hessian: ``ggn`` (default; also where ``backend`` says) or ``empirical``.
        output_fn: Applied to the model's output (batch dim of one kept).
        ignore_index: Label of positions left out of dense classification.
        input_kind: How to read inputs where it is ambiguous (:func:`~multiscale_jac.pack`).
        chunk_size: Samples per engine call (default: as many as the Jacobian rows allow;
            :class:`DiagLaplace` and :class:`KronLaplace`: per batched run of the fit).
        memory_budget: Bytes of the working set of :meth:`fit` and :meth:`predictive`,
            including the curvature and its factor. Samples are taken in chunks and a sample
            whose Jacobian rows do not fit in slices of its output positions. Default: 32 MiB of
            Jacobian rows at a time and the engine's default working set.
        randomness: ``error``, ``different`` or ``same``, as in ``torch.func.vmap``; the
            outputs and Jacobians of a sample come from one pass (one set of masks).
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode
            (:func:`Laplace`, laplace-torch's front door, defaults to ``"eval"`` as
            laplace-torch fits in eval mode; the model's own mode is never changed).
        strict: Raise instead of letting the engine fall back to another strategy.
        entries: How the engine forms single-entry columns (``auto``, ``structured`` or
            ``generic``; see :func:`~multiscale_jac.per_sample_jacobian`).
        mode: The engine's mode for the Jacobian rows (``auto``, ``rev`` or ``fwd``).
        tune: How the engine's ``auto`` choices are made (:class:`~multiscale_jac.Tune`:
            ``auto``, ``measure`` or ``True``, ``estimate`` or ``False``; nothing is timed
            unless ``True``).
        method: :class:`DiagLaplace`: how :func:`~multiscale_jac.diag_fisher` computes the
            diagonal (``auto``, ``layerwise`` or ``vmap``); the other classes take ``auto`` only.
        enable_backprop: The predictive (``la(x)``, :meth:`predictive`,
            :meth:`functional_samples`) keeps its graph to inputs that require grad, so its
            mean and variance can be differentiated w.r.t. them (laplace-torch's option).
        dict_key_x: The inputs' key of a dict batch (laplace-torch's; Hugging Face batches).
        dict_key_y: The targets' key of a dict batch.
        backend: laplace-torch's curvature backend (a class, a subclass of one, or its name):
            a GGN backend means ``hessian="ggn"``, an empirical-Fisher one
            ``hessian="empirical"``; the curvature is always this library's.
        backend_kwargs: With ``backend``: empty or ``{"stochastic": False}``.
        asdl_fisher_kwargs: Empty (ASDL's options have no counterpart).
        subset_of_weights: laplace-torch's ``subset_of_weights`` where :func:`Laplace` built
            this posterior (``subnetwork``: :meth:`sample` returns every parameter).

    The options mean the same on every entry point (the options table in ``docs/design.md``).

    Raises:
        TypeError, ValueError: bad arguments (the message names the value).
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: ParamSubset | str | Sequence[str] | None = None,
        *,
        prior_precision: Any = 1.0,
        sigma_noise: Any = 1.0,
        temperature: float = 1.0,
        prior_mean: Any = 0.0,
        hessian: str | HessianKind | None = None,
        output_fn: Callable[[Any], Any] | None = None,
        ignore_index: int = -100,
        input_kind: str | InputKind | None = None,
        chunk_size: int | None = None,
        memory_budget: int | None = None,
        randomness: str | Randomness = "error",
        batch_norm: str | BatchNormPolicy = "error",
        strict: bool = False,
        entries: str | Entries = "auto",
        mode: str | Mode = "auto",
        tune: str | bool | Tune = "auto",
        method: str | FisherMethod = "auto",
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: Any = None,
        backend_kwargs: dict[str, Any] | None = None,
        asdl_fisher_kwargs: dict[str, Any] | None = None,
        subset_of_weights: str | SubsetOfWeights | None = None,
    ) -> None:
        given = locals()
        options = LaplaceOptions.checked(**{k: given[k] for k in LaplaceOptions.arguments()})
        if subset is None and isinstance(model, nn.Module):
            subset = ParamSubset.all(model, trainable_only=True)
        prep = prepare(
            model,
            params=subset,
            params_name="subset",
            output_fn=output_fn,
            batch_norm=batch_norm,
            randomness=randomness,
            input_kind=input_kind,
        )
        name = type(self).__name__
        #: the MAP: the model's values of the subset at construction (the predictive runs the
        #: model itself, so they must stay its values)
        theta = prep.subset.flatten(prep.subset.check_model(model)).detach().clone()
        parts = self._parts(prep, options, theta)
        if options.method is not FisherMethod.AUTO and not parts.takes_method:
            raise ValueError(
                f"method={options.method.value!r} is DiagLaplace's (diag_fisher's method); "
                f"{name} takes method='auto' only"
            )
        prior = Prior(prep.subset, theta, prior_precision, prior_mean, per_tensor=parts.per_tensor)
        self._posterior = Posterior(
            name,
            prep.subset,
            parts.form,
            prior,
            theta,
            likelihood=likelihood,
            hessian=options.hessian,
            backend_name=options.backend_name,
            sigma_noise=sigma_noise,
            temperature=temperature,
        )
        self._prep, self._options = prep, options
        self._rows = JacobianRows(name, prep, options, theta, self._posterior.kept_bytes())
        self._curvature = parts.curvature(self._rows)
        self._which = (
            None
            if subset_of_weights is None
            else parse_enum(SubsetOfWeights, subset_of_weights, "subset_of_weights")
        )
        full = model if self._which is SubsetOfWeights.SUBNETWORK else None
        self._predictive = Predictive(self._rows, self._posterior, options, full)
        self._unchecked_last_layer: str | None = None

    def _check_last_layer_at_fit(self, name: str) -> None:
        """The front door's last layer found without ``last_layer_name``: :meth:`fit` checks
        on its first batch that module ``name`` runs last; until the fit, ``mean`` and ``H``
        are ``None``, as laplace-torch's (it finds the last layer by that forward)."""
        self._unchecked_last_layer = name

    def _first_batch(self, x: Any) -> None:
        name = self._unchecked_last_layer
        if name is None:
            return
        packed = self._rows.pack(x)
        levels = packed.stack([0])
        fn = self._rows.function(packed)
        with torch.no_grad():
            check_last_layer(self._prep.model, name, lambda: fn.call_batch(levels))
        self._unchecked_last_layer = None

    def _parts(self, prep: Prepared, options: LaplaceOptions, theta: Tensor) -> Parts:
        """The class's form and curvature (each Laplace class defines it)."""
        raise NotImplementedError(f"{type(self).__name__} names no curvature")

    # ------------------------------------------------------------------ the fit
    def fit(
        self,
        train_loader: Iterable[tuple[Any, Any]],
        override: bool = True,
        progress_bar: bool = False,
        *,
        progress: bool = False,
        process_group: Any = None,
        max_outputs_per_sample: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Self:
        """Accumulate the curvature and the loss at the MAP in one pass over the data.

        Args:
            train_loader: An iterable of ``(inputs, targets)`` (a DataLoader, a list of pairs,
                laplace-torch's dict batches); ``inputs`` in any form
                :func:`~multiscale_jac.pack` accepts, ``targets`` a tensor with a leading batch
                dim or a list of per-sample tensors (ragged label maps).
            override: Start from zero (``False`` adds to a previous fit: online / continual
                learning; :class:`KronLaplace` weights the input factors by each fit's share
                of the samples, as laplace-torch).
            progress_bar: laplace-torch's name for ``progress``.
            progress: A tqdm bar over the batches when a terminal is attached.
            process_group: With ``torch.distributed`` initialised, every rank fits its shard of
                the data and the results are all-reduced once at the end (``None``: the
                default group; :class:`KronLaplace` refuses it).
            max_outputs_per_sample: :class:`SubnetLaplace`'s opt-in unbiased subsampling of
                the GGN (``None``: exact): a sample with more output positions ``M`` than this
                contributes the GGN of ``m`` positions drawn uniformly without replacement,
                times ``M / m``. The loss stays exact; ``hessian="ggn"`` only.
            generator: Seeds the subsampling.

        Returns:
            ``self``.
        """
        show = check_bool(progress, "progress") | check_bool(progress_bar, "progress_bar")
        override = check_bool(override, "override")
        keys = (self._options.dict_key_x, self._options.dict_key_y)
        data = DictPairs(train_loader, *keys, first=self._first_batch)
        with self._posterior.fitting():
            fit = self._curvature.fit(
                data,
                self._posterior.likelihood,
                progress=show,
                process_group=process_group,
                max_outputs_per_sample=max_outputs_per_sample,
                generator=generator,
            )
        self._posterior.record(fit, override, lambda old: self._curvature.combine(old, fit))
        return self

    @property
    def n_params(self) -> int:
        """``P``, the number of entries the posterior is over."""
        return self._prep.subset.numel

    @property
    def n_params_subnet(self) -> int:
        """laplace-torch's name for :attr:`n_params` of a subnetwork Laplace."""
        return self._prep.subset.numel

    @property
    def model(self) -> nn.Module:
        return self._prep.model

    @property
    def subset(self) -> ParamSubset:
        return self._prep.subset

    @property
    def form(self) -> PosteriorForm:
        """The structure of ``P_post``."""
        return self._posterior.form

    @property
    def options(self) -> LaplaceOptions:
        """The checked options."""
        return self._options

    @property
    def hessian(self) -> HessianKind:
        return self._options.hessian

    @property
    def enable_backprop(self) -> bool:
        """The predictive keeps its graph to the inputs (assignable, as laplace-torch's)."""
        return self._options.enable_backprop

    @enable_backprop.setter
    def enable_backprop(self, value: bool) -> None:
        self._options = self._options.replace(enable_backprop=check_bool(value, "enable_backprop"))
        self._rows.set_options(self._options)
        self._predictive.set_options(self._options)

    @property
    def subset_of_weights(self) -> SubsetOfWeights | None:
        """laplace-torch's ``subset_of_weights`` where :func:`Laplace` built this posterior."""
        return self._which

    @property
    def backend(self) -> CurvatureBackend:
        """laplace-torch's ``la.backend``: the curvature's description (no object of another
        library is involved)."""
        return CurvatureBackend(
            self._options.backend_name,
            self._options.hessian,
            self._prep.subset.flat_indices(),
            lambda x, keep, vector: self._rows.stacked(
                self._predictive.inputs(x),
                self._posterior.likelihood,
                self._options.enable_backprop
                if keep is None
                else check_bool(keep, "enable_backprop"),
                vector=vector,
            ),
            last_layer=self._which is SubsetOfWeights.LAST_LAYER,
        )

    # ------------------------------------------------------------------ saving
    def state_dict(self) -> dict[str, Any]:
        """The fitted posterior as plain values (:func:`~._saving.state_dict`)."""
        o = self._options
        return _saving.state_dict(
            type(self).__name__,
            self._posterior,
            self._curvature,
            self._prep,
            o.enable_backprop,
            o.hessian.value,
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a posterior saved by :meth:`state_dict` (:func:`~._saving.load_state_dict`)."""
        backprop = _saving.load_state_dict(
            state_dict,
            type(self).__name__,
            self._posterior,
            self._curvature,
            self._prep,
            self._options.hessian.value,
        )
        self.enable_backprop = backprop

    def __repr__(self) -> str:
        post = self._posterior
        fitted = f"fitted on {post.n_data} samples" if post.h is not None else "not fitted"
        return (
            f"{type(self).__name__}(likelihood={post.likelihood.value!r}, P={self.n_params}, "
            f"hessian={self._options.hessian.value!r}, {fitted})"
        )
