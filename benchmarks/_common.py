"""Shared helpers of the benchmark scripts (``from _common import ...``): the environment stamp,
the one clock (``torch.utils.benchmark.Timer``), the peak memory of one call in a fresh worker
(start workers while the parent is small: Linux carries its peak RSS into the child's
``ru_maxrss``), atomic JSON, and ``render.py``'s tables.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy
import torch
from render import secs as fmt_seconds  # noqa: F401  (the scripts' tables: one formatting)
from render import table as markdown_table  # noqa: F401
from torch.utils.benchmark import Timer  # imported here: its import took 2 s on a loaded machine

REPO_ROOT = Path(__file__).resolve().parent.parent

MEMORY_CAVEAT_CPU = (
    "peak RSS rise over the resident set after setup (imports, model, inputs), in a fresh "
    "process: the call's own peak, /proc/self/status VmHWM reset just before it (5 into "
    "/proc/self/clear_refs: vmhwm_reset), else ru_maxrss (over-reports where setup peaked "
    "higher). It includes allocator caching and the first call's one-time costs; bench_peers' "
    "memory workers import torch._dynamo before (torch does on a first vmap of some ops, about "
    "70 MiB once, which the code users write pays too)."
)
MEMORY_CAVEAT_CUDA = (
    "torch.cuda.max_memory_allocated() after one call minus memory_allocated() before it (peak "
    "stats reset, synchronised), in a fresh process; cached but unallocated blocks not counted."
)


# ---------------------------------------------------------------------- environment
def git_commit(root: Path = REPO_ROOT) -> dict[str, Any]:
    """``{"commit": hash or None, "dirty": bool or None}`` without taking git's index lock; the
    results the run itself writes do not make the tree dirty."""

    def git(*args: str) -> str | None:
        try:
            cmd = ["git", "--no-optional-locks", *args]
            out = subprocess.run(
                cmd, cwd=root, capture_output=True, text=True, timeout=20, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    tree = ("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    status = git(*tree) if commit else None
    return {"commit": commit or None, "dirty": None if status is None else bool(status)}


def malloc_env() -> dict[str, str] | None:
    """This process's glibc malloc settings (``MALLOC_*`` variables), ``None`` where unset."""
    return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")} or None


def env_stamp(device: str | torch.device) -> dict[str, Any]:
    """What produced the numbers: versions, machine, threads, device, git commit, date (UTC)."""
    device = torch.device(device)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cuda = device.type == "cuda" and torch.cuda.is_available()
    git = git_commit()
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "cpu_model": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "malloc_env": malloc_env(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "device": str(device),
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_name": torch.cuda.get_device_name(device) if cuda else None,
        "cuda_version": torch.version.cuda,
        "load_average_at_start": load_average(),
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "argv": sys.argv,
    }


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def error_text(e: BaseException) -> str:
    """``Type: message (at file:line)``, at most ~600 characters, for a JSON record."""
    tb = traceback.extract_tb(e.__traceback__)
    at = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}"[:600] + at


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (``None`` where unavailable)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# ---------------------------------------------------------------------- timing
def sync(device: str | torch.device) -> None:
    """Wait for queued device work (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def timed_call(
    fn: Callable[[], Any], device: str | torch.device, threads: int | None = None
) -> tuple[float, Any]:
    """``(seconds, fn())``: ONE call timed by ``torch.utils.benchmark.Timer``'s clock (which
    synchronises CUDA), without the two warm-up calls ``Timer.timeit`` makes: a first call."""
    box: list[Any] = []
    glob = {"box": box, "fn": fn}
    timer = Timer("box.append(fn())", globals=glob, num_threads=threads or torch.get_num_threads())
    sync(device)
    seconds = timer._timeit(1)
    return seconds, box[0]


def timer_median(
    fn: Callable[[], Any], *, threads: int, min_run_time: float, warm_s: float
) -> dict[str, Any]:
    """Time ``fn`` with ``torch.utils.benchmark.Timer(num_threads=threads)`` (its clock
    synchronises CUDA): ``blocked_autorange(min_run_time)``, or, when one warm call already took
    ``warm_s >= min_run_time``, up to three single calls (one call each) until they add up to
    ``min_run_time``. ``seconds`` is the median per call."""
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    if warm_s >= min_run_time:
        times: list[float] = []
        while len(times) < 3 and (not times or sum(times) < min_run_time):
            times.append(timer._timeit(1))
        how = f"Timer, {len(times)} single calls (one call >= min_run_time), median"
        return {"seconds": median(times), "timing": how, "timed_calls": len(times), "times": times}
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return {
        "seconds": m.median,
        "timing": f"Timer.blocked_autorange(min_run_time={min_run_time:g}), median per call",
        "timed_calls": len(m.raw_times) * m.number_per_run,
        "number_per_block": m.number_per_run,
        "iqr": m.iqr,
    }


class TimeLimit(Exception):
    """Raised inside a call that ran past :func:`time_limit`."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`TimeLimit` in the main thread after ``seconds`` (SIGALRM, so between two
    Python-level steps: a long single kernel finishes first); no limit for ``None``/0."""
    if not seconds or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(_sig: int, _frame: Any) -> None:
        raise TimeLimit(f"ran past {seconds:.3g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------- memory
def _proc(path: str, read: Callable[[Any], int | None]) -> int | None:
    try:
        with open(path) as f:
            return read(f)
    except (OSError, ValueError, IndexError):
        return None


def rss_bytes() -> int | None:
    """Current resident set size from ``/proc/self/statm`` (``None`` where there is none)."""
    pages = _proc("/proc/self/statm", lambda f: int(f.read().split()[1]))
    return None if pages is None else pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The process's lifetime peak resident set size in bytes (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # KiB on Linux


def vmhwm_bytes() -> int | None:
    """This address space's peak resident set (``VmHWM``), or ``None``; unlike ``ru_maxrss``
    not inherited from the parent at ``execve``."""
    hwm = [line for line in (_proc("/proc/self/status", list) or []) if line.startswith("VmHWM:")]
    return int(hwm[0].split()[1]) * 1024 if hwm else None


def reset_vmhwm() -> bool:
    """Reset this process's ``VmHWM`` to its current resident set (``5`` into
    ``/proc/self/clear_refs``, Linux 4.0+); ``False`` where that is refused or absent."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
        return True
    return False


def measure_peak_memory(fn: Callable[[], Any], device: str | torch.device) -> dict[str, Any]:
    """Peak memory of one call of ``fn``; call it once, in a fresh process, after setup.

    CPU (:data:`MEMORY_CAVEAT_CPU`): the rise of the call's own peak (``VmHWM`` reset just
    before it) over the resident set before it; where the reset is refused, ``ru_maxrss``
    after the call (or ``VmHWM`` where ``ru_maxrss`` holds a peak inherited from the parent).
    CUDA: peak allocated device memory over the pre-call allocation, plus the host figures.
    """
    device = torch.device(device)
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cuda_base = torch.cuda.memory_allocated(device)
    base, base_kind = rss_bytes(), "statm"
    if base is None:  # no /proc: fall back to the peak so far (the rise is then a lower bound)
        base, base_kind = peak_rss_bytes(), "ru_maxrss"
    ru_before, hwm_before = peak_rss_bytes(), vmhwm_bytes()
    reset = hwm_before is not None and reset_vmhwm()
    out = fn()
    sync(device)
    ru_after, hwm_after = peak_rss_bytes(), vmhwm_bytes()
    inherited = hwm_after is not None and ru_after > hwm_after + os.sysconf("SC_PAGE_SIZE")
    rec: dict[str, Any] = {
        "peak_rss_rise_bytes": int(max(ru_after - base, 0)),
        "vmhwm_rise_bytes": None if hwm_after is None else int(max(hwm_after - base, 0)),
        "rss_baseline_bytes": int(base),
        "rss_baseline_source": base_kind,
        "ru_maxrss_before_bytes": ru_before,
        "ru_maxrss_after_bytes": ru_after,
        "vmhwm_before_bytes": hwm_before,
        "vmhwm_after_bytes": hwm_after,
        "vmhwm_reset": reset,
        "ru_maxrss_inherited": inherited,
    }
    by_hwm = reset or inherited
    if cuda:
        rec["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(device) - cuda_base)
        rec["cuda_device_name"] = torch.cuda.get_device_name(device)
        rec["peak_memory_bytes"] = rec["cuda_peak_bytes"]
        rec["memory_kind"] = "cuda_max_memory_allocated_rise"
    else:
        rec["peak_memory_bytes"] = rec["vmhwm_rise_bytes" if by_hwm else "peak_rss_rise_bytes"]
        rec["memory_kind"] = "cpu_vmhwm_rise" if by_hwm else "cpu_peak_rss_rise"
    del out
    return rec


def run_worker(
    args: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``sys.executable *args`` in a fresh process (``env``: variables added to this process's
    environment); its last stdout line parsed as a JSON object, or ``{"error": ...}``."""
    cmd = [sys.executable, *args]
    full_env = {**os.environ, **env} if env else None
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=full_env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"worker timed out after {timeout_s:g} s: {' '.join(cmd)}"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"worker exited with {proc.returncode}: {' | '.join(tail)}"}
    try:
        rec = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"error": f"worker printed no JSON: {lines[-1][:200]!r}"}
    if not isinstance(rec, dict):
        return {"error": f"worker printed {type(rec).__name__}, not a JSON object"}
    return rec


# ---------------------------------------------------------------------- output
def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    return x


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON atomically (``path.tmp``, then rename); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_jsonable(data), f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def fmt_bytes(b: int | None) -> str:
    """Bytes as MiB with one decimal (``-`` for None)."""
    return "-" if b is None else f"{b / 2**20:.1f}"
