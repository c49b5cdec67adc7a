"""String enums for every option set, and the warning category for fallbacks.

Every option that takes one of a fixed set of strings has an enum here. The enums subclass
``str``, so ``Strategy.VMAP == "vmap"`` and users may pass either form. Unknown strings raise a
``ValueError`` that quotes the value and lists the choices (see :func:`parse_enum`).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = [
    "BatchNormPolicy",
    "Entries",
    "FallbackWarning",
    "InputKind",
    "Layout",
    "Mode",
    "Randomness",
    "Strategy",
    "parse_enum",
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
    ``levels``: a list of L batched tensors ``(N, C_l, *spatial_l)``; the model gets a list.
    ``samples``: a list of N samples, each a list of L tensors; the model gets a list.
    """

    TENSOR = "tensor"
    LEVELS = "levels"
    SAMPLES = "samples"


class FallbackWarning(UserWarning):
    """Emitted when the engine runs a different strategy than the one requested."""


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
