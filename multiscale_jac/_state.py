"""The user's model as found (private, adapter layer).

A module's forward may write state outside its parameters and buffers: caches of anchors, grids
or positional tables keyed by the input shape (ultralytics' ``Detect`` keeps ``anchors``,
``strides`` and ``shape``), counters, the recomputed weight of the old ``weight_norm`` hook.
Under a vectorised per-sample call such a write holds a tensor of the transform (functorch's
wrapper, dead once the call returns) or the state of a batch of one, and the user's next call
reads it. :class:`ModuleState` records every submodule's instance attributes and buffers when
the per-sample function is made; every run of the model gets fresh copies of the tensor
attributes and buffers (made inside the transform, so that a forward that counts in place may
write them) and the recorded attributes are put back after it, on every path (vmap, bucketed,
padded, loop, fallback, error).

A write that was undone is reported by :class:`~multiscale_jac.ModuleStateWarning`, once per
module and attributes (Python's warning filter shows a repeated message once): the model's next
call rebuilds its caches as it would after any change of input shape.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from .enums import ModuleStateWarning

__all__ = ["ModuleState"]

_MISSING = object()


class _Saved:
    """One module's instance ``__dict__`` and buffers as recorded, and the fresh copies of its
    tensor attributes and buffers that one run gets."""

    __slots__ = ("attrs", "buffers", "fresh", "module", "path", "tensors")

    def __init__(self, path: str, module: nn.Module) -> None:
        self.path, self.module = path, module
        self.attrs = dict(module.__dict__)
        self.buffers = dict(module._buffers)
        self.tensors = [
            k
            for k, v in self.attrs.items()
            if isinstance(v, Tensor) and not isinstance(v, nn.Parameter)
        ]
        self.fresh: dict[tuple[bool, str], tuple[Tensor, int]] = {}

    def enter(self) -> None:
        """Give the run fresh copies of the tensor attributes and buffers: made inside the
        transform, a copy may be written in place (a counter), which the original, captured
        from outside, may not; and the original stays as it was."""
        for is_buffer, names, where in (
            (False, self.tensors, self.module.__dict__),
            (True, self.buffers, self.module._buffers),
        ):
            for k in names:
                t = where[k]
                if t is not None:
                    copy = t.clone()
                    where[k] = copy
                    self.fresh[is_buffer, k] = (copy, copy._version)

    def restore(self) -> list[str]:
        """Put the recorded attributes and buffers back; returns the names the run wrote
        (rebound, added, deleted or written in place)."""
        written: list[str] = []
        for is_buffer, now, saved in (
            (False, self.module.__dict__, self.attrs),
            (True, self.module._buffers, self.buffers),
        ):
            for k in now.keys() - saved.keys():
                written.append(k)
                del now[k]
            for k, v in saved.items():
                copy, version = self.fresh.get((is_buffer, k), (v, None))
                value = now.get(k, _MISSING)
                if value is not copy or (version is not None and copy._version != version):
                    written.append(k)
                now[k] = v
        self.fresh.clear()
        return written


class ModuleState:
    """Every submodule's instance attributes and buffers, as they were when this object was
    made; :meth:`run` runs a callable with the model put back afterwards.

    Args:
        model: The user's model (each submodule recorded once, under its first name).
    """

    def __init__(self, model: nn.Module) -> None:
        self._saved = [_Saved(path, m) for path, m in model.named_modules()]
        self._warned: set[tuple[str, tuple[str, ...]]] = set()

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` with fresh copies of the tensor attributes and buffers, and every write to
        the modules' attributes undone afterwards (also when it raises), with a
        :class:`~multiscale_jac.ModuleStateWarning` naming what was written."""
        for s in self._saved:
            s.enter()
        try:
            return fn()
        finally:
            for s in self._saved:
                written = tuple(dict.fromkeys(s.restore()))
                if written and (s.path, written) not in self._warned:
                    self._warned.add((s.path, written))
                    _warn(s, written)


def _warn(s: _Saved, written: tuple[str, ...]) -> None:
    names = ", ".join(repr(k) for k in written)
    where = f"{type(s.module).__name__} at {s.path!r}" if s.path else type(s.module).__name__
    warnings.warn(
        f"{where} wrote {names} during its forward; the per-sample runs keep the model as "
        "found, so the attributes were put back after each run (a cache is rebuilt on the "
        "model's next call; state that counts calls does not count the per-sample runs)",
        ModuleStateWarning,
        stacklevel=_user_level(),
    )


def _user_level() -> int:
    """The stack level (for :func:`warnings.warn` called by :func:`_warn`) of the first frame
    outside this package, torch and ``contextlib``: the user's call."""
    frame: Any = sys._getframe(2)  # _warn's caller: stack level 2 of the warning
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


_INTERNAL = ("multiscale_jac", "torch", "contextlib")
