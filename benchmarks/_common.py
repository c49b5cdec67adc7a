"""Shared helpers for the benchmark scripts in ``benchmarks/``.

Only the standard library and torch. Import it from a script in this folder as
``from _common import ...`` (running ``python benchmarks/<script>.py`` puts this folder first on
``sys.path``).

* :func:`env_stamp`: versions, machine, threads, device, git commit, date;
  :func:`load_average` (timings on a shared machine are only as good as its load).
* The one timing method, ``torch.utils.benchmark.Timer``: :func:`timer_median` (warm calls),
  :func:`timed_call` (one call: a first call); :func:`time_limit` (SIGALRM).
* :func:`rss_bytes`, :func:`peak_rss_bytes`, :func:`vmhwm_bytes`, :func:`reset_vmhwm`,
  :func:`measure_peak_memory`: peak memory of one call, meant to run in a fresh worker process;
  :func:`run_worker` starts such a process and reads back the one-line JSON it prints. Start
  workers while the parent is still small: Linux carries the parent's peak RSS into the child's
  ``ru_maxrss`` at exec.
* :func:`write_json`: atomic JSON writing (``*.tmp`` then rename).
* :func:`markdown_table`, :func:`fmt_seconds`, :func:`fmt_bytes`, :func:`fmt_float`: the table.
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

import torch
from torch.utils.benchmark import Timer  # imported here: its import took 2 s on a loaded machine

__all__ = [
    "Timer",
    "MEMORY_CAVEAT_CPU",
    "MEMORY_CAVEAT_CUDA",
    "REPO_ROOT",
    "TimeLimit",
    "cpu_model",
    "error_text",
    "env_stamp",
    "fmt_bytes",
    "fmt_float",
    "fmt_seconds",
    "git_commit",
    "load_average",
    "malloc_env",
    "markdown_table",
    "measure_peak_memory",
    "median",
    "peak_rss_bytes",
    "rss_bytes",
    "vmhwm_bytes",
    "reset_vmhwm",
    "run_worker",
    "sync",
    "time_limit",
    "timed_call",
    "timer_median",
    "write_json",
]

REPO_ROOT = Path(__file__).resolve().parent.parent

MEMORY_CAVEAT_CPU = (
    "peak RSS rise over the post-setup baseline, in a fresh process: the resident set read "
    "from /proc/self/statm after imports, model and input construction, then the peak resident "
    "set of one call, read as /proc/self/status VmHWM after resetting it (writing 5 to "
    "/proc/self/clear_refs) just before the call, so a setup that peaked higher does not count "
    "(vmhwm_reset). Where the reset is refused, ru_maxrss (the lifetime peak) after the call "
    "stands in, and over-reports if the setup peaked above the baseline. It includes allocator "
    "caching and one-time costs of the first call (kernel/dispatcher set-up). The bench_peers "
    "memory workers import torch._dynamo before the baseline: torch imports it on a process's "
    "first vmap of some ops (a conv with per-sample weights), about 70 MiB once, which the "
    "code users write pays too; a one-time cost, not a working set."
)
MEMORY_CAVEAT_CUDA = (
    "torch.cuda.max_memory_allocated() after one call minus memory_allocated() before it "
    "(peak stats reset first, synchronised), in a fresh process; caching-allocator blocks "
    "reserved but not allocated are not counted."
)


# ---------------------------------------------------------------------- environment
def git_commit(root: Path = REPO_ROOT) -> dict[str, Any]:
    """``{"commit": hash or None, "dirty": bool or None}`` without taking git's index lock."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "--no-optional-locks", *args],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    # the results the run itself writes do not make the tree dirty
    status = (
        git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
        if commit
        else None
    )
    return {"commit": commit or None, "dirty": None if status is None else bool(status)}


def malloc_env() -> dict[str, str] | None:
    """This process's glibc malloc settings (``MALLOC_*`` variables), ``None`` where unset."""
    return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")} or None


def env_stamp(device: str | torch.device) -> dict[str, Any]:
    """What produced the numbers: versions, machine, threads, device, git commit, date (UTC)."""
    device = torch.device(device)
    try:
        import numpy

        numpy_version: str | None = numpy.__version__
    except ImportError:  # pragma: no cover - numpy is a dependency of the package
        numpy_version = None
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    cuda_name = None
    if device.type == "cuda" and torch.cuda.is_available():
        cuda_name = torch.cuda.get_device_name(device)
    git = git_commit()
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "torch": torch.__version__,
        "numpy": numpy_version,
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
        "cuda_device_name": cuda_name,
        "cuda_version": torch.version.cuda,
        "load_average_at_start": load_average(),
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "argv": sys.argv,
    }


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
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
    timer = Timer(
        stmt="box.append(fn())",
        globals={"box": box, "fn": fn},
        num_threads=threads or torch.get_num_threads(),
    )
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
def rss_bytes() -> int | None:
    """Current resident set size from ``/proc/self/statm`` (``None`` where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The process's lifetime peak resident set size in bytes (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # KiB on Linux


def vmhwm_bytes() -> int | None:
    """This address space's peak resident set (``VmHWM`` of ``/proc/self/status``), or ``None``.

    Unlike ``ru_maxrss`` it is not inherited: Linux folds the parent's peak into the child's
    ``ru_maxrss`` at ``execve`` (after ``fork``/``vfork``), so a worker started by a large parent
    reports the parent's peak until it exceeds it.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_vmhwm() -> bool:
    """Reset this process's ``VmHWM`` to its current resident set (``5`` into
    ``/proc/self/clear_refs``, Linux 4.0+); ``False`` where that is refused or absent."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def measure_peak_memory(fn: Callable[[], Any], device: str | torch.device) -> dict[str, Any]:
    """Peak memory of one call of ``fn``; call it once, in a fresh process, after setup.

    CPU: peak RSS rise over the post-setup baseline (see :data:`MEMORY_CAVEAT_CPU`): the
    ``/proc/self/statm`` resident set before the call, and the call's own peak as ``VmHWM``
    reset just before it (``vmhwm_reset``); where the reset is refused, ``ru_maxrss * 1024``
    after the call (a lifetime peak, so a setup that peaked higher over-reports), or ``VmHWM``
    when ``ru_maxrss`` holds a peak inherited from the parent (``ru_maxrss_inherited``). CUDA:
    peak allocated device memory over the pre-call allocation (:data:`MEMORY_CAVEAT_CUDA`),
    plus the host figures.
    """
    device = torch.device(device)
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cuda_base = torch.cuda.memory_allocated(device)
    base = rss_bytes()
    base_kind = "statm"
    if base is None:  # no /proc: fall back to the peak so far (the rise is then a lower bound)
        base, base_kind = peak_rss_bytes(), "ru_maxrss"
    ru_before, hwm_before = peak_rss_bytes(), vmhwm_bytes()
    reset = hwm_before is not None and reset_vmhwm()
    out = fn()
    sync(device)
    ru_after, hwm_after = peak_rss_bytes(), vmhwm_bytes()
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    inherited = hwm_after is not None and ru_after > hwm_after + page
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
    cpu_peak = rec["vmhwm_rise_bytes"] if by_hwm else rec["peak_rss_rise_bytes"]
    if cuda:
        rec["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(device) - cuda_base)
        rec["cuda_device_name"] = torch.cuda.get_device_name(device)
        rec["peak_memory_bytes"] = rec["cuda_peak_bytes"]
        rec["memory_kind"] = "cuda_max_memory_allocated_rise"
    else:
        rec["peak_memory_bytes"] = cpu_peak
        rec["memory_kind"] = "cpu_vmhwm_rise" if by_hwm else "cpu_peak_rss_rise"
    del out
    return rec


def run_worker(
    args: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``sys.executable *args`` in a fresh process (``env``: variables added to this
    process's environment); parse the last stdout line as JSON.

    Returns the parsed dict, or ``{"error": ...}`` when the worker fails or times out.
    """
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


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; numbers right-aligned, everything else left-aligned."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = [
        bool(rows) and all(_is_number(r[i]) for r in rows if r[i] not in (None, "", "-"))
        for i in range(len(headers))
    ]

    def line(r: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right, strict=True)
        ]
        return "| " + " | ".join(parts) + " |"

    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if ra else ("-" * (w + 2))
            for w, ra in zip(widths, right, strict=True)
        )
        + "|"
    )
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def _is_number(x: Any) -> bool:
    if isinstance(x, (int, float)):
        return True
    try:
        float(str(x).rstrip("x").replace(",", ""))
    except ValueError:
        return False
    return True


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 100:
        return f"{s:.0f}"
    if s >= 10:
        return f"{s:.1f}"
    if s >= 0.1:
        return f"{s:.2f}"
    return f"{s:.3g}"


def fmt_bytes(b: int | None) -> str:
    """Bytes as MiB with one decimal (``-`` for None)."""
    return "-" if b is None else f"{b / 2**20:.1f}"


def fmt_float(x: float | None, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)
