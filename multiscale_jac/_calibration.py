"""The machine, measured once: what an op costs here, so that routes are priced from what the
model does (its ops and flops, counted on one sample by :func:`count_work`) rather than from
constants tuned on one model.

A pass of a vectorised call costs a fixed time per op it dispatches (Python, vmap's batching
rules, autograd's forward- or reverse-mode bookkeeping: by far the larger share on CPU for
small per-sample tensors), by op kind (:data:`KINDS`) and pass (:data:`PASSES`), plus its
floating-point work at the machine's rate. :func:`calibrate` measures both on short chains of
each kind of op (well under a second), per device, dtype and thread count, and
:func:`machine` keeps the result like a compiled-kernel cache: in the process and in a file
(:func:`cache_path`; ``MULTISCALE_JAC_CACHE_DIR`` names its folder, ``off`` disables it),
keyed with the library and torch versions. ``docs/design.md`` ("How the library chooses")
states the pricing for users.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import jacrev, jvp, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ._tuning import seconds

__all__ = [
    "CACHE_ENV",
    "KINDS",
    "NO_WORK",
    "PASSES",
    "Machine",
    "Work",
    "cache_path",
    "calibrate",
    "count_work",
    "machine",
    "measure_machine",
    "use_machine",
]

#: op kinds priced apart: convolutions and matrix products, normalisations, views, the rest
KINDS = ("dense", "norm", "view", "other")
#: the passes priced apart: a plain (vectorised) forward, forward mode, reverse mode
PASSES = ("fwd", "jvp", "vjp")
#: the environment variable naming the calibration file's folder (``off``: no file)
CACHE_ENV = "MULTISCALE_JAC_CACHE_DIR"

_VIEWS = {
    "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "expand", "unsqueeze",
    "squeeze", "select", "slice", "alias", "as_strided", "detach", "split", "split_with_sizes",
    "unbind", "narrow", "clone", "contiguous", "flatten", "unflatten", "lift_fresh",
}  # fmt: skip


def _kind(func: Any) -> str:
    name = func._schema.name.split("::")[-1]
    if any(k in name for k in ("conv", "mm", "linear", "matmul", "attention")):
        return "dense"
    if "norm" in name:
        return "norm"
    return "view" if name in _VIEWS else "other"


@dataclass(frozen=True)
class Work:
    """What one pass of one sample does: ops dispatched per kind (:data:`KINDS`), flops
    (convolutions and matrix products, :mod:`torch.utils.flop_counter`'s count) and elements
    written (the outputs of every op but views)."""

    ops: tuple[int, ...] = (0, 0, 0, 0)
    flops: int = 0
    elems: int = 0

    @property
    def count(self) -> int:
        return sum(self.ops)


#: no work counted (a footprint not measured)
NO_WORK = Work()


class _Counter(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo's ``disable`` otherwise, whose
        # first call imports torch._dynamo (1-2 s, tens of MiB): a first call's cost the
        # plain forward pass it counts never needs
        return False

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.flops = self.elems = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = _kind(func)
        self.ops[kind] += 1
        if kind != "view":
            self.elems += sum(t.numel() for t in _tensors(out))
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            with contextlib.suppress(Exception):  # a count it cannot make is not work we miss
                self.flops += int(count(*args, **kwargs, out_val=out))
        return out


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def count_work(run: Callable[[], Any]) -> tuple[Any, Work]:
    """``run()``'s result and the :class:`Work` it dispatched."""
    counter = _Counter()
    with counter:
        out = run()
    return out, Work(tuple(counter.ops[k] for k in KINDS), counter.flops, counter.elems)


@dataclass(frozen=True)
class Machine:
    """Seconds per op of each kind in each pass (``op_s[pass]``, per :data:`KINDS`) of a
    vectorised call, seconds per flop, the fixed seconds of one vectorised call in each pass
    (``call_s[pass]``: the transforms' set-up), and seconds per element an elementwise op
    writes (``elem_s``: memory traffic), on one device, dtype and thread count."""

    op_s: dict[str, tuple[float, ...]]
    flop_s: float
    call_s: dict[str, float]
    elem_s: float = 0.0

    def overhead(self, work: Work, kind: str) -> float:
        """Seconds of one vectorised call of a ``kind`` pass over ``work``'s ops: its set-up
        and its ops' dispatch, whatever the samples it vectorises over."""
        return self.call_s[kind] + sum(
            n * s for n, s in zip(work.ops, self.op_s[kind], strict=True)
        )

    def work_seconds(self, flops: float, elems: float) -> float:
        """Seconds of ``flops`` and of writing ``elems`` elements."""
        return flops * self.flop_s + elems * self.elem_s

    def pass_seconds(self, work: Work, times: float = 1.0) -> float:
        """Seconds of ``times`` times ``work``'s flops and elements."""
        return times * self.work_seconds(work.flops, work.elems)


#: an op kind's chain: what one link does to ``x`` (the tangent flows through every link)
def _link(kind: str, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if kind == "dense":
        return F.conv2d(x, w, padding=1)
    if kind == "norm":
        return F.group_norm(x, 2)
    if kind == "view":
        return x.transpose(-1, -2)
    return torch.relu(x) + x


#: the two chain lengths calibrated: the slope between them is an op's time, the rest a call's
_LINKS = (4, 24)


def _chain(kind: str, links: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x * w[0, 0, 0, 0]
        for _ in range(links):
            x = _link(kind, w, x)
        return x.sum()

    return f


def _best(fn: Callable[[], Any], devices: list[torch.device], rounds: int = 5) -> float:
    fn()  # a first call pays one-time costs
    return min(seconds(fn, devices)[0] for _ in range(rounds))


def measure_machine(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Machine:
    """Measure :class:`Machine` here: each op kind's chain at two lengths in each pass,
    vectorised over two samples of small tensors (the slope is the ops' dispatch, the rest a
    call's set-up), one convolution of about 150 MFLOP (the flop rate) and an elementwise
    pass over 4M elements (the rate elements are written)."""
    device = torch.device(device)
    devices = [device]
    g = torch.Generator().manual_seed(0)
    w = (0.2 * torch.randn(4, 4, 3, 3, generator=g)).to(device, dtype)
    x = torch.randn(2, 1, 4, 6, 6, generator=g).to(device, dtype)
    op_s: dict[str, list[float]] = {p: [] for p in PASSES}
    call_s: dict[str, list[float]] = {p: [] for p in PASSES}
    for kind in KINDS:
        times: dict[str, list[float]] = {p: [] for p in PASSES}
        counts = []
        for links in _LINKS:
            f = _chain(kind, links)
            counts.append(count_work(lambda f=f: f(w, x[0]))[1].count)
            runs = {
                "fwd": lambda f=f: vmap(f, (None, 0))(w, x),
                "jvp": lambda f=f: vmap(lambda xi: jvp(lambda v: f(v, xi), (w,), (w,)))(x),
                "vjp": lambda f=f: vmap(lambda xi: jacrev(lambda v: f(v, xi))(w))(x),
            }
            with torch.no_grad():
                for p, run in runs.items():
                    times[p].append(_best(run, devices))
        for p in PASSES:
            slope = max(times[p][1] - times[p][0], 0.0) / max(counts[1] - counts[0], 1)
            op_s[p].append(slope)
            call_s[p].append(max(times[p][0] - slope * counts[0], 0.0))
    big = torch.randn(8, 32, 32, 32, generator=g).to(device, dtype)
    kernel = torch.randn(32, 32, 3, 3, generator=g).to(device, dtype)
    flops = 2 * big.numel() * kernel[0].numel()  # out channels = in channels
    wide = torch.randn(2**22, generator=g).to(device, dtype)
    with torch.no_grad():
        conv = _best(lambda: F.conv2d(big, kernel, padding=1), devices)
        elem = _best(lambda: torch.relu(wide) + wide, devices) / (2 * wide.numel())
    calls = {p: sum(v) / len(v) for p, v in call_s.items()}
    return Machine({p: tuple(v) for p, v in op_s.items()}, conv / flops, calls, elem)


_MACHINES: dict[tuple[Any, ...], Machine] = {}
#: the machine every price uses, where set (:func:`use_machine`): tests fix it
_FIXED: list[Machine | None] = [None]


def use_machine(m: Machine | None) -> Machine | None:
    """Price every route with ``m`` instead of this machine's calibration (``None``: this
    machine again); returns the previous setting. Routes then follow from the model alone, as
    on the machine ``m`` describes (the test suite's fixed machine)."""
    before, _FIXED[0] = _FIXED[0], m
    return before


def _key(device: torch.device, dtype: torch.dtype) -> tuple[Any, ...]:
    from . import __version__

    name = platform.processor() or platform.machine()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    return (__version__, torch.__version__, device.type, name, str(dtype), torch.get_num_threads())


def cache_path() -> Path | None:
    """The calibration file: ``$MULTISCALE_JAC_CACHE_DIR/machine.json``, else under
    ``$XDG_CACHE_HOME`` or ``~/.cache`` (``multiscale_jac/machine.json``); ``None`` where
    ``MULTISCALE_JAC_CACHE_DIR`` is ``off``."""
    folder = os.environ.get(CACHE_ENV)
    if folder == "off":
        return None
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        folder = str(Path(base) / "multiscale_jac")
    return Path(folder) / "machine.json"


def _stored() -> dict[str, Any]:
    path = cache_path()
    with contextlib.suppress(OSError, ValueError):
        stored = json.loads(path.read_text()) if path is not None else {}
        return stored if isinstance(stored, dict) else {}
    return {}


def _keep(key: tuple[Any, ...], found: Machine) -> None:
    """``found`` for ``key``: in the process, and in :func:`cache_path` where there is one
    (a file that cannot be written is left alone: the process keeps it)."""
    _MACHINES[key] = found
    path = cache_path()
    if path is None:
        return
    stored = _stored()
    stored[repr(key)] = dataclasses.asdict(found)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        os.replace(tmp, path)


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Machine:
    """Measure this machine for ``device`` and ``dtype`` now (:func:`measure_machine`) and
    keep the result for later calls (in the process and in :func:`cache_path`), replacing
    what was kept: for a machine whose load or settings changed."""
    found = measure_machine(device, dtype)
    _keep(_key(torch.device(device), dtype), found)
    return found


def machine(device: torch.device, dtype: torch.dtype) -> Machine:
    """This machine's :class:`Machine` for ``device`` and ``dtype``: the fixed one
    (:func:`use_machine`), one measured before (in this process or read from
    :func:`cache_path`), or :func:`calibrate`'s."""
    if _FIXED[0] is not None:
        return _FIXED[0]
    device = torch.device(device)
    key = _key(device, dtype)
    if key in _MACHINES:
        return _MACHINES[key]
    entry = _stored().get(repr(key))
    try:
        op_s = {p: tuple(float(v) for v in entry["op_s"][p]) for p in PASSES}  # type: ignore[index]
        calls = {p: float(entry["call_s"][p]) for p in PASSES}  # type: ignore[index]
        elem = float(entry["elem_s"])  # type: ignore[index]
        _MACHINES[key] = Machine(op_s, float(entry["flop_s"]), calls, elem)  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return calibrate(device, dtype)
    return _MACHINES[key]
