"""Plans kept for the next call with the same shapes (private, planning layer): what a
call planned (strategy, mode, structured tensors, chunks, measured sizes), so that a second
call pays no planning pass or survey. Process-wide, like torch's cuDNN autotuning cache:
keyed by an owner (a model, held weakly: an entry never keeps it alive and goes with it) and
by everything the plan depends on, the least recently used dropped beyond ``maxsize``;
emptied by :func:`~multiscale_jac.clear_plan_cache` (:func:`clear`). Nothing is kept on the
model and nothing outlives the process (what ``tune=True`` measured does:
:mod:`~multiscale_jac._tuning`)."""

from __future__ import annotations

import collections
import weakref
from typing import Any

__all__ = ["COUNTS", "PLAN_CACHE", "PlanCache", "clear"]

#: how often planning measured a forward pass (``measure``), surveyed structured costs
#: (``survey``) and ``tune=True`` timed a route (``probe``): :func:`~multiscale_jac.plan_cache_info`
COUNTS: collections.Counter[str] = collections.Counter()


class PlanCache:
    """Plans per owner (held weakly) and key, at most ``maxsize``, least recently used first
    out; ``hits`` and ``misses`` count the lookups."""

    def __init__(self, maxsize: int = 128) -> None:
        self.maxsize = maxsize
        self.hits = self.misses = 0
        self._entries: collections.OrderedDict[Any, tuple[weakref.ref, Any]] = (
            collections.OrderedDict()
        )
        _CACHES.append(self)

    def get(self, owner: Any, key: Any) -> Any | None:
        """The plan kept for ``owner`` and ``key`` (``None``: none; a ``None`` key: never)."""
        entry = None if key is None else self._entries.get((id(owner), key))
        if entry is None or entry[0]() is not owner:
            self.misses += key is not None
            return None
        self._entries.move_to_end((id(owner), key))
        self.hits += 1
        return entry[1]

    def put(self, owner: Any, key: Any, value: Any) -> None:
        if key is None:
            return
        ident = id(owner)
        ref = weakref.ref(owner, lambda _: self._drop(ident))
        self._entries[(ident, key)] = (ref, value)
        self._entries.move_to_end((ident, key))
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def _drop(self, ident: int) -> None:
        for k in [k for k in self._entries if k[0] == ident]:
            del self._entries[k]

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)


_CACHES: list[PlanCache] = []
#: the engine's, the Fisher's and the Jacobian-norm regulariser's plans per model
PLAN_CACHE = PlanCache()


def clear() -> None:
    """Forget every kept plan and reset :data:`COUNTS`."""
    for cache in _CACHES:
        cache.clear()
    COUNTS.clear()
