"""The function-space Laplace (laplace-torch's ``FunctionalLaplace``,
``hessian_structure="gp"``): the linearised network as a Gaussian process whose kernel is the
neural tangent kernel ``J(x) J(x')^T / prior_precision``, conditioned on ``M`` context samples
drawn from the training data (a subset of data; ``M = N`` is exactly the full GGN Laplace's
GLM predictive, by Woodbury). The algebra is in :mod:`._gp_kernel`; the Jacobians, the options
and the noise, temperature and prior mean come from a :class:`~._diag.DiagLaplace` over the
same entries that is never fitted (one place for every option)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import (
    check_bool,
    check_generator,
    check_int,
    check_positive_int,
    check_positive_number,
)
from .._stream import with_progress
from ..enums import Likelihood, LinkApprox, TuningMethod, parse_enum
from ..subset import ParamSubset
from ._diag import DiagLaplace
from ._gp_context import GPContext
from ._gp_kernel import GPTerms, chunk_terms
from ._marglik import optimize_gp_prior
from ._predictive import _bridge

__all__ = ["GPLaplace"]


def _twin_property(name: str, doc: str, settable: bool = False) -> Any:
    """A property read from (and with ``settable`` written to) the unfitted twin."""

    def get(self: GPLaplace) -> Any:
        return getattr(self._twin, name)

    def put(self: GPLaplace, value: Any) -> None:
        setattr(self._twin, name, value)

    return property(get, put if settable else None, doc=doc)


class GPLaplace:
    """laplace-torch's ``FunctionalLaplace``: a GP over the network's outputs with the neural
    tangent kernel of ``subset``'s entries, conditioned on ``n_subset`` training samples.

    Args:
        model: The network at its MAP (``(N, *in) -> (N, O)``; vector outputs).
        likelihood: ``classification`` or ``regression``.
        subset: The entries the kernel is over (default: every trainable parameter).
        n_subset: ``M``, the context samples (``M = N``: all; laplace-torch's draw of
            ``numpy.random.default_rng(seed).choice(N, M, replace=False)``).
        independent_outputs: One kernel per output (laplace-torch's diagonal kernel).
        seed: Seeds the draw of the context.
        prior_precision: One positive value (an isotropic prior, as laplace-torch).
        sigma_noise: Regression's noise scale.
        temperature: ``T``; the likelihood's curvature is divided by it.
        prior_mean: A number or ``(P,)``.
        enable_backprop: The predictive keeps its graph to the inputs.
        dict_key_x: The inputs' key of a dict batch.
        dict_key_y: The targets' key of a dict batch.
        backend: laplace-torch's backend: a GGN backend (the kernel is the GGN's).
        backend_kwargs: With ``backend``: empty.
        output_fn: Applied to the model's output.
        chunk_size: Samples per engine call.
        memory_budget: Bytes of Jacobian rows computed at once (default 32 MiB) and of the
            context's Jacobians kept between calls (default 1 GiB); above it those are
            recomputed a chunk at a time for every kernel block and every predictive call.
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.
        subset_of_weights: laplace-torch's ``subset_of_weights`` where :func:`Laplace` built it.

    Raises:
        TypeError, ValueError: bad arguments (the message names the value).
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: ParamSubset | str | Sequence[str] | None = None,
        *,
        n_subset: int,
        independent_outputs: bool = False,
        seed: int = 0,
        prior_precision: Any = 1.0,
        sigma_noise: Any = 1.0,
        temperature: float = 1.0,
        prior_mean: Any = 0.0,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: Any = None,
        backend_kwargs: dict[str, Any] | None = None,
        output_fn: Callable[[Any], Any] | None = None,
        chunk_size: int | None = None,
        memory_budget: int | None = None,
        batch_norm: str = "error",
        subset_of_weights: Any = None,
    ) -> None:
        self._twin = DiagLaplace(
            model, likelihood, subset, sigma_noise=sigma_noise, temperature=temperature,
            prior_mean=prior_mean, enable_backprop=enable_backprop, dict_key_x=dict_key_x,
            dict_key_y=dict_key_y, backend=backend, backend_kwargs=backend_kwargs,
            output_fn=output_fn, chunk_size=chunk_size, memory_budget=memory_budget,
            batch_norm=batch_norm, subset_of_weights=subset_of_weights,
        )  # fmt: skip
        if self._twin.hessian.value != "ggn":
            raise ValueError(
                f"hessian_structure='gp' is the GGN's kernel; got backend={backend!r} "
                "(an empirical-Fisher backend), as laplace-torch refuses it"
            )
        if self._twin.likelihood not in (Likelihood.CLASSIFICATION, Likelihood.REGRESSION):
            raise ValueError(
                "hessian_structure='gp' takes likelihood 'classification' or 'regression'; "
                f"got {self._twin.likelihood.value!r}"
            )
        self.n_subset = check_positive_int(n_subset, "n_subset")
        self.independent_outputs = check_bool(independent_outputs, "independent_outputs")
        self.seed = check_int(seed, "seed")
        subset = self._twin.subset
        #: the MAP ``(P,)``: the model's values of the entries (the GP's mean is the network)
        self.mean = subset.flatten(subset.check_model(model)).detach().clone()
        self.prior_precision = prior_precision
        options = self._twin.options
        self._context = GPContext(
            lambda x: self._jacobians(x, False),
            options.chunk_size,
            options.memory_budget,
            (options.dict_key_x, options.dict_key_y),
        )
        self._terms: GPTerms | None = None
        self.loss = torch.zeros((), dtype=self.mean.dtype, device=self.mean.device)
        self.n_data = 0
        self.n_outputs = 0

    # ------------------------------------------------------------------ options and state
    #: the twin's: the network, the entries, the options, laplace-torch's ``backend``
    model = _twin_property("model", "The network.")
    n_params = _twin_property("n_params", "``P``, the entries the kernel is over.")
    subset = _twin_property("subset", "The entries the kernel is over.")
    subset_of_weights = _twin_property("subset_of_weights", "laplace-torch's, from Laplace().")
    likelihood = _twin_property("likelihood", "``classification`` or ``regression``.")
    options = _twin_property("options", "The checked options (those of the Jacobians).")
    backend = _twin_property("backend", "laplace-torch's ``la.backend`` (its ``jacobians``).")
    enable_backprop = _twin_property("enable_backprop", "The predictive keeps its graph.", True)
    sigma_noise = _twin_property("sigma_noise", "The noise scale, a 0-d tensor.", True)
    temperature = _twin_property("temperature", "``T``.", True)
    prior_mean = _twin_property("prior_mean", "``mu_0``: a number or ``(P,)``.", True)

    @property
    def prior_precision(self) -> Tensor:
        """The prior precision ``(1,)`` (isotropic)."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: Any) -> None:
        mean = self.mean
        if isinstance(value, Tensor):
            if value.numel() != 1 or value.dim() > 1:
                raise ValueError(
                    "hessian_structure='gp' takes an isotropic prior (one value); got shape "
                    f"{tuple(value.shape)}"
                )
            prec = value.reshape(1).to(device=mean.device, dtype=mean.dtype)
        else:
            prec = torch.tensor([check_positive_number(value, "prior_precision")], dtype=mean.dtype)
        if not bool((prec.detach() > 0).all()):
            raise ValueError(f"prior_precision must be positive; got {prec.detach().tolist()}")
        self._prior_precision = prec.to(mean.device)

    @property
    def gp_kernel_prior_variance(self) -> Tensor:
        """``s = (M / N) / prior_precision``, the kernel's scale (laplace-torch's)."""
        return self._fitted().k.new_tensor(self.n_subset / self.n_data) / self.prior_precision

    @property
    def _h_factor(self) -> Tensor:
        """``1 / (sigma^2 T)`` (regression) or ``1 / T``."""
        if self.likelihood is Likelihood.REGRESSION:
            return 1 / self.sigma_noise.square() / self.temperature
        return self.mean.new_tensor(1 / self.temperature)

    @property
    def K_MM(self) -> Tensor:
        """The context's kernel ``J_M J_M^T`` (unscaled; see :mod:`._gp_kernel`)."""
        return self._fitted().k

    @property
    def L(self) -> Tensor:
        """The diagonal of the context's output Hessians ``(M, O)``."""
        return self._fitted().lam

    @property
    def mu(self) -> Tensor:
        """The scatter term's residuals ``(M, O)``."""
        return self._fitted().mu

    def _check_last_layer_at_fit(self, name: str) -> None:
        """The front door's last layer found without ``last_layer_name``: :meth:`fit` checks
        that module ``name`` runs last (on the first context sample)."""
        self._twin._check_last_layer_at_fit(name)

    def _jacobians(self, x: Any, keep: bool) -> tuple[Tensor, Tensor]:
        try:
            return self.backend.jacobians(x, keep, vector=True)
        except ValueError as err:
            raise ValueError(f"hessian_structure='gp': {err}") from None

    def _fitted(self) -> GPTerms:
        if self._terms is None:
            raise RuntimeError("call fit() before using the GP posterior")
        return self._terms

    # ------------------------------------------------------------------ the fit
    def fit(self, train_loader: Iterable[Any], progress_bar: bool = False) -> GPLaplace:
        """Draw the ``M`` context samples from ``train_loader`` (a DataLoader's dataset is
        indexed; another iterable is read once) and form the kernel, the output Hessians, the
        loss at the MAP over the context and the scatter residuals.

        Returns:
            ``self``.
        """
        show = check_bool(progress_bar, "progress_bar")
        ctx = self._context
        self.n_data = ctx.draw(train_loader, self.n_subset, self.seed)
        self._twin._first_batch(ctx.first())
        lam, mu, loss = [], [], 0.0
        for a, b, js, f in with_progress(ctx.first_pass(), show, "fit"):
            ys = ctx.y[a:b]  # type: ignore[index]
            terms = chunk_terms(js, f, ys, a, self.likelihood, self.prior_mean - self.mean)
            loss = loss + terms[0]
            lam.append(terms[1])
            mu.append(terms[2])
        self.n_outputs = int(lam[0].shape[1])
        k_mm = ctx.kernel_mm(self.independent_outputs, show)
        self._terms = GPTerms(k_mm, torch.cat(lam), torch.cat(mu), self.independent_outputs)
        self.loss = torch.as_tensor(loss, dtype=self.mean.dtype, device=self.mean.device)
        return self

    # ------------------------------------------------------------------ the predictive
    def __call__(
        self,
        x: Any,
        pred_type: Any = "gp",
        joint: bool = False,
        link_approx: str | LinkApprox = "probit",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The GP predictive at ``x`` (laplace-torch's ``la(x)``).

        Args:
            x: The query inputs ``(n, *in)`` (or a dict batch).
            pred_type: ``gp`` (``glm`` means the same here: the linearised network).
            joint: Regression: the mean ``(n O,)`` and covariance ``(n O, n O)`` over the batch.
            link_approx: Classification: ``probit``, ``bridge``, ``bridge_norm`` or ``mc``.
            n_samples: Samples of ``mc``.
            diagonal_output: Regression: the variances ``(n, O)``.
            generator: Seeds ``mc``.
            fitting: laplace-torch's flag of reward modelling (not taken here).

        Returns:
            Classification: probabilities ``(n, C)``. Regression: ``(f_mu, f_var)``,
            ``(n, O)`` and ``(n, O, O)``.
        """
        _check_pred_type(pred_type)
        joint, diagonal = check_bool(joint, "joint"), check_bool(diagonal_output, "diagonal_output")
        n_samples, generator = (
            check_positive_int(n_samples, "n_samples"),
            check_generator(generator),
        )
        if check_bool(fitting, "fitting"):
            raise ValueError("fitting=True is reward modelling's; hessian_structure='gp' has none")
        link = parse_enum(LinkApprox, link_approx, "link_approx")
        f_mu, f_var = self.predictive_moments(x, joint=joint)
        if self.likelihood is Likelihood.REGRESSION:
            if diagonal and not joint:
                return f_mu, torch.diagonal(f_var, dim1=1, dim2=2)
            return f_mu, f_var
        if link is LinkApprox.PROBIT:
            kappa = torch.rsqrt(1 + math.pi / 8 * torch.diagonal(f_var, dim1=1, dim2=2))
            return torch.softmax(kappa * f_mu, dim=-1)
        if link in (LinkApprox.BRIDGE, LinkApprox.BRIDGE_NORM):
            return _bridge(f_mu, f_var, normalised=link is LinkApprox.BRIDGE_NORM)
        return torch.softmax(_draw(f_mu, f_var, n_samples, generator), dim=-1).mean(0)

    def predictive_moments(self, x: Any, *, joint: bool = False) -> tuple[Tensor, Tensor]:
        """The network's outputs ``(n, O)`` and the GP's covariance ``(n, O, O)`` at ``x``
        (``joint``: ``(n O,)`` and ``(n O, n O)``)."""
        terms = self._fitted()
        j_star, f_mu = self._jacobians(x, self._twin.enable_backprop)
        s = self.gp_kernel_prior_variance
        chol = terms.cholesky(s, self._h_factor)
        k_m_star = self._context.k_m_star(j_star, self.independent_outputs)
        f_var = terms.variance(chol, s, j_star, k_m_star, joint)
        return (f_mu.reshape(-1) if joint else f_mu), f_var

    def functional_samples(
        self,
        x: Any,
        pred_type: Any = "gp",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Draws ``(n_samples, n, O)`` of the GP at ``x``."""
        _check_pred_type(pred_type)
        f_mu, f_var = self.predictive_moments(x)
        if check_bool(diagonal_output, "diagonal_output"):
            f_var = torch.diag_embed(torch.diagonal(f_var, dim1=1, dim2=2))
        n = check_positive_int(n_samples, "n_samples")
        return _draw(f_mu, f_var, n, check_generator(generator))

    def predictive_samples(
        self,
        x: Any,
        pred_type: Any = "gp",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """:meth:`functional_samples`, through a softmax for classification."""
        draws = self.functional_samples(x, pred_type, n_samples, diagonal_output, generator)
        return draws.softmax(-1) if self.likelihood is Likelihood.CLASSIFICATION else draws

    # ------------------------------------------------------------------ the evidence
    @property
    def log_likelihood(self) -> Tensor:
        """``-loss / (sigma^2 T) - N O log(sigma sqrt(2 pi))`` (regression; ``loss`` over the
        context, ``N`` the training samples, as laplace-torch) or ``-loss / T``."""
        value = -self._h_factor * self.loss
        if self.likelihood is Likelihood.REGRESSION:
            norm = (
                self.n_data * self.n_outputs * torch.log(self.sigma_noise * math.sqrt(2 * math.pi))
            )
            value = value - norm
        return value

    @property
    def log_det_ratio(self) -> Tensor:
        terms, s = self._fitted(), self.gp_kernel_prior_variance
        regression = self.likelihood is Likelihood.REGRESSION
        return terms.log_det_ratio(
            s, self._h_factor, self.sigma_noise.square() if regression else None
        )

    @property
    def scatter(self) -> Tensor:
        regression = self.likelihood is Likelihood.REGRESSION
        noise = self.sigma_noise.square() if regression else self.mean.new_tensor(1e-5)
        return self._fitted().scatter(self.gp_kernel_prior_variance, noise)

    def log_marginal_likelihood(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Tensor:
        """laplace-torch's GP evidence ``log_likelihood - (log_det_ratio + scatter) / 2``;
        the values given are stored, as laplace-torch does."""
        if prior_precision is not None:
            self.prior_precision = prior_precision
        if sigma_noise is not None:
            self.sigma_noise = sigma_noise
        return self.log_likelihood - 0.5 * (self.log_det_ratio + self.scatter)

    def optimize_prior_precision(
        self,
        pred_type: Any = "gp",
        method: str | TuningMethod = "marglik",
        n_steps: int = 100,
        lr: float = 1e-1,
        init_prior_prec: Any = 1.0,
        prior_structure: str = "scalar",
        val_loader: Iterable[Any] | None = None,
        loss: Any = None,
        log_prior_prec_min: float = -4,
        log_prior_prec_max: float = 4,
        grid_size: int = 100,
        link_approx: str | LinkApprox = "probit",
        n_samples: int = 100,
        verbose: bool = False,
        progress_bar: bool = False,
    ) -> None:
        """The prior precision (one value) by the evidence (``marglik``: Adam on its log) or
        by a grid search of the validation loss (``gridsearch``, with ``val_loader``); the
        arguments as :meth:`LaplaceBase.optimize_prior_precision`'s."""
        if getattr(prior_structure, "value", prior_structure) != "scalar":
            raise ValueError(
                f"hessian_structure='gp' takes prior_structure='scalar'; got {prior_structure!r}"
            )
        grid = (log_prior_prec_min, log_prior_prec_max, grid_size)
        link = parse_enum(LinkApprox, link_approx, "link_approx")
        how = ("gp", link, check_positive_int(n_samples, "n_samples"))
        optimize_gp_prior(self, method, (n_steps, lr, init_prior_prec), val_loader, loss, grid,
                          how, check_bool(progress_bar, "progress_bar"))  # fmt: skip
        if check_bool(verbose, "verbose"):
            print(f"Optimized prior precision is {self.prior_precision}.")

    # ------------------------------------------------------------------ saving
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only: the fit's terms, its context (inputs, targets) and
        the prior, noise and temperature."""
        terms = self._fitted()
        return {
            "mean": self.mean, **self._context.state(), "K_MM": terms.k,
            "L": terms.lam, "mu": terms.mu,
            "loss": self.loss, "n_data": self.n_data, "n_outputs": self.n_outputs,
            "n_subset": self.n_subset, "independent_outputs": self.independent_outputs,
            "seed": self.seed, "prior_mean": self.prior_mean,
            "prior_precision": self.prior_precision, "sigma_noise": self.sigma_noise,
            "temperature": self.temperature, "likelihood": self.likelihood.value,
            "cls_name": type(self).__name__,
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` onto a posterior of the same model and options."""
        if state.get("cls_name") != type(self).__name__:
            raise ValueError(
                f"a {state.get('cls_name')} state does not load into a {type(self).__name__}"
            )
        if state["likelihood"] != self.likelihood.value:
            raise ValueError(
                f"the state's likelihood is {state['likelihood']!r}, this one's {self.likelihood.value!r}"
            )
        if state["mean"].shape != self.mean.shape:
            raise ValueError(
                f"the state has {state['mean'].numel()} parameters, this posterior {self.n_params}"
            )
        self._context.load(state)
        self._terms = GPTerms(state["K_MM"], state["L"], state["mu"], state["independent_outputs"])
        self.loss, self.n_data, self.n_outputs = state["loss"], state["n_data"], state["n_outputs"]
        self.n_subset, self.seed = state["n_subset"], state["seed"]
        self.independent_outputs = state["independent_outputs"]
        self.prior_mean, self.prior_precision = state["prior_mean"], state["prior_precision"]
        self.sigma_noise, self.temperature = state["sigma_noise"], state["temperature"]

    def __repr__(self) -> str:
        return (
            f"GPLaplace(likelihood={self.likelihood.value!r}, n_subset={self.n_subset}, "
            f"independent_outputs={self.independent_outputs}, P={self.n_params})"
        )


def _check_pred_type(pred_type: Any) -> None:
    """``gp`` (``glm`` means the same here: the linearised network); ``nn`` is refused."""
    if getattr(pred_type, "value", pred_type) not in ("gp", "glm"):
        raise ValueError(f"hessian_structure='gp' predicts with pred_type='gp'; got {pred_type!r}")


def _draw(mean: Tensor, cov: Tensor, n: int, generator: torch.Generator | None) -> Tensor:
    """``n`` draws of ``N(mean_i, cov_i)`` per sample: ``(n, *mean.shape)`` (checked
    arguments)."""
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
    chol = torch.linalg.cholesky(cov + 1e-10 * eye)  # a jitter: the GP's covariance is PSD
    z = torch.randn((n, *mean.shape), generator=generator, dtype=mean.dtype).to(mean.device)
    return mean + torch.einsum("bij,sbj->sbi", chol, z)
