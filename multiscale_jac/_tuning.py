"""``tune=True`` in one place: the library's only clock (:func:`stopwatch`), the one path that
times candidate routes (:func:`tune`) and the choices it made (:func:`decided`, :func:`save`,
:func:`load`); ``docs/design.md`` ("How the library chooses") states the rules. A choice is
plain data, ``[route name, chunk]``, keyed by a digest of the family, the caller's key (model
structure, shapes, options) and :func:`environment`; it only picks among exact routes, so a
key that matches where it should not costs speed, never a number.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import json
import os
import platform
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._plan_cache import COUNTS

__all__ = ["Route", "clear", "decided", "load", "save", "stopwatch", "tune"]

#: warm-up, then a timed run each; those within RETIME of the fastest once more (the faster
#: time counting); within TIE of the fastest the earliest wins; no route holding over GROWTH
#: times the first one's working set is timed
RETIME, TIE, GROWTH = 3.0, 1.05, 4
MAX_DECISIONS = 1024  # the oldest choices dropped beyond it


@contextlib.contextmanager
def stopwatch(devices: Iterable[torch.device] = ()) -> Iterator[list[float]]:
    """Time the block into the yielded list, CUDA ``devices`` synchronised, the objects from
    before frozen for the garbage collector (a collection over the whole process made a 20 ms
    call take 170 ms; a caller's own freeze is left alone)."""
    elapsed: list[float] = []
    if freeze := gc.get_freeze_count() == 0:
        gc.freeze()
    try:
        start = time.perf_counter()
        yield elapsed
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        elapsed.append(time.perf_counter() - start)
    finally:
        if freeze:
            gc.unfreeze()


@dataclass
class Route:
    """A candidate of :func:`tune`: ``name`` (unique), ``run`` (on the call's samples: how
    many, ``None`` where it failed), ``chunk`` (kept with the choice), ``workset`` bytes and
    ``warm_up`` (default: ``run``; a route already warm passes one that does nothing)."""

    name: str
    run: Callable[[], float | None]
    chunk: int | None = None
    workset: int = 0
    warm_up: Callable[[], Any] | None = None


def tune(
    family: str,
    key: Any,
    candidates: Sequence[Route],
    devices: Iterable[torch.device],
    notes: list[str],
    samples: int = 0,
) -> Route | None:
    """The fastest of ``candidates`` by the rules above (``None``: all failed), kept under
    ``family`` and ``key`` (a ``None`` key keeps nothing), its times in ``notes``; with
    ``samples``, a chunked route is priced over that many in whole chunks."""
    if len(candidates) < 2:  # nothing to choose between
        return next(iter(candidates), None)
    devices, limit = list(devices), GROWTH * candidates[0].workset
    heavy = [r.name for r in candidates if limit and r.workset > limit]
    trial = [r for r in candidates if r.name not in heavy]
    if heavy:
        notes.append(f"tune: not timed, over {GROWTH}x the first route's working set: {heavy}")
    times: dict[int, float] = {}
    for i, r in enumerate(trial):
        if (r.warm_up or r.run)() is not None and (t := _time(r, devices)) is not None:
            times[i] = t
    fastest = min(times.values(), default=0.0)
    for i in [i for i, t in times.items() if t <= RETIME * fastest]:
        if (t := _time(trial[i], devices)) is not None:
            times[i] = min(times[i], t)
    if not times:
        return None
    costs = {
        i: t * (-(-samples // c) * c if samples and (c := trial[i].chunk) else 1)
        for i, t in times.items()
    }
    chosen = trial[min(i for i, c in costs.items() if c <= TIE * min(costs.values()))]
    if key is not None:
        _remember(_digest(family, key), [chosen.name, chosen.chunk])
    timed = ", ".join(f"{trial[i].name} {t * 1e3:.3g} ms" for i, t in times.items())
    notes.append(f"tune: timed on the data: {timed} per sample; chose {chosen.name}")
    return chosen


def _time(route: Route, devices: list[torch.device]) -> float | None:
    """Seconds per sample of one ``route.run()`` (``None``: it failed)."""
    COUNTS["probe"] += 1
    with stopwatch(devices) as elapsed:
        units = route.run()
    return None if units is None else elapsed[0] / max(units, 1e-12)


def decided(family: str, key: Any) -> tuple[str, int | None] | None:
    """The route name and chunk :func:`tune` chose for ``family`` and ``key``, or ``None``."""
    # (none chosen, the default path: nothing digested)
    found = _DECISIONS.get(_digest(family, key)) if key is not None and _DECISIONS else None
    return None if found is None else tuple(found)  # type: ignore[return-value]


_DECISIONS: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()


def _remember(digest: str, choice: list[Any]) -> None:
    _DECISIONS[digest] = choice
    _DECISIONS.move_to_end(digest)
    while len(_DECISIONS) > MAX_DECISIONS:
        _DECISIONS.popitem(last=False)


def clear() -> None:
    """Forget every choice (made here or read from a file)."""
    _DECISIONS.clear()


def environment() -> tuple[Any, ...]:
    """The library and torch versions, CPU threads, the processor and the CUDA devices."""
    from . import __version__

    cuda = ()
    if torch.cuda.is_available():
        cuda = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    cpu = platform.processor() or platform.machine()
    return (__version__, torch.__version__, torch.get_num_threads(), cpu, cuda)


def _digest(family: str, key: Any) -> str:
    """The key as text that means the same in another process (object addresses dropped:
    types and functions stand by their names), hashed with :func:`environment`."""
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr((family, key, environment())))
    return hashlib.sha256(text.encode()).hexdigest()


_FORMAT = "multiscale_jac.tuning/2"


def save(path: str | os.PathLike[str]) -> int:
    """Write every choice kept (made here or read) to ``path``; returns how many."""
    Path(path).write_text(json.dumps({"format": _FORMAT, "decisions": dict(_DECISIONS)}))
    return len(_DECISIONS)


def load(path: str | os.PathLike[str]) -> int:
    """Read choices written by :func:`save` (calls they match then time nothing); returns
    how many. Raises ``ValueError`` where ``path`` is not a decision file."""
    try:
        data = json.loads(Path(path).read_text())
        if data["format"] != _FORMAT:
            raise ValueError(f"not of the format {_FORMAT!r}")
        checked = {
            str(k): [str(n), c if c is None else int(c)] for k, (n, c) in data["decisions"].items()
        }
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as err:
        raise ValueError(f"{os.fspath(path)!r} is not a decision file: {err}") from err
    for digest, choice in checked.items():
        _remember(digest, choice)
    return len(checked)
