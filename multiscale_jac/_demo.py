"""The ``demo`` command: the engine against the loop reference on a built-in FPN.

Every row is timed three ways: the engine's *first* call (planning and one-off set-up
included), the engine *warm* (median of repeated calls after the second) and the loop reference
*warm* (median of repeated calls after a one-sample warm-up call). The engine's second call is
timed apart (it reuses the first call's plan: nothing is measured on it, ``docs/design.md``),
and the row shows the route of the warm calls. The warm calls run in interleaved rounds
(one engine call, then one loop call), so that a change in the machine's load falls on both
alike; the speed-up is the median of the rounds' ratios (warm loop over warm engine), reported
with their range. A first or second call's time is never used as a ratio.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ._tuning import stopwatch
from .engine import per_sample_jacobian
from .models import TinyFPN
from .packing import pack
from .reference import per_sample_jacobian_loop
from .subset import ParamSubset

__all__ = ["DemoRow", "format_footer", "format_header", "format_row", "iter_demo", "run_demo"]

#: Spatial sizes (H, W) of the finest level; the second level is half that (rounded up).
_SIZES = [(10, 10), (8, 12), (10, 10), (12, 8), (8, 8), (8, 12), (10, 10), (9, 7)]

#: The interleaved warm rounds stop early once they have taken this long in total (two rounds are
#: always made where ``repeats`` allows, so that the speed-up has a range), so that a slow loop
#: reference does not triple the demo's time.
WARM_BUDGET_S = 30.0


@dataclass(frozen=True)
class DemoRow:
    """One line of the demo's table.

    Attributes:
        subset: Label of the parameter subset.
        numel: Number of selected parameter entries ``P``.
        strategy: Strategy the engine ran in its warm calls.
        mode: Mode the engine ran in its warm calls (``"fwd"`` or ``"rev"``).
        shape: Shape of the Jacobian ``(N, O, P)``.
        first_s: Seconds of the engine's first call on this subset and batch (planning and
            one-off set-up included).
        engine_s: Median seconds of the engine's warm calls (after the second).
        loop_s: Median seconds of the loop reference's warm calls (after a warm-up call).
        max_abs_diff: Largest absolute difference between engine (its first and its last call)
            and loop reference.
        engine_calls: Number of warm engine calls behind ``engine_s``.
        loop_calls: Number of warm loop-reference calls behind ``loop_s``.
        ratios: Warm loop over warm engine of each interleaved round (empty: not recorded;
            :attr:`speed_up` is then ``loop_s / engine_s``).
        second_s: Seconds of the engine's second call, its plan the first call's (0: not
            recorded).
    """

    subset: str
    numel: int
    strategy: str
    mode: str
    shape: tuple[int, ...]
    first_s: float
    engine_s: float
    loop_s: float
    max_abs_diff: float
    engine_calls: int = 1
    loop_calls: int = 1
    ratios: tuple[float, ...] = ()
    second_s: float = 0.0

    @property
    def speed_up(self) -> float:
        """Warm loop reference over warm engine: the median of the interleaved rounds' ratios
        (``loop_s / engine_s`` without them; ``inf`` if the engine took no time)."""
        if self.ratios:
            return statistics.median(self.ratios)
        return self.loop_s / self.engine_s if self.engine_s > 0 else float("inf")

    @property
    def speed_up_text(self) -> str:
        """The speed-up with the range of the rounds, e.g. ``"3.1x (2.7-3.5x)"``."""
        if len(self.ratios) < 2:
            return f"{self.speed_up:.1f}x"
        return f"{self.speed_up:.1f}x ({min(self.ratios):.1f}-{max(self.ratios):.1f}x)"


def iter_demo(
    *,
    samples: int = 8,
    entries: int = 500,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float64,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> Iterator[DemoRow]:
    """Per-sample Jacobians of :class:`TinyFPN` on mixed-size samples, engine vs loop, one
    row at a time (each row is yielded as soon as it is computed).

    Args:
        samples: Batch size ``N``.
        entries: Number of random single weight entries in the second subset.
        seed: Random seed of model, data and entries.
        device: Where to run (``"cpu"`` or ``"cuda"``).
        dtype: Dtype of model and data.
        repeats: Most interleaved warm rounds (one engine call, then one loop-reference call);
            the medians and the rounds' ratios are reported. At least two are made where
            ``repeats`` allows, no more once the rounds have taken :data:`WARM_BUDGET_S`
            seconds.
        progress: Called with a short description before every timed call (for a progress
            line); ``None``: silent.

    Yields:
        One :class:`DemoRow` per subset (the head, and ``entries`` random single entries).
    """
    say = progress or (lambda _msg: None)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyFPN(in_channels=(8, 16), width=16, num_outputs=4)
    model = model.to(device=device, dtype=dtype).eval()
    batch = []
    for k in range(samples):
        h, w = _SIZES[k % len(_SIZES)]
        shapes = [(8, h, w), (16, (h + 1) // 2, (w + 1) // 2)]
        batch.append([torch.randn(s, generator=g, dtype=dtype).to(device) for s in shapes])
    packed = pack(batch)
    total = sum(p.numel() for p in model.parameters())
    subsets = {
        "head.*": ParamSubset.from_names(model, "head.*"),
        f"{entries} entries": ParamSubset.from_flat_indices(
            model, torch.randperm(total, generator=g)[:entries]
        ),
    }
    for label, subset in subsets.items():
        yield _row(model, batch, packed, label, subset, device, repeats, say)


def run_demo(**kwargs: Any) -> list[DemoRow]:
    """All rows of :func:`iter_demo` (same keyword arguments) as a list."""
    return list(iter_demo(**kwargs))


def _row(
    model: torch.nn.Module,
    batch: list,
    packed: Any,
    label: str,
    subset: ParamSubset,
    device: str,
    repeats: int,
    say: Callable[[str], None],
) -> DemoRow:
    """One row: the engine's first and second calls, the loop reference's warm-up call, then
    the interleaved warm rounds."""

    def engine() -> Any:
        return per_sample_jacobian(model, packed, params=subset, strategy="auto")

    say(f"{label}: engine, first call (planning included)")
    res, first_s = _timed(engine, device)
    say(f"{label}: engine, second call")
    _, second_s = _timed(engine, device)
    say(f"{label}: loop reference, warm-up call on one sample")
    _timed(lambda: per_sample_jacobian_loop(model, batch[:1], params=subset), device)
    warm: list = []
    refs: list = []

    def engine_warm() -> None:
        warm[:] = [engine()]

    def loop_warm() -> None:
        refs[:] = [per_sample_jacobian_loop(model, packed, params=subset)]

    engine_times, loop_times = _interleaved_rounds(
        engine_warm,
        loop_warm,
        device,
        repeats,
        lambda k, who: say(f"{label}: round {k}/{repeats}, {who} warm call"),
    )
    last = warm[0]
    diff = max((r.jacobian - refs[0].jacobian).abs().max().item() for r in (res, last))
    return DemoRow(
        subset=label,
        numel=subset.numel,
        strategy=last.strategy.value,
        mode=last.mode.value,
        shape=tuple(last.jacobian.shape),
        first_s=first_s,
        engine_s=statistics.median(engine_times),
        loop_s=statistics.median(loop_times),
        max_abs_diff=diff,
        engine_calls=len(engine_times),
        loop_calls=len(loop_times),
        ratios=tuple(
            lo / en if en > 0 else float("inf") for en, lo in zip(engine_times, loop_times)
        ),
        second_s=second_s,
    )


def _timed(call: Callable[[], object], device: str) -> tuple[object, float]:
    """``(call(), seconds)``, synchronising CUDA before the clock stops."""
    with stopwatch([torch.device(device)]) as elapsed:
        out = call()
    return out, elapsed[0]


def _interleaved_rounds(
    engine: Callable[[], object],
    loop: Callable[[], object],
    device: str,
    repeats: int,
    announce: Callable[[int, str], None],
) -> tuple[list[float], list[float]]:
    """Seconds of the engine's and the loop's warm calls, in up to ``repeats`` rounds of one
    engine call then one loop call (at least two where ``repeats`` allows; stop once the rounds
    took :data:`WARM_BUDGET_S` in total)."""
    engine_times: list[float] = []
    loop_times: list[float] = []
    for k in range(1, max(1, repeats) + 1):
        announce(k, "engine")
        engine_times.append(_timed(engine, device)[1])
        announce(k, "loop reference")
        loop_times.append(_timed(loop, device)[1])
        if k >= 2 and sum(engine_times) + sum(loop_times) >= WARM_BUDGET_S:
            break
    return engine_times, loop_times


_COLUMNS = (
    f"{'subset':<14} {'P':>6} {'strategy':<9} {'mode':<4} {'jacobian (N, O, P)':<20} "
    f"{'first s':>8} {'warm s':>8} {'loop warm s':>11} {'max |diff|':>11}  speed-up (range)"
)


def format_header(header: str) -> str:
    """The title line and the column names of the table."""
    return f"{header}\n\n{_COLUMNS}"


def format_row(r: DemoRow) -> str:
    """One table row: the engine's first call, its warm median, the loop reference's warm
    median, the largest difference and the warm speed-up with the range of its rounds."""
    return (
        f"{r.subset:<14} {r.numel:>6} {r.strategy:<9} {r.mode:<4} {r.shape!s:<20} "
        f"{r.first_s:>8.3f} {r.engine_s:>8.3f} {r.loop_s:>11.3f} {r.max_abs_diff:>11.2e}  "
        f"{r.speed_up_text}"
    )


def format_footer(rows: list[DemoRow]) -> str:
    """What the time columns mean, with the number of warm calls behind each median, and the
    headline: each row's speed-up with its range over the interleaved rounds."""
    counts = "; ".join(f"{r.subset}: engine {r.engine_calls}, loop {r.loop_calls}" for r in rows)
    headline = "; ".join(f"{r.subset} ({r.mode}) {_headline(r)}" for r in rows)
    second = ", ".join(f"{r.subset} {r.second_s:.3f} s" for r in rows if r.second_s)
    if second:
        second = f"The engine's second call (the first call's plan, nothing measured): {second}.\n"
    return (
        "first s: the engine's first call on this subset and batch (planning included).\n"
        f"{second}"
        "warm s: median of the engine's warm calls after the first two; strategy and mode are "
        "theirs; loop warm s: median of the "
        "loop reference's warm calls after a warm-up call; the warm calls run in interleaved "
        "rounds (one engine call, then one loop call).\n"
        "speed-up = loop warm s / warm s (warm calls vs warm calls): the median of the rounds' "
        f"ratios, their lowest and highest in brackets. Warm calls: {counts}.\n"
        f"Warm speed-up over the loop reference: {headline}."
    )


def _headline(r: DemoRow) -> str:
    rounds = len(r.ratios)
    if rounds < 2:
        return f"{r.speed_up_text} (one round)" if rounds else r.speed_up_text
    return f"{r.speed_up_text} over {rounds} interleaved rounds"


def format_rows(rows: list[DemoRow], header: str) -> str:
    """The whole table at once (header, rows, footer)."""
    return "\n".join([format_header(header), *map(format_row, rows), "", format_footer(rows)])
