"""Measuring, in one place, for ``tune=True`` (``"measure"``) only: the library's only clock
(:func:`stopwatch`), the one set of rules for timing candidates against each other
(:data:`RETIME`, :data:`TIE`, the warm-up), the one loop that times them
(:func:`time_candidates`) and the tie rule that picks (:func:`pick`), the process-wide
decision caches (:class:`DecisionCache`: :data:`PLAN_CACHE`, :data:`KERNEL_CACHE`) and their
file form (:func:`save`, :func:`load`, :data:`ENV_VAR`).

By default (``tune="auto"``) nothing is timed: routes follow the cost model, priced on this
machine (:mod:`~multiscale_jac._calibration`), or a decision ``tune=True`` measured before for
the same shapes. The engine, the diagonal Fisher, the Jacobian-norm regulariser and the
layer-wise kernels supply candidates and a run callback only; when a candidate is timed, how
often and which one wins is decided here. ``docs/design.md`` ("How the library chooses")
describes it for users.

The rules (one meaning everywhere):

- **Warm-up**: a candidate's first call at a shape pays one-off costs (kernels picked, buffers
  made: up to 2.7x its later time), so each candidate runs once untimed first.
- **Retime**: candidates timed within :data:`RETIME` of the fastest are timed once more, the
  faster of their two times counting (one timed call mis-ordered routes 8% apart).
- **Tie**: candidates within :data:`TIE` of the fastest cannot be told apart by the timing; the
  caller's preferred one among them wins (the estimate's choice, the larger chunk, the
  layer-wise kernels' columns).
- **Growth**: nothing timed holds more than :data:`GROWTH` times the working set of the
  estimate's choice.
- **Release**: after each timed run, freed CPU memory goes back to the system (glibc's
  ``malloc_trim``, where the C library has it), so that the peak of a call that timed two
  routes is the larger of theirs rather than their sum.

Decisions outlive the process through :func:`save` / :func:`load` (or the file named by the
environment variable :data:`ENV_VAR`, loaded on first use and written at exit), keyed by
everything a decision depends on made portable (:func:`portable_key`: module types by name,
parameter and input shapes, dtypes, devices, the output function by its code) and by the
library and the machine (:func:`environment`: library and torch versions, threads, device
names); an entry whose key does not match is never used.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import enum
import functools
import gc
import hashlib
import os
import pickle
import platform
import time
import types
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = [
    "COUNTS",
    "ENV_VAR",
    "GROWTH",
    "KERNEL_CACHE",
    "PLAN_CACHE",
    "RETIME",
    "TIE",
    "DecisionCache",
    "clear",
    "environment",
    "grows",
    "load",
    "pick",
    "portable_key",
    "register_types",
    "release",
    "save",
    "seconds",
    "stopwatch",
    "time_candidates",
]

K = TypeVar("K", bound=Hashable)

#: candidates timed within this factor of the fastest are timed once more, the faster time
#: counting: a route's first vectorised call at a new size paid up to 2.7x its later time
#: (once 4x: ``jacobian_sq_norm``'s ``hvp`` on an 8-conv CNN, slowest by far either way)
RETIME = 3.0
#: candidates within this factor of the fastest are a tie: the caller's preferred one wins
TIE = 1.05
#: a timed candidate holds at most this many times the working set of the estimate's choice:
#: the Jacobian-norm ``vmap`` chunk and the Fisher's layer-wise chunk are tried up to this many
#: times their planned size (64 samples a chunk against 16 took 0.51x the time on a small
#: transformer, 0.58x on a GroupNorm/depthwise CNN, 0.83x on an 8-conv CNN), not up to the batch
GROWTH = 4

#: how often planning measured a forward pass, surveyed structured costs and timed a candidate
#: (read by :func:`~multiscale_jac.plan_cache_info`)
COUNTS: collections.Counter[str] = collections.Counter()

#: the environment variable naming a decision file: loaded on first use, written at exit
ENV_VAR = "MULTISCALE_JAC_TUNING_CACHE"


# ---------------------------------------------------------------------- the clock
@contextlib.contextmanager
def stopwatch(devices: Iterable[torch.device] = ()) -> Iterator[list[float]]:
    """Time the block with the objects that exist before it frozen for the garbage collector
    (``gc.freeze``, undone after): a full collection inside a timed call then walks only the
    block's own objects (a collection over the whole process once made a 20 ms call take
    170 ms and chose the slower route), while the block's own garbage is still collected (a
    paused collector let it pile up: 12 MB over a memory budget). CUDA devices among
    ``devices`` are synchronised at the end. A caller's own frozen objects (``gc.freeze``
    called before) are left as they are: nothing is frozen or unfrozen then. Yields a list
    that holds the seconds after. Nested in another, it freezes nothing (and does not ask:
    ``gc.get_freeze_count`` walks every frozen object, 12 ms a call in the test process)."""
    elapsed: list[float] = []
    freeze = _NESTED[0] == 0 and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    _NESTED[0] += 1
    try:
        start = time.perf_counter()
        yield elapsed
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        elapsed.append(time.perf_counter() - start)
    finally:
        _NESTED[0] -= 1
        if freeze:
            gc.unfreeze()


#: how many stopwatches are running (:func:`stopwatch`)
_NESTED = [0]


def seconds(fn: Callable[[], Any], devices: Iterable[torch.device] = ()) -> tuple[float, Any]:
    """``fn()``'s wall time (:func:`stopwatch`) and its result."""
    with stopwatch(devices) as elapsed:
        out = fn()
    return elapsed[0], out


# ---------------------------------------------------------------------- the loop
def time_candidates(
    candidates: Sequence[K],
    run: Callable[[K], float | None],
    *,
    devices: Iterable[torch.device] = (),
    warm_up: Callable[[K], float | None] | None = None,
    skip: Callable[[K, float, dict[K, float]], bool] | None = None,
    retime: float = RETIME,
) -> dict[K, float]:
    """Time ``candidates`` by the rules of this module: for each, its warm-up (``warm_up(k)``,
    timed; default: one untimed ``run(k)``), unless ``skip(k, warm-up seconds per unit, times
    so far)`` says to leave it out, then one timed ``run(k)``; then those within ``retime`` of
    the fastest once more, the faster time counting.

    Args:
        candidates: The candidates, the caller's choice first.
        run: Runs a candidate once and returns the units of work it did (samples), or
            ``None`` where it failed (not a candidate then).
        devices: Devices to synchronise before reading the clock.
        warm_up: A candidate's warm-up, returning units as ``run``; default ``run``.
        skip: Whether to leave a candidate out after its warm-up.
        retime: Candidates within this factor of the fastest are timed once more.

    Returns:
        Seconds per unit of each candidate timed (failed or skipped ones are absent).
    """
    devices = list(devices)
    times: dict[K, float] = {}
    for k in candidates:
        warm = _time_one(k, warm_up or run, devices)
        release()
        if warm is None or (skip is not None and skip(k, warm, times)):
            continue
        COUNTS["probe"] += 1
        t = _time_one(k, run, devices)
        release()
        if t is not None:
            times[k] = t
    best = min(times.values(), default=0.0)
    for k in [k for k, t in times.items() if t <= retime * best]:
        COUNTS["probe"] += 1
        t = _time_one(k, run, devices)
        release()
        if t is not None:
            times[k] = min(times[k], t)
    return times


@functools.cache
def _trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release() -> None:
    """Give freed CPU heap memory back to the system (the rule **release**)."""
    trim = _trim()
    if trim is not None:
        trim(0)


def _time_one(k: K, fn: Callable[[K], float | None], devices: list[torch.device]) -> float | None:
    """Seconds per unit of one ``fn(k)`` (``None``: it failed); the tests force timings here."""
    with stopwatch(devices) as elapsed:
        units = fn(k)
    return None if units is None else elapsed[0] / max(units, 1e-12)


def grows(workset: int, chosen: int) -> bool:
    """Whether a candidate holding ``workset`` bytes holds more than :data:`GROWTH` times
    ``chosen``, the estimate's choice's (then it is not timed; ``0``: not planned, no rule)."""
    return chosen > 0 and workset > GROWTH * chosen


def pick(
    times: dict[K, float],
    *,
    cost: Callable[[K, float], float] | None = None,
    prefer: Callable[[K], Any] | None = None,
) -> K:
    """The fastest candidate by ``cost(k, seconds per unit)`` (default: the seconds); among
    those within :data:`TIE` of it, the one ``prefer`` ranks highest (default: the fastest)."""
    costs = {k: (cost(k, t) if cost is not None else t) for k, t in times.items()}
    best = min(costs.values())
    tied = [k for k, c in costs.items() if c <= TIE * best]
    if prefer is None:
        return min(tied, key=costs.__getitem__)
    return max(tied, key=lambda k: (prefer(k), -costs[k]))


# ---------------------------------------------------------------------- the caches
class DecisionCache:
    """Decisions, process-wide, like torch's cuDNN autotuning cache: keyed by an owner (a
    model or a layer, held weakly: an entry never keeps it alive and goes with it) and by
    everything the decision depends on, the least recently used dropped beyond ``maxsize``.
    Decisions whose key means the same outside the process (:func:`portable_key`) are also
    kept by that key (at most ``8 * maxsize``, with those read from a file, :func:`load`):
    a model of the same structure met later, in this process or after :func:`load` in
    another, finds them. Cleared by :func:`~multiscale_jac.clear_plan_cache`."""

    def __init__(self, name: str, maxsize: int = 128, *, portable: bool = True) -> None:
        self.name, self.maxsize, self.portable = name, maxsize, portable
        self.hits = self.misses = 0
        self._entries: collections.OrderedDict[Any, tuple[weakref.ref, Any]] = (
            collections.OrderedDict()
        )
        #: decisions by portable key: made here or read from a file
        self.known: collections.OrderedDict[str, Any] = collections.OrderedDict()
        _CACHES[name] = self

    def get(self, owner: Any, key: Any) -> Any | None:
        if key is None:
            return None
        _load_env()
        entry = self._entries.get((id(owner), key))
        if entry is not None and entry[0]() is owner:
            self._entries.move_to_end((id(owner), key))
            self.hits += 1
            return entry[1]
        portable = _portable_or_none(owner, key) if self.known else None
        value = None if portable is None else self.known.get(portable)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self.put(owner, key, value)
        return value

    def put(self, owner: Any, key: Any, value: Any) -> None:
        if key is None:
            return
        ident = id(owner)
        ref = weakref.ref(owner, lambda _: self._drop(ident))
        self._entries[(ident, key)] = (ref, value)
        self._entries.move_to_end((ident, key))
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        portable = _portable_or_none(owner, key) if self.portable else None
        if portable is not None:
            self.learn({portable: value})

    def learn(self, decisions: dict[str, Any]) -> None:
        """Keep ``decisions`` by portable key (the oldest dropped beyond ``8 * maxsize``)."""
        for portable, value in decisions.items():
            self.known[portable] = value
            self.known.move_to_end(portable)
        while len(self.known) > 8 * self.maxsize:
            self.known.popitem(last=False)

    def _drop(self, ident: int) -> None:
        for k in [k for k in self._entries if k[0] == ident]:
            del self._entries[k]

    def clear(self) -> None:
        self._entries.clear()
        self.known.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)


_CACHES: dict[str, DecisionCache] = {}
#: the engine's, the Fisher's and the Jacobian-norm regulariser's decisions per model
PLAN_CACHE = DecisionCache("plans")
#: measured kernel choices per layer and size class (the layer-wise rules' convolutions),
#: apart so that a deep model's layers never push whole plans out
KERNEL_CACHE = DecisionCache("kernels", maxsize=1024)


def clear() -> None:
    """Forget every decision (live and loaded) and reset :data:`COUNTS`."""
    for cache in _CACHES.values():
        cache.clear()
    COUNTS.clear()


# ---------------------------------------------------------------------- portable keys
class _Unportable(Exception):
    """A key part with no meaning outside this process."""


def environment() -> tuple[Any, ...]:
    """What a timed decision also depends on: the library and torch versions, CPU threads,
    the machine and the CUDA devices' names."""
    from . import __version__

    cuda = ()
    if torch.cuda.is_available():
        cuda = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return (__version__, torch.__version__, torch.get_num_threads(), platform.machine(), cuda)


def _code(fn: types.FunctionType) -> str:
    """A function by its code: its name, byte code and constants (not its address)."""
    return f"{fn.__module__}.{fn.__qualname__}:{_code_digest(fn.__code__)}"


def _code_digest(code: types.CodeType) -> str:
    """Byte code and constants, nested code objects (comprehensions, lambdas, inner functions)
    by their own digest: their ``repr`` holds their address, which differs per process."""
    consts = tuple(
        _code_digest(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts
    )
    return hashlib.sha256(code.co_code + repr(consts).encode()).hexdigest()[:16]


def _plain(x: Any) -> Any:
    """``x`` with every process-bound part (types, functions, weak references) replaced by a
    name that means the same in another process; :class:`_Unportable` where none does (a
    function closing over a tensor or a module, a bound method: their state is theirs)."""
    if isinstance(x, (str, int, float, bool, type(None), bytes)):
        return x
    if isinstance(x, enum.Enum):
        return f"{type(x).__qualname__}.{x.value}"
    if isinstance(x, (torch.dtype, torch.device)):
        return str(x)
    if isinstance(x, torch.Size):
        return tuple(x)
    if isinstance(x, type):  # with its forward's code, where it has one (a module's)
        forward = getattr(x, "forward", None)
        code = _code(forward) if isinstance(forward, types.FunctionType) else ""
        return f"{x.__module__}.{x.__qualname__}", code
    if isinstance(x, weakref.ref):
        return _plain(x())
    if isinstance(x, types.FunctionType):  # its code and what it closes over
        cells = tuple(_plain(c.cell_contents) for c in x.__closure__ or ())
        return (_code(x), cells, _plain(x.__defaults__), _plain(x.__kwdefaults__))
    if isinstance(x, (tuple, list)):
        return tuple(_plain(v) for v in x)
    if isinstance(x, (set, frozenset)):
        return tuple(sorted(repr(_plain(v)) for v in x))
    if isinstance(x, dict):
        return tuple(sorted((repr(_plain(k)), _plain(v)) for k, v in x.items()))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = dataclasses.fields(x)
        return (type(x).__qualname__, *(_plain(getattr(x, f.name)) for f in fields))
    raise _Unportable(type(x).__qualname__)


def portable_key(owner: Any, key: Any) -> str:
    """``key`` (with the owner's type) as a string that means the same in another process on
    the same machine and torch (:func:`environment`); raises where a part cannot."""
    plain = (_plain(type(owner)), _plain(key), environment())
    return hashlib.sha256(repr(plain).encode()).hexdigest()


def _portable_or_none(owner: Any, key: Any) -> str | None:
    try:
        return portable_key(owner, key)
    except _Unportable:
        return None


# ---------------------------------------------------------------------- files
_FORMAT = "multiscale_jac.tuning/1"
_SAFE_TYPES: list[type] = []


def register_types(*kinds: type) -> None:
    """Types that may appear in a decision read from a file (``torch.load(weights_only=True)``
    accepts these and plain data only)."""
    _SAFE_TYPES.extend(k for k in kinds if k not in _SAFE_TYPES)


def save(path: str | os.PathLike[str]) -> int:
    """Write every decision that can outlive the process (live and loaded ones) to ``path``.

    Returns:
        The number of decisions written.
    """
    data = {name: dict(c.known) for name, c in _CACHES.items() if c.portable}
    tmp = Path(path).with_suffix(Path(path).suffix + ".tmp")
    torch.save({"format": _FORMAT, "decisions": data}, tmp)
    os.replace(tmp, path)
    return sum(len(d) for d in data.values())


def load(path: str | os.PathLike[str]) -> int:
    """Read decisions saved by :func:`save`; later calls with the same model structure, inputs,
    options and machine (:func:`portable_key`) then measure nothing. Entries whose key does
    not match are never used.

    Returns:
        The number of decisions read.

    Raises:
        ValueError: ``path`` is not a decision file.
    """
    with torch.serialization.safe_globals(list(_SAFE_TYPES)):
        try:
            data = torch.load(path, weights_only=True)
        except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:
            if isinstance(err, FileNotFoundError):
                raise
            raise ValueError(f"{os.fspath(path)!r} is not a decision file: {err}") from err
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(f"{os.fspath(path)!r} is not a decision file of {_FORMAT!r}")
    count = 0
    for name, decisions in data["decisions"].items():
        if name in _CACHES and isinstance(decisions, dict):
            _CACHES[name].learn(decisions)
            count += len(decisions)
    return count


_ENV_LOADED: list[str | None] = [None]


def _load_env() -> None:
    """The file named by :data:`ENV_VAR`: read on first use (when it exists) and written at
    exit."""
    path = os.environ.get(ENV_VAR)
    if not path or _ENV_LOADED[0] == path:
        return
    _ENV_LOADED[0] = path
    if Path(path).exists():
        with contextlib.suppress(ValueError):  # a foreign file is ignored, then replaced
            load(path)
    atexit.register(_save_env, path)


def _save_env(path: str) -> None:
    with contextlib.suppress(OSError):
        save(path)
