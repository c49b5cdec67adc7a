"""Command line: ``multiscale-jac demo``, ``multiscale-jac bench`` and ``multiscale-jac
--version`` (also ``python -m multiscale_jac ...``)."""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["main"]

#: overrides where ``multiscale-jac bench`` looks for the benchmarks folder
_BENCH_ENV = "MULTISCALE_JAC_BENCHMARKS"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _benchmarks_dir() -> Path:
    """``$MULTISCALE_JAC_BENCHMARKS``, or the ``benchmarks/`` folder of the source tree that
    holds this package (present in a checkout installed with ``pip install -e .``)."""
    env = os.environ.get(_BENCH_ENV)
    return Path(env) if env else Path(__file__).resolve().parent.parent / "benchmarks"


def _load_driver() -> ModuleType:
    """The benchmark driver, ``benchmarks/driver.py`` of the folder :func:`_benchmarks_dir`
    names, loaded from its path (it imports no torch at module level).

    Raises:
        FileNotFoundError: no driver there (the installed package has no benchmarks).
    """
    folder = _benchmarks_dir()
    path = folder / "driver.py"
    if not path.is_file():
        where = (
            f"set by ${_BENCH_ENV}"
            if os.environ.get(_BENCH_ENV)
            else f"next to the installed package; ${_BENCH_ENV} is unset"
        )
        raise FileNotFoundError(
            f"no benchmark scripts at {folder} ({where}; no driver.py there). "
            "'multiscale-jac bench' runs the scripts in the benchmarks/ folder of the source "
            "repository, which the installed package does not include: run it from a source "
            f"checkout (pip install -e .), or set {_BENCH_ENV} to the benchmarks/ folder of one"
        )
    return _load_module(path.resolve())


@functools.cache
def _load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("multiscale_jac_bench_driver", path)
    if spec is None or spec.loader is None:  # pragma: no cover (a .py file always has a loader)
        raise FileNotFoundError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _driver_suites() -> tuple[str, ...] | None:
    """The driver's suite names, or ``None`` without a benchmarks folder."""
    try:
        return tuple(_load_driver().SUITES)
    except FileNotFoundError:
        return None


def version_text() -> str:
    """``multiscale-jac VERSION (torch VERSION, BUILD)``: the package version
    (``multiscale_jac.__version__``, the installed distribution's version if that differs) and
    which torch build is imported (CPU-only or the CUDA version it was built for)."""
    from . import __version__

    text = f"multiscale-jac {__version__}"
    try:
        installed = importlib.metadata.version("multiscale_jac")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        installed = __version__
    if installed != __version__:
        text += f" (installed metadata says {installed}; reinstall with pip install -e .)"
    try:
        import torch
    except ImportError:  # pragma: no cover (the package imports torch)
        return text
    cuda = torch.version.cuda
    build = f"CUDA {cuda} build" if cuda else "CPU-only build"
    if cuda:
        build += ", a GPU is visible" if torch.cuda.is_available() else ", no GPU visible"
    return f"{text} (torch {torch.__version__}, {build})"


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` (computed only when asked) and exit 0."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version_text())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multiscale-jac",
        description=(
            "Per-sample Jacobians and curvature for multi-resolution PyTorch networks. "
            "Run a subcommand with --help for its options."
        ),
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the package version (and the torch build it runs on) and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo_parser(sub)
    _add_bench_parser(sub, _driver_suites())
    return parser


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="check the engine against the loop reference on a built-in FPN and print a table",
        description=(
            "Build a small FPN-like model and a batch of multi-resolution samples of mixed "
            "sizes, compute per-sample Jacobians w.r.t. the head and w.r.t. single weight "
            "entries with strategy='auto', check them against the loop reference and print "
            "strategy, mode, shapes, times and the largest absolute difference, one row as soon "
            "as it is computed (a progress line on stderr while it works). Times: the engine's "
            "first call (planning included) and its second (the first's plan), then "
            "warm medians of repeated calls of the engine and of the loop reference, interleaved "
            "round by round; the speed-up is warm vs warm, the median of the rounds with their "
            "range. Exits with status 1 if a difference exceeds the tolerance."
        ),
    )
    demo.add_argument("--samples", type=_positive_int, default=8, help="batch size N (default 8)")
    demo.add_argument(
        "--entries",
        type=_positive_int,
        default=500,
        help="single weight entries to select (default 500)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help=(
            "interleaved rounds of warm calls (one engine call, then one loop-reference call): "
            "medians and the speed-up's range over the rounds reported (default 3; at least 2, "
            "no more once the rounds took 30 s)"
        ),
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    demo.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)"
    )
    demo.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float64",
        help="dtype of model and data (default float64)",
    )


def _add_bench_parser(sub: argparse._SubParsersAction, suites: tuple[str, ...] | None) -> None:
    """``bench``; ``suites``: the driver's suites (``None``: no benchmarks folder found, the
    command then says so when run)."""
    listed = ", ".join(suites) if suites is not None else "none found here"
    bench = sub.add_parser(
        "bench",
        help="run the benchmark grid and write report.md, results.json and plots",
        description=(
            f"Run the named grids ({listed}) of the benchmark grid, benchmarks/bench_peers.py "
            f"of a source checkout (or of the folder ${_BENCH_ENV} names): a fresh process "
            "per cell, every method timed with torch.utils.benchmark as a ratio to a training "
            "step measured in the same process, peak memory from a fresh process per method "
            "(CUDA: max_memory_allocated after cuda.synchronize). Writes DIR/raw/grid.json "
            "(the results file, with every run's environment), DIR/report.md (tables), "
            "DIR/results.json and DIR/grid_*.png (needs matplotlib, the 'plot' extra). Exits "
            "with status 1 if the grid fails."
        ),
    )
    bench.add_argument(
        "--quick", action="store_true", help="small workloads (a few minutes on a laptop CPU)"
    )
    bench.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where to run (default cpu)",
    )
    bench.add_argument(
        "--out",
        default="bench-report",
        metavar="DIR",
        help="output folder, created if missing (default ./bench-report)",
    )
    bench.add_argument(
        "--suites",
        nargs="+",
        choices=None if suites is None else list(suites),
        default=None,
        metavar="GRID",
        help=f"named grids to run (default all: {listed}; --quick: one cell of main)",
    )
    bench.add_argument(
        "--timeout",
        type=_positive_int,
        default=None,
        metavar="SECONDS",
        help="stop the grid if it runs longer (default: no limit)",
    )
    bench.add_argument("--no-progress", action="store_true", help="(kept for scripts; no effect)")
    bench.add_argument(
        "--from",
        dest="from_dir",
        default=None,
        metavar="DIR",
        help=(
            "run nothing: write the report from the results file in DIR (e.g. "
            "benchmarks/results: grid.json, the committed runs; with --quick, grid_quick.json)"
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available")
    return {"demo": _demo, "bench": _bench}[args.command](args, parser)


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        driver = _load_driver()
    except FileNotFoundError as err:
        parser.error(str(err))
    default = getattr(driver, "QUICK_SUITES", driver.SUITES) if args.quick else driver.SUITES
    suites = list(default) if args.suites is None else args.suites
    unknown = [s for s in suites if s not in driver.SUITES]
    if unknown:  # only when the parser was built without the driver
        parser.error(
            f"argument --suites: invalid choice: {unknown[0]!r} "
            f"(choose from {', '.join(driver.SUITES)})"
        )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {args.out!r} exists and is not a folder")
    if args.from_dir is not None:
        if not Path(args.from_dir).is_dir():
            parser.error(f"--from {args.from_dir!r} is not a folder")
        driver.write_report(Path(args.from_dir), out, suites, quick=args.quick, device=args.device)
        return 0
    return driver.run_bench(
        quick=args.quick,
        device=args.device,
        out=out,
        suites=suites,
        progress=not args.no_progress,
        timeout=args.timeout,
    )


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from ._demo import format_footer, format_header, format_row, iter_demo

    dtype = getattr(torch, args.dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    header = (
        f"multiscale_jac demo: TinyFPN, {args.samples} mixed-size samples (2 levels), "
        f"{args.dtype} on {args.device}; tolerance {tol:g}; warm times are medians of up to "
        f"{args.repeats} calls after the first two, engine and loop reference interleaved"
    )
    line = _ProgressLine(enabled=not args.no_progress)
    print(format_header(header), flush=True)
    rows = []
    for row in iter_demo(
        samples=args.samples,
        entries=args.entries,
        seed=args.seed,
        device=args.device,
        dtype=dtype,
        repeats=args.repeats,
        progress=line.show,
    ):
        line.clear()
        print(format_row(row), flush=True)
        rows.append(row)
    line.clear()
    print()
    print(format_footer(rows))
    bad = [r for r in rows if not r.max_abs_diff <= tol]
    print()
    if bad:
        print(f"FAIL: {', '.join(r.subset for r in bad)} differ from the loop reference")
        return 1
    print("OK: every Jacobian equals the loop reference")
    return 0


class _ProgressLine:
    """A progress line on stderr: rewritten in place on a terminal, one line per message
    otherwise (a log); nothing when disabled."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.width = 0

    def show(self, message: str) -> None:
        if not self.enabled:
            return
        text = f"... {message}"
        if self.tty:
            sys.stderr.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled and self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
            self.width = 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
