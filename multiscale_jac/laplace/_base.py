"""What both Laplace classes share: the checked options, the state of a fit and the prior.

:class:`LaplaceBase` holds them; the parts (:mod:`._curvature`, :mod:`._posterior`,
:mod:`._marglik`, :mod:`._predictive`) are mixins on it that read this state, and a Laplace class
is a base plus one curvature route and one posterior form (:class:`SubnetLaplace`: the subset
GGN and the full form; :class:`DiagLaplace`: the diagonal from ``diag_fisher`` and the diagonal
form).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .._checks import (
    check_bool,
    check_chunk_size,
    check_int,
    check_memory_budget,
    check_noise,
    check_positive_number,
    prepare,
)
from .._likelihood import output_dim
from ..enums import (
    ArgumentTypeError,
    BatchNormPolicy,
    Entries,
    HessianKind,
    InputKind,
    Likelihood,
    Mode,
    Randomness,
    SubsetOfWeights,
    Tune,
    parse_enum,
    parse_tune,
)
from ..subset import ParamSubset
from ._backends import CurvatureBackend, backend_hessian
from ._batches import DictPairs

if TYPE_CHECKING:
    from .._checks import Prepared

__all__ = ["LaplaceBase"]


#: laplace-torch's likelihood for preference learning: a classification of the pair's rewards
#: ``(N, 2)`` in the fit, a regression of one reward ``(N, 1)`` in the predictive
REWARD_MODELING = "reward_modeling"


def fitting(fit: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a class's ``fit``: it runs under :meth:`LaplaceBase._fitting`."""

    @functools.wraps(fit)
    def run(self: LaplaceBase, *args: Any, **kwargs: Any) -> Any:
        with self._fitting():
            return fit(self, *args, **kwargs)

    return run


class LaplaceBase:
    """The state every Laplace class keeps, checked on construction (the arguments are
    :class:`~multiscale_jac.SubnetLaplace`'s), and the prior precision's forms.

    State of a fit: ``H`` (the curvature in the class's layout: ``(P, P)``, ``(P,)``; ``None``
    before :meth:`fit`), ``loss`` (the negative log-likelihood at the MAP, at ``sigma = 1``;
    a float in ``_loss``), ``n_data``, ``n_outputs`` (laplace-torch's meaning: the size of
    dim 1 of the model's output after ``output_fn``, i.e. classes or regression outputs;
    ``None`` before :meth:`fit`) and ``_n_entries`` (regression output entries seen, the
    marginal likelihood's ``n_out``); ``_scale`` caches the posterior form's scale until the
    curvature or the prior change.
    """

    _prep: Prepared

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: ParamSubset | str | Sequence[str],
        *,
        prior_precision: Any = 1.0,
        sigma_noise: float = 1.0,
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
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: Any = None,
        backend_kwargs: dict[str, Any] | None = None,
        asdl_fisher_kwargs: dict[str, Any] | None = None,
    ) -> None:
        hessian, self._backend_name = backend_hessian(
            backend, backend_kwargs, asdl_fisher_kwargs, hessian
        )
        self._prep = prepare(
            model,
            params=subset,
            params_name="subset",
            output_fn=output_fn,
            batch_norm=batch_norm,
            randomness=randomness,
            input_kind=input_kind,
        )
        self.model, self.subset, self.output_fn = model, self._prep.subset, output_fn
        self.likelihood = likelihood
        self.hessian = parse_enum(HessianKind, "ggn" if hessian is None else hessian, "hessian")
        self.enable_backprop = check_bool(enable_backprop, "enable_backprop")
        for key, what in ((dict_key_x, "dict_key_x"), (dict_key_y, "dict_key_y")):
            if not isinstance(key, str):
                raise TypeError(f"{what} must be a str; got {key!r}")
        self.dict_key_x, self.dict_key_y = dict_key_x, dict_key_y
        self.ignore_index = check_int(ignore_index, "ignore_index")
        self.chunk_size = check_chunk_size(chunk_size)
        self.memory_budget = check_memory_budget(memory_budget)
        self.strict = check_bool(strict, "strict")
        self.entries = parse_enum(Entries, entries, "entries")
        self.mode = parse_enum(Mode, mode, "mode")
        self.tune = parse_tune(tune)
        #: the MAP: the model's values of the subset at construction (the predictive runs the
        #: model itself, so they must stay its values)
        self._map = self.subset.flatten(self.subset.check_model(model)).detach().clone()
        self.temperature = check_positive_number(temperature, "temperature")
        self._scale: Tensor | None = None
        self.sigma_noise = sigma_noise
        self.prior_mean = self._vector(prior_mean, "prior_mean", positive=False)
        #: the posterior's mean: the prior mean until :meth:`fit` (an unfitted posterior is
        #: the prior, as laplace-torch's), the MAP after
        self.mean = self.prior_mean.detach().clone()
        self._prior_precision = self._prior_form(prior_precision, "prior_precision", positive=True)
        self.H: Any = None  # the curvature, in the class's layout
        self._loss = 0.0
        self.n_data = 0
        self._n_entries = 0
        self.n_outputs: int | None = None
        self._fallbacks: list[str] = []
        #: laplace-torch's ``subset_of_weights`` where :func:`Laplace` built this posterior
        #: (``None``: a class called directly)
        self.subset_of_weights: SubsetOfWeights | None = None
        self._model_kwargs: dict[str, Any] = {}  # la(x, **model_kwargs) while it runs
        self._memo = None

    @property
    def likelihood(self) -> Likelihood:
        """``classification`` or ``regression`` (assign a string or the enum); laplace-torch's
        ``"reward_modeling"`` is a classification while :meth:`fit` runs (a model's pair of
        rewards ``(N, 2)`` for preference labels) and a regression otherwise (the predictive
        of one reward)."""
        return self._likelihood

    @likelihood.setter
    def likelihood(self, value: str | Likelihood) -> None:
        self._reward = value == REWARD_MODELING
        try:
            self._likelihood = (
                Likelihood.REGRESSION
                if self._reward
                else parse_enum(Likelihood, value, "likelihood")
            )
        except ValueError as err:
            raise ValueError(f"{err}, or {REWARD_MODELING!r} (laplace-torch's)") from None
        self._scale = None

    @contextlib.contextmanager
    def _fitting(self) -> Iterator[None]:
        """Inside a fit: the mean becomes the MAP; ``reward_modeling`` is a classification (of
        preference pairs)."""
        self.mean = self._map
        if not self._reward:
            yield
            return
        self._likelihood = Likelihood.CLASSIFICATION
        try:
            yield
        finally:
            self._likelihood = Likelihood.REGRESSION

    @property
    def sigma_noise(self) -> Tensor:
        """The Gaussian noise scale (regression; 1 for classification), a 0-d tensor as
        laplace-torch's (a tensor given is kept as it is, e.g. a tuned noise that requires
        grad; a number becomes one of the MAP's dtype). Assigning it resets the cached
        posterior scale."""
        return self._sigma_noise

    @sigma_noise.setter
    def sigma_noise(self, value: Any) -> None:
        noise = check_noise(value, "sigma_noise")
        if self.likelihood is Likelihood.CLASSIFICATION and float(noise) != 1.0:
            raise ValueError(f"sigma_noise must be 1 for classification; got {value!r}")
        if not isinstance(noise, Tensor):
            noise = torch.tensor(noise, dtype=self._map.dtype, device=self._map.device)
        self._sigma_noise = noise
        self._scale = None

    def _batched_options(self) -> dict[str, Any]:
        """The options a fit by batched runs (``diag_fisher``, ``kron_factors``) takes."""
        return {
            "output_fn": self.output_fn,
            "ignore_index": self.ignore_index,
            "input_kind": self._prep.input_kind,
            "chunk_size": self.chunk_size,
            "memory_budget": self.memory_budget,
            "randomness": self._prep.randomness,
            "batch_norm": "eval" if self._prep.eval_batch_norm else "error",
        }

    @property
    def backend(self) -> CurvatureBackend:
        """laplace-torch's ``la.backend``: the curvature's description (no object of another
        library is involved)."""
        return CurvatureBackend(self)

    @property
    def n_params(self) -> int:
        """``P``, the number of entries the posterior is over."""
        return self.subset.numel

    # ------------------------------------------------------------------ prior
    @property
    def prior_precision(self) -> Tensor:
        """The prior precision as given: ``(1,)`` (one value, as laplace-torch stores a scalar),
        ``(K,)`` (one per selected tensor) or ``(P,)``. Assign a number, a tensor, a sequence
        or ``{name: value}``; the cached posterior factor is then recomputed."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: Any) -> None:
        self._prior_precision = self._prior_form(value, "prior_precision", positive=True)
        self._scale = None

    @property
    def prior_precision_diag(self) -> Tensor:
        """The prior precision expanded to the ``(P,)`` diagonal ``p_0``."""
        return self._expand(self._prior_precision)

    def _prior(self, prior_precision: Any) -> Tensor:
        if prior_precision is None:
            return self.prior_precision_diag
        return self._vector(prior_precision, "prior_precision", positive=True)

    def _vector(self, value: Any, what: str, positive: bool) -> Tensor:
        """A number, ``(P,)``, one value per selected tensor (sequence or dict) -> ``(P,)``."""
        return self._expand(self._prior_form(value, what, positive))

    def _prior_form(self, value: Any, what: str, positive: bool) -> Tensor:
        """A number, ``(P,)``, one value per selected tensor (sequence or dict), checked, as a
        1-d tensor of 1, ``K`` (selected tensors) or ``P`` values (differentiable)."""
        p, names = self.subset.numel, self.subset.names
        dtype, device = self._map.dtype, self._map.device
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
            torch.as_tensor(value, dtype=dtype, device=device)
            if not isinstance(value, Tensor)
            else value.to(dtype=dtype, device=device)
        )
        if t.dim() > 1 or t.numel() not in (1, p, len(names)):
            raise ValueError(
                f"{what} must be a number, P={p} values or one per selected tensor "
                f"({len(names)}); got shape {tuple(t.shape)}"
            )
        if positive and not bool((t.detach() > 0).all()):
            raise ValueError(f"{what} must be positive; got {value!r}")
        return t.reshape(-1)

    def _expand(self, t: Tensor) -> Tensor:
        """A checked 1-d form (:meth:`_prior_form`) -> the ``(P,)`` diagonal in flat order."""
        p = self.subset.numel
        if t.numel() == p:
            return t
        if t.numel() == 1:
            return t.reshape(()).expand(p)
        sizes = [b - a for a, b in self.subset.offsets.values()]
        return self.subset.to_flat_order(
            torch.repeat_interleave(t, torch.tensor(sizes, device=t.device))
        )

    @property
    def loss(self) -> Tensor:
        """The negative log-likelihood at the MAP summed over the fitted data, at ``sigma = 1``
        (a 0-d tensor, as laplace-torch's; 0 before :meth:`fit`)."""
        return torch.tensor(self._loss, dtype=self.mean.dtype, device=self.mean.device)

    @property
    def n_params_subnet(self) -> int:
        """laplace-torch's name for :attr:`n_params` of a subnetwork Laplace."""
        return self.subset.numel

    # ------------------------------------------------------------------ dict batches
    def _data(self, data: Iterable[Any]) -> Iterable[Any]:
        """``data`` with laplace-torch's dict batches (``{dict_key_x: ..., dict_key_y: ...,
        ...}``, e.g. Hugging Face's) as ``(inputs, targets)`` pairs: the targets are
        ``batch[dict_key_y]`` and the inputs the batch without that key, a dict the model is
        called with (one sample's entries each); other batches pass unchanged."""
        return DictPairs(data, self.dict_key_x, self.dict_key_y)

    def _inputs(self, inputs: Any) -> Any:
        """Predictive inputs: a dict batch (holding ``dict_key_x`` and ``dict_key_y``) without
        its ``dict_key_y`` entry (see :meth:`_data`); a dict of levels passes unchanged."""
        if isinstance(inputs, Mapping) and {self.dict_key_x, self.dict_key_y} <= set(inputs):
            return {k: v for k, v in inputs.items() if k != self.dict_key_y}
        return inputs

    # ------------------------------------------------------------------ state
    def _record_fit(
        self,
        h: Any,
        loss: float,
        samples: int,
        entries: int,
        output_dim: int,
        override: bool,
        combine: Callable[[Any, Any], Any] = lambda old, new: old + new,
    ) -> None:
        """Store a fit over a pass of data: its curvature ``h`` replaces the previous fit's
        (``override``, or none yet) or is combined with it (``combine(old, new)``, called
        before the counts grow); the loss, samples and regression ``entries`` add up."""
        if override or self.H is None:
            self.H, self._loss, self.n_data, self._n_entries = h, 0.0, 0, 0
        else:
            self.H = combine(self.H, h)
        self._loss += loss
        self.n_data += samples
        self._n_entries += entries
        self.n_outputs = output_dim
        self._scale = None

    def _seen_output(self, shape: Sequence[int]) -> None:
        """Record ``n_outputs`` from a sample's output shape ``(C, *spatial)`` or ``(O,)``."""
        self.n_outputs = output_dim(tuple(shape))

    def _fitted(self) -> Tensor:
        if self.H is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(data) first")
        return self.H

    def __repr__(self) -> str:
        fitted = f"fitted on {self.n_data} samples" if self.H is not None else "not fitted"
        return (
            f"{type(self).__name__}(likelihood={self.likelihood.value!r}, P={self.subset.numel}, "
            f"hessian={self.hessian.value!r}, {fitted})"
        )
