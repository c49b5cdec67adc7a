"""Streaming over data (private): ``(inputs, targets)`` pairs, per-sample targets, progress bars
and the captured raw output of a per-sample call."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor

from .adapter import PerSampleFunction

__all__ = ["Capture", "pair", "raw_output", "split_targets", "with_progress"]


def with_progress(data: Iterable, enabled: bool, desc: str, total: int | None = None) -> Iterable:
    """``data`` wrapped in a tqdm bar when ``enabled``, tqdm is installed and stderr is a
    terminal (never in logs); else ``data`` itself."""
    if not enabled or not sys.stderr.isatty():
        return data
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return data
    return tqdm(data, desc=desc, leave=False, total=total)


def pair(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of one batch of a data iterable."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(
            f"data must yield (inputs, targets) pairs; got a {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        )
    return batch[0], batch[1]


def split_targets(targets: Any, n: int) -> list[Tensor]:
    """Per-sample targets from a tensor with a leading batch dim or a list of tensors."""
    if isinstance(targets, Tensor):
        if targets.dim() == 0 or targets.shape[0] != n:
            raise ValueError(
                f"targets must have a leading batch dim of {n} (the number of samples); got "
                f"shape {tuple(targets.shape)}"
            )
        return list(targets.unbind(0))
    if isinstance(targets, (list, tuple)) and all(isinstance(t, Tensor) for t in targets):
        if len(targets) != n:
            raise ValueError(f"got {len(targets)} targets for {n} samples")
        return list(targets)
    raise TypeError(
        f"targets must be a tensor or a list of per-sample tensors; got {type(targets).__name__}"
    )


class Capture:
    """An ``output_fn`` that applies the user's and keeps the (unflattened) result."""

    def __init__(self, user: Callable[[Any], Any] | None, who: str) -> None:
        self.user = user
        self.who = who
        self.last: Tensor | None = None

    def __call__(self, out: Any) -> Any:
        out = self.user(out) if self.user is not None else out
        if not isinstance(out, Tensor):
            raise TypeError(
                f"{self.who} needs the model (after output_fn) to return one tensor; got "
                f"{type(out).__name__}"
            )
        self.last = out
        return out


def raw_output(
    fn: PerSampleFunction, values: tuple[Tensor, ...], levels: tuple[Tensor, ...]
) -> Tensor:
    """The sample's output after ``output_fn``, batch dim of one kept (not flattened);
    ``fn.output_fn`` must be a :class:`Capture`."""
    fn.call(fn.full_params(values), levels)
    return fn.output_fn.last  # type: ignore[union-attr]
