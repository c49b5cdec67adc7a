"""Sizes read from padded tensors (private, execution layer).

Under masked execution a padded tensor's shape is the batch's largest extent, while the unpadded
model reads every sample's own. A model that turns a size into data (``torch.linspace(0, 1, w)``,
``x.sum(-1) / w``, ``torch.arange(h * w)``) would compute with the wrong number and no error.
So :class:`~multiscale_jac.masked.MaskedMode` answers ``x.shape``, ``x.size()``, ``x.numel()``
and ``len(x)`` of a tracked tensor with :class:`PaddedSize` where a dim is padded: an ``int``
equal to the padded extent (layout ops read it as the tensor's own shape) that also carries
every sample's own value, ``per_sample`` ``(N,)``. Python arithmetic on it keeps both
(``h * w``, ``w // 2``, ``w - 1``; ``/`` gives a :class:`PaddedFloat`), a comparison or a truth
test whose answer differs between the padded extent and some sample's own value raises the
mode's :class:`~multiscale_jac.UnsupportedOpError` (the unpadded model would take another
branch), and so does ``int()`` or ``float()`` of one that differs (the plain number would lose
the per-sample values).
How ops use them is the mode's business (:mod:`~multiscale_jac.masked`): as a shape, as a
per-sample scalar, as the extent of a new tracked tensor, or refused.

What cannot be seen: a size used as a Python loop bound (``range(w)``) runs over the padded
extent, and a Python ``float`` on the left of an operator (``0.5 * w``, ``1.0 / w``) takes the
``int`` as it is (Python asks ``float`` first and it accepts any ``int``): ``w * 0.5`` and
``w ** -1`` keep the per-sample values.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["PaddedFloat", "PaddedNumber", "PaddedSize", "has_padded", "make_number", "plain"]


class PaddedNumber:
    """Mixin of :class:`PaddedSize` and :class:`PaddedFloat`: ``per_sample`` ``(N,)`` (int64
    or float64, concrete) beside the padded value (the number itself), and the ``mode`` that
    read it (it names the module in errors: ``mode.diverged(what, reason)``)."""

    per_sample: Tensor
    mode: Any

    def plain(self) -> int | float:
        raise NotImplementedError  # pragma: no cover - each subclass defines it


def make_number(value: int | float, per_sample: Tensor, mode: Any) -> Any:
    """``value`` with its per-sample values (a plain number where every sample agrees)."""
    if isinstance(value, bool) or bool((per_sample == value).all()):
        return value
    if isinstance(value, int):
        out: Any = int.__new__(PaddedSize, value)
        out.per_sample = per_sample.to(torch.int64)
    else:
        out = float.__new__(PaddedFloat, value)
        out.per_sample = per_sample.to(torch.float64)
    out.mode = mode
    return out


def _table(x: Any) -> Any:
    return x.per_sample if isinstance(x, PaddedNumber) else x


def _plain_value(x: Any) -> Any:
    return x.plain() if isinstance(x, PaddedNumber) else x


def _numeric(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _arith(op: Callable[[Any, Any], Any], reflected: bool = False) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        if not _numeric(other):
            return NotImplemented
        a, b = (other, self) if reflected else (self, other)
        value = op(_plain_value(a), _plain_value(b))
        if not _numeric(value):
            return value
        ta, tb = _table(a), _table(b)
        if isinstance(value, float):  # per sample in float64 too (int64 / int64 is float32)
            ta, tb = (t.double() if isinstance(t, Tensor) else t for t in (ta, tb))
        return make_number(value, op(ta, tb), self.mode)

    return method


def _compare(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        if not _numeric(other):
            return NotImplemented
        value = op(self.plain(), _plain_value(other))
        per = op(self.per_sample, _table(other))
        _same(value, per, f"a comparison ({op.__name__})", self)
        return value

    return method


def _same(value: Any, per: Tensor, what: str, number: PaddedNumber) -> None:
    if bool((per != value).any()):
        raise number.mode.diverged(
            what,
            f"a size read from a padded tensor's shape decides it: the padded extent gives "
            f"{value!r}, but the samples' own sizes {_show(number)} do not all give it (the "
            "unpadded model would take another branch or use another number)",
        )


def _show(number: PaddedNumber) -> str:
    values = number.per_sample.tolist()
    return str(values[:8])[:-1] + (", ...]" if len(values) > 8 else "]")


def _unary(op: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def method(self: Any) -> Any:
        return make_number(op(self.plain()), op(self.per_sample), self.mode)

    return method


_ARITH = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "truediv": operator.truediv,
    "pow": operator.pow,
}
_COMPARE = [operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge]


def _install(cls: type) -> type:
    for name, op in _ARITH.items():
        setattr(cls, f"__{name}__", _arith(op))
        setattr(cls, f"__r{name}__", _arith(op, reflected=True))
    for op in _COMPARE:
        setattr(cls, f"__{op.__name__}__", _compare(op))
    cls.__neg__ = _unary(operator.neg)
    cls.__pos__ = _unary(operator.pos)
    cls.__abs__ = _unary(operator.abs)
    cls.__hash__ = lambda self: hash(self.plain())
    return cls


@_install
class PaddedSize(PaddedNumber, int):
    """An ``int`` read from a padded tensor's shape (see the module docstring)."""

    def plain(self) -> int:
        return int.__int__(self)

    def __bool__(self) -> bool:
        value = self.plain() != 0
        _same(value, self.per_sample != 0, "a truth test", self)
        return value

    def __int__(self) -> int:
        _same(self.plain(), self.per_sample, "int()", self)
        return self.plain()

    def __float__(self) -> float:
        _same(self.plain(), self.per_sample, "float()", self)
        return float(self.plain())

    def __repr__(self) -> str:  # as the int it is (a model may build keys or names of it)
        return repr(self.plain())

    __str__ = __repr__


@_install
class PaddedFloat(PaddedNumber, float):
    """A ``float`` computed from sizes read from a padded tensor's shape."""

    def plain(self) -> float:
        return float.__float__(self)

    def __bool__(self) -> bool:
        value = self.plain() != 0
        _same(value, self.per_sample != 0, "a truth test", self)
        return value

    def __int__(self) -> int:
        _same(int(self.plain()), self.per_sample.trunc(), "int()", self)
        return int(self.plain())

    def __float__(self) -> float:
        _same(self.plain(), self.per_sample, "float()", self)
        return self.plain()

    def __floor__(self) -> Any:
        return make_number(int(self.plain() // 1), torch.floor(self.per_sample), self.mode)

    def __ceil__(self) -> Any:
        return make_number(-int(-self.plain() // 1), torch.ceil(self.per_sample), self.mode)

    def __round__(self, ndigits: int | None = None) -> Any:
        if ndigits is not None:
            per = self.per_sample.round(decimals=ndigits)
            return make_number(round(self.plain(), ndigits), per, self.mode)
        return make_number(round(self.plain()), self.per_sample.round(), self.mode)

    def __repr__(self) -> str:
        return repr(self.plain())

    __str__ = __repr__


def has_padded(args: tuple, kwargs: dict) -> bool:
    """Whether a :class:`PaddedNumber` is among ``args``/``kwargs`` (also in lists, tuples)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, PaddedNumber):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(b, PaddedNumber) for b in a):
            return True
    return False


def plain(x: Any) -> Any:
    """``x`` with every :class:`PaddedNumber` (also in lists, tuples, ``torch.Size``) replaced
    by its padded value: what the ops see."""
    if isinstance(x, PaddedNumber):
        return x.plain()
    if isinstance(x, torch.Size):
        return torch.Size([plain(v) for v in x])
    if isinstance(x, (list, tuple)) and any(isinstance(v, PaddedNumber) for v in x):
        return type(x)(plain(v) for v in x)
    return x
