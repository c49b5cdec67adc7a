"""String enums for every option set, the fallback warning and the library's errors.

Every option that takes one of a fixed set of strings has an enum here. The enums subclass
``str``, so ``Strategy.VMAP == "vmap"`` and users may pass either form. Unknown strings raise a
``ValueError`` that quotes the value and lists the choices (see :func:`parse_enum`).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = [
    "ArgumentTypeError",
    "BatchNormPolicy",
    "Entries",
    "Estimator",
    "FallbackWarning",
    "ModuleStateWarning",
    "FisherKind",
    "FisherMethod",
    "HessianKind",
    "HessianStructure",
    "InputKind",
    "JacNormMethod",
    "LayerRule",
    "Layout",
    "Likelihood",
    "LinkApprox",
    "MemoryBudgetError",
    "Mode",
    "PredType",
    "PriorStructure",
    "Randomness",
    "Strategy",
    "SubsetOfWeights",
    "TuningMethod",
    "Tune",
    "UnsupportedOpError",
    "parse_enum",
    "parse_tune",
]


class _StrEnum(str, Enum):
    """A ``str`` enum whose ``str()`` is its value (like ``enum.StrEnum`` on Python 3.11)."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


class Strategy(_StrEnum):
    """How samples are batched through the model.

    * ``auto``: ``vmap`` when all samples share one shape signature, else ``bucketed`` or
      ``padded``, whichever the cost model (``docs/padded.md``) expects to be cheaper.
    * ``vmap``: one vectorised call over all samples (needs one shape signature).
    * ``bucketed``: ``vmap`` within each group of samples with identical shape signatures.
    * ``padded``: one vectorised call over the zero-padded batch with masked execution, exact
      for models built from ops with a rule (``multiscale_jac.masked``).
    * ``loop``: the reference path, one sample and one output row at a time.
    """

    AUTO = "auto"
    VMAP = "vmap"
    BUCKETED = "bucketed"
    PADDED = "padded"
    LOOP = "loop"


class Mode(_StrEnum):
    """Autodiff mode: ``rev`` (vmap over ``jacrev``), ``fwd`` (vmap over JVPs), or ``auto``."""

    AUTO = "auto"
    REV = "rev"
    FWD = "fwd"


class Entries(_StrEnum):
    """How Jacobian columns of conv/linear weight and bias entries are computed: ``structured``
    (the layer's closed form, :mod:`~multiscale_jac.entries` forward /
    :mod:`~multiscale_jac.structured` reverse), ``generic`` (one-hot tangents or full
    gradients of the reparametrised tensor), or ``auto`` (per tensor, by the cost model)."""

    AUTO = "auto"
    STRUCTURED = "structured"
    GENERIC = "generic"


class Tune(_StrEnum):
    """How ``auto`` picks a route: ``auto`` (default) by the cost model, priced on this
    machine from the model's ops and flops (:mod:`~multiscale_jac._calibration`), or a
    choice ``measure`` made before for the same shapes; nothing is timed, so no call is
    slower for being the first or the second. ``measure`` times the candidates on the call
    itself (opt-in, like ``torch.backends.cudnn.benchmark``) and keeps the fastest per shapes
    (it can be saved: :mod:`multiscale_jac.tuning`); ``estimate`` is the cost model alone,
    nothing recalled. ``True`` means ``measure`` and ``False`` ``estimate`` on every entry
    point that takes ``tune`` (docs/design.md, "How the library chooses")."""

    AUTO = "auto"
    MEASURE = "measure"
    ESTIMATE = "estimate"


def parse_tune(value: object) -> Tune:
    """``tune=``: a :class:`Tune` or its string, ``True`` (``measure``) or ``False``
    (``estimate``)."""
    if value is True:
        return Tune.MEASURE
    if value is False:
        return Tune.ESTIMATE
    return parse_enum(Tune, value, "tune")


class Randomness(_StrEnum):
    """Random ops (dropout in train mode) under vmap, as in ``torch.func.vmap``.

    ``error`` (default) refuses them, ``different`` draws independently per sample, ``same``
    draws once for all samples of a vectorised call.
    """

    ERROR = "error"
    DIFFERENT = "different"
    SAME = "same"


class BatchNormPolicy(_StrEnum):
    """What to do with batch-statistics layers (BatchNorm) that are in train mode.

    ``error`` (default) raises; ``eval`` runs them with their running statistics, as in eval
    mode, without touching the model (running statistics are not updated).
    """

    ERROR = "error"
    EVAL = "eval"


class Layout(_StrEnum):
    """Layouts :func:`multiscale_jac.pack` can build: ``padded`` (always) and ``nested``."""

    PADDED = "padded"
    NESTED = "nested"


class InputKind(_StrEnum):
    """The structure the user passed to :func:`multiscale_jac.pack`.

    ``tensor``: one batched tensor ``(N, C, *spatial)``; the model gets ``(1, C, *spatial)``.
    ``tensors``: a list of N tensors ``(C, *spatial)``, one per sample (sizes may differ); the
    model gets ``(1, C, *spatial)``.
    ``levels``: L batched tensors ``(N, C_l, *spatial_l)`` in a list or a mapping; the model
    gets a list (or the same mapping type with the same keys).
    ``samples``: a list of N samples, each a list (or mapping) of L tensors; the model gets a
    list (or mapping).
    """

    TENSOR = "tensor"
    TENSORS = "tensors"
    LEVELS = "levels"
    SAMPLES = "samples"


class Likelihood(_StrEnum):
    """``classification`` (softmax categorical over dim 1 of the output) or ``regression``
    (Gaussian with ``sigma_noise``)."""

    CLASSIFICATION = "classification"
    REGRESSION = "regression"


class FisherKind(_StrEnum):
    """``empirical``, ``mc`` or ``exact`` (see the module docstring)."""

    EMPIRICAL = "empirical"
    MC = "mc"
    EXACT = "exact"


class FisherMethod(_StrEnum):
    """How per-sample terms are formed.

    * ``auto``: ``layerwise`` for the tensors with a per-layer closed form, ``vmap`` for the
      rest, unless ``vmap`` for all is faster: on a first batch of at least 16 samples both
      are timed on chunks of it (their sums count) and the choice is cached per shapes; a
      failure of the layer-wise run (a model that mixes samples in a batch, a parameter read
      outside its layer) falls back to ``vmap`` with a :class:`FallbackWarning`.
    * ``layerwise``: every selected tensor by its closed form (:mod:`~multiscale_jac.layerwise`);
      raises if one has none.
    * ``vmap``: ``torch.func.vmap(grad)`` per shape bucket (``exact``: per-sample Jacobians).
    """

    AUTO = "auto"
    LAYERWISE = "layerwise"
    VMAP = "vmap"


class JacNormMethod(_StrEnum):
    """How ``S`` and its gradient are computed.

    * ``auto``: the fastest of the routes below that can run (``vmap`` also at half its
      chunk), each timed on one chunk of the job itself when the largest shape bucket has
      samples for all (``tune``), else ``vmap``; the choice is cached per shapes.
    * ``layerwise``: one batched forward per chunk, one data-only backward per output row (or
      probe) with ``create_graph``, per-sample layer gradients squared in closed form
      (:mod:`~multiscale_jac.layerwise`), then one backward of the chunk's ``S``.
    * ``vmap``: reverse over reverse: per-sample gradients of every output row by
      ``vmap(grad)``, the chunk's squared norm, then its gradient by one more reverse pass (what
      ``torch.func`` users write, chunked); any model.
    * ``hvp``: per sample and output row, ``grad`` then a forward-over-reverse Hessian-vector
      product (``jvp`` of ``grad``), vectorised with ``vmap``; any deterministic model.
    """

    AUTO = "auto"
    LAYERWISE = "layerwise"
    VMAP = "vmap"
    HVP = "hvp"


class Estimator(_StrEnum):
    """``exact`` (every output row) or ``hutchinson`` (random output-space probes)."""

    EXACT = "exact"
    HUTCHINSON = "hutchinson"


class HessianKind(_StrEnum):
    """``ggn`` (``J^T Lambda J``) or ``empirical`` (sum of outer products of the per-sample
    gradients of the negative log-likelihood at the training labels)."""

    GGN = "ggn"
    EMPIRICAL = "empirical"


class LinkApprox(_StrEnum):
    """How class probabilities are read off the Gaussian over logits.

    * ``probit``: ``softmax(f / sqrt(1 + pi/8 var))`` per position (marginal variances only).
    * ``mc``: mean of ``softmax`` over ``n_samples`` exact joint samples ``f + J L^{-T} z``.
    * ``bridge``: the Laplace bridge (Hobbhahn et al. 2022) on the per-position ``C x C``
      covariance, with laplace-torch's zero-mean correction.
    * ``bridge_norm``: ``bridge`` with laplace-torch's variance correction (the logits and
      variances scaled so the mean marginal variance is ``sqrt(C / 2)``).
    """

    PROBIT = "probit"
    MC = "mc"
    BRIDGE = "bridge"
    BRIDGE_NORM = "bridge_norm"


class PriorStructure(_StrEnum):
    """The shape of a fitted prior precision.

    * ``scalar``: one precision (stored as a one-element tensor, as in laplace-torch).
    * ``layerwise`` (laplace-torch's name) or ``tensor``: one per selected parameter tensor.
    * ``diag``: one per selected entry, ``(P,)``.
    """

    SCALAR = "scalar"
    TENSOR = "tensor"
    LAYERWISE = "layerwise"
    DIAG = "diag"


class SubsetOfWeights(_StrEnum):
    """Which weights :func:`~multiscale_jac.laplace.Laplace` treats probabilistically.

    * ``all``: every parameter that requires grad.
    * ``last_layer``: the weight and bias of the last ``nn.Linear`` (registration order), or
      of the last module that owns parameters when there is no ``nn.Linear``.
    * ``subnetwork``: the entries given by ``subnetwork_indices``.
    """

    ALL = "all"
    LAST_LAYER = "last_layer"
    SUBNETWORK = "subnetwork"


class HessianStructure(_StrEnum):
    """The structure of the curvature: ``full`` (``P x P``), ``diag`` (``(P,)``), ``kron``
    (Kronecker factors per Linear/Conv tensor, K-FAC) or ``gp`` (function space: the kernel
    ``J J^T`` of a context of training samples, laplace-torch's ``FunctionalLaplace``)."""

    FULL = "full"
    DIAG = "diag"
    KRON = "kron"
    GP = "gp"


class PredType(_StrEnum):
    """The predictive: ``glm`` (linearised, ``f(x) + J (theta - theta_MAP)``) or ``nn`` (the
    model itself run with posterior samples of the parameters)."""

    GLM = "glm"
    NN = "nn"


class TuningMethod(_StrEnum):
    """How the prior precision is tuned: ``marglik`` (Adam on the log marginal likelihood) or
    ``gridsearch`` (the validation loss over a log-spaced grid)."""

    MARGLIK = "marglik"
    GRIDSEARCH = "gridsearch"


class LayerRule(_StrEnum):
    """How a tensor's sum of squared per-sample gradients is computed (see module docstring)."""

    GRAM = "gram"
    PER_SAMPLE = "per_sample"
    NORM_AFFINE = "norm_affine"
    VMAP = "vmap"


class ArgumentTypeError(TypeError, ValueError):
    """A value of the wrong type where laplace-torch raises ``ValueError`` (a string noise
    scale, float class labels): a ``TypeError`` as everywhere in this library, and a
    ``ValueError`` for code written against laplace-torch."""


class FallbackWarning(UserWarning):
    """Emitted when the engine runs a different strategy than the one requested."""


class ModuleStateWarning(UserWarning):
    """A module's forward wrote attributes (a cache, a counter) that the per-sample runs put
    back, so that the model is left as found; shown once per module and attributes."""


class UnsupportedOpError(ValueError):
    """An op that has no exact rule on padded inputs (the engine falls back; see docs)."""

    def __init__(
        self, op: str, module: str | None, reason: str, *, context: str = "padded execution"
    ) -> None:
        self.op = op
        self.module = module
        self.reason = reason
        where = f" in module {module!r}" if module else ""
        super().__init__(f"{context}: {op}{where}: {reason}")


class MemoryBudgetError(ValueError):
    """A ``memory_budget`` below the estimated minimum of the call (every entry point raises
    this one error; ``minimum`` is the smallest budget that would be accepted)."""

    def __init__(self, budget: int, minimum: int, detail: str) -> None:
        self.budget = budget
        self.minimum = minimum
        super().__init__(
            f"memory_budget={budget} bytes is below the estimated minimum of {minimum} bytes "
            f"({minimum / 2**20:.1f} MiB): {detail}. Pass memory_budget=None for the default "
            f"or at least {minimum}"
        )


_E = TypeVar("_E", bound=_StrEnum)


def parse_enum(cls: type[_E], value: object, argname: str) -> _E:
    """Convert ``value`` to the enum ``cls`` or raise an error that quotes it.

    Args:
        cls: The enum class.
        value: A member of ``cls`` or its string value.
        argname: The argument's name, used in the error message.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` is not one of the choices.
    """
    if isinstance(value, cls):
        return value
    choices = ", ".join(repr(m.value) for m in cls)
    if not isinstance(value, str):
        raise TypeError(f"{argname} must be a string, one of {choices}; got {value!r}")
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"unknown {argname} {value!r}; expected one of {choices}") from None
