"""The machine, measured once (private): what an op costs here (a
:class:`~multiscale_jac._work.Machine`), measured by :func:`calibrate` on short chains of each
kind of op (about a second) per device, dtype and thread count and kept by :func:`machine` like
a compiled-kernel cache, in the process and in a file (:func:`cache_path`), keyed with the
library and torch versions."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import jacrev, jvp, vmap

from ._tuning import environment, stopwatch
from ._work import KINDS, Machine, count_work

__all__ = ["CACHE_ENV", "PASSES", "Machine", "cache_path", "calibrate", "machine", "use_machine"]

#: the passes priced apart: a plain (vectorised) forward, forward mode, reverse mode
PASSES = ("fwd", "jvp", "vjp")
#: the environment variable naming the calibration file's folder (``off``: no file)
CACHE_ENV = "MULTISCALE_JAC_CACHE_DIR"


def _chain(kind: str, links: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``links`` ops of one kind in a row (the tangent flows through every link)."""
    link = {
        "dense": lambda w, x: F.conv2d(x, w, padding=1),
        "norm": lambda w, x: F.group_norm(x, 2),
        "view": lambda w, x: x.transpose(-1, -2),
        "other": lambda w, x: torch.relu(x) + x,
    }[kind]

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x * w[0, 0, 0, 0]
        for _ in range(links):
            x = link(w, x)
        return x.sum()

    return f


def _best(fn: Callable[[], Any], device: torch.device) -> float:
    """The least of five times of ``fn()`` after a first call (one-time costs)."""
    fn()
    times: list[float] = []
    for _ in range(5):
        with stopwatch([device]) as elapsed:
            fn()
        times += elapsed
    return min(times)


def measure_machine(device: torch.device, dtype: torch.dtype) -> Machine:
    """Measure :class:`Machine` here: each op kind's chain of 4 and of 24 links in each pass,
    vectorised over two samples of small tensors (the slope is an op's dispatch, the rest a
    call's set-up), a convolution of about 150 MFLOP (the flop rate) and an elementwise pass
    over 4M elements (the rate elements are written)."""
    g = torch.Generator().manual_seed(0)
    w = (0.2 * torch.randn(4, 4, 3, 3, generator=g)).to(device, dtype)
    x = torch.randn(2, 1, 4, 6, 6, generator=g).to(device, dtype)
    op_s, call_s = ({p: [] for p in PASSES} for _ in "ab")  # type: ignore[var-annotated]
    for kind in KINDS:
        times: dict[str, list[float]] = {p: [] for p in PASSES}
        counts = []
        for f in (_chain(kind, 4), _chain(kind, 24)):
            counts.append(count_work(lambda f=f: f(w, x[0]))[1].count)
            runs = {
                "fwd": lambda f=f: vmap(f, (None, 0))(w, x),
                "jvp": lambda f=f: vmap(lambda xi: jvp(lambda v: f(v, xi), (w,), (w,)))(x),
                "vjp": lambda f=f: vmap(lambda xi: jacrev(lambda v: f(v, xi))(w))(x),
            }
            with torch.no_grad():
                for p, run in runs.items():
                    times[p].append(_best(run, device))
        for p in PASSES:
            slope = max(times[p][1] - times[p][0], 0.0) / max(counts[1] - counts[0], 1)
            op_s[p].append(slope)
            call_s[p].append(max(times[p][0] - slope * counts[0], 0.0))
    big = torch.randn(8, 32, 32, 32, generator=g).to(device, dtype)
    kernel = torch.randn(32, 32, 3, 3, generator=g).to(device, dtype)
    wide = torch.randn(2**22, generator=g).to(device, dtype)
    with torch.no_grad():
        conv = _best(lambda: F.conv2d(big, kernel, padding=1), device)
        elem = _best(lambda: torch.relu(wide) + wide, device) / (2 * wide.numel())
    flop_s = conv / (2 * big.numel() * kernel[0].numel())
    calls = {p: sum(v) / len(v) for p, v in call_s.items()}
    return Machine({p: tuple(v) for p, v in op_s.items()}, flop_s, calls, elem)


_MACHINES: dict[str, Machine] = {}
#: the machine every price uses, where set (:func:`use_machine`): tests fix it
_FIXED: list[Machine | None] = [None]


def use_machine(m: Machine | None) -> Machine | None:
    """Price every route with ``m`` instead of this machine's calibration (``None``: this
    machine again); returns the previous setting (the test suite's fixed machine)."""
    before, _FIXED[0] = _FIXED[0], m
    return before


def _key(device: torch.device, dtype: torch.dtype) -> str:
    return repr((environment(), str(device), str(dtype)))


def cache_path() -> Path | None:
    """``$MULTISCALE_JAC_CACHE_DIR/machine.json`` (``off``: ``None``), else
    ``multiscale_jac/machine.json`` under ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    folder = os.environ.get(CACHE_ENV)
    if folder == "off":
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multiscale_jac"
    return Path(folder or base) / "machine.json"


def _stored() -> dict[str, Any]:  # the calibration file's machines by key
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):  # (no path: None)
        return dict(json.loads(cache_path().read_text()))  # type: ignore[union-attr]
    return {}


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Machine:
    """Measure this machine for ``device`` and ``dtype`` now and keep the result (in the
    process and in :func:`cache_path`), replacing what was kept: for a machine whose load or
    settings changed. Raises ``TypeError`` for a dtype that is not a floating-point
    ``torch.dtype``, ``ValueError`` for a device this machine does not have."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"calibrate: dtype must be a floating-point torch.dtype, got {dtype!r}")
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, TypeError, AssertionError) as err:  # (torch built without CUDA)
        raise ValueError(f"calibrate: no device {device!r} here ({err})") from err
    found = _MACHINES[_key(device, dtype)] = measure_machine(device, dtype)
    if (path := cache_path()) is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(
                json.dumps({**_stored(), _key(device, dtype): dataclasses.asdict(found)})
            )
            os.replace(tmp, path)
    return found


def machine(device: torch.device, dtype: torch.dtype) -> Machine:
    """The :class:`Machine` for ``device`` and ``dtype``: the fixed one (:func:`use_machine`),
    one measured before (here or in :func:`cache_path`), or :func:`calibrate`'s."""
    if _FIXED[0] is not None:
        return _FIXED[0]
    if (key := _key(torch.device(device), dtype)) not in _MACHINES:
        try:
            e = _stored()[key]
            op_s = {p: tuple(float(v) for v in e["op_s"][p]) for p in PASSES}
            calls = {p: float(e["call_s"][p]) for p in PASSES}
            _MACHINES[key] = Machine(op_s, float(e["flop_s"]), calls, float(e["elem_s"]))
        except (TypeError, KeyError, ValueError):
            return calibrate(device, dtype)
    return _MACHINES[key]
