"""The published benchmark figures equal the results file they name.

README.md and the docs pages (docs/**/*.md) publish measurements only inside blocks that name
their results file, ``<!-- figures: NAME from benchmarks/results/grid.json -->`` ...
``<!-- /figures -->``, which ``benchmarks/render.py`` renders from that file (units included);
``python benchmarks/render.py`` rewrites them after a run. No page states a measured figure
outside such blocks: the figures that look like measurements but are settings of the library,
sizes or quoted output are listed, each with its reason (:data:`NOT_MEASURED`), and the report
page is rendered whole from its own results file (:data:`RENDERED_WHOLE`)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_render", ROOT / "benchmarks" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)

#: a number or a range of them with the unit of a measurement (time, memory, a ratio,
#: training steps); a comma only as a thousands separator (``torch.ones(2, x.shape[-1])`` is
#: no figure)
_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
MEASURED = re.compile(
    rf"(?<![\w.=/-]){_NUMBER}(?:-{_NUMBER})?\s?(?:x\b|s\b|ms\b|MiB|GiB|KiB|MB\b|GB\b|KB\b|"
    r"(?:training )?steps?\b|minutes?\b|%)"
)


def _blocks(page: Path) -> list[str]:
    return [m["name"] for m in render.BLOCK.finditer(page.read_text())]


def test_every_block_equals_what_its_results_file_renders() -> None:
    assert render.stale_blocks(ROOT) == []


def test_the_performance_table_and_the_benchmark_page_are_blocks() -> None:
    assert "readme" in _blocks(ROOT / "README.md")
    published = set(_blocks(ROOT / "docs" / "benchmarks.md"))
    assert {"runs", "main", "choice", "batch-fisher", "batch-jacnorm", "entries"} <= published
    assert {"dense", "laplace-torch", "first-call"} <= published


def test_a_changed_figure_fails(tmp_path: Path) -> None:
    """Change one figure of README.md's table (in a copy): the check names the block."""
    for rel in ("README.md", "benchmarks/results/grid.json", "benchmarks/results/ci.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    (tmp_path / "docs").mkdir()
    readme = tmp_path / "README.md"
    text = readme.read_text()
    (body,) = [m["body"] for m in render.BLOCK.finditer(text) if m["name"] == "readme"]
    digit = re.search(r"\d", body)
    changed = body[: digit.start()] + str((int(digit[0]) + 1) % 10) + body[digit.end() :]
    readme.write_text(text.replace(body, changed))
    assert render.stale_blocks(tmp_path) == ["README.md: readme from benchmarks/results/grid.json"]
    render.update_pages(tmp_path)
    assert render.stale_blocks(tmp_path) == []


def _outside_blocks(text: str) -> str:
    text = render.BLOCK.sub("", text)
    return re.sub(r"```.*?```", "", text, flags=re.S)


#: every page the site or the repository publishes
PAGES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")),
]
#: pages written whole by the renderer from a results file (checked below, not scanned)
RENDERED_WHOLE = {
    "docs/report/report.md": "multiscale-jac bench's report, rendered whole from "
    "docs/report/results.json (test_the_report_page_is_what_its_results_file_renders)",
}

MIB, GIB = 2**20, 2**30


def _setting(module: str, name: str, value: object) -> Callable[[], bool]:
    """A check that ``multiscale_jac.<module>.<name>`` is the value a page states."""
    return lambda: getattr(importlib.import_module(f"multiscale_jac.{module}"), name) == value


_GPU = (
    "a GPU's memory, the hardware of the example, not a measurement: the N x P float32 "
    "per-sample gradients of VGG19 (143.7M parameters) at batch 256 are 147 GB",
    None,
)
_WORKSET = (
    "the default working-set target",
    _setting("_memory", "DEFAULT_WORKSET_BYTES", {"cpu": 64 * MIB, "cuda": 2 * GIB}),
)
_TENSOR_CAP = (
    "the CPU cap on one tensor's per-sample gradients in a chunk",
    _setting("_memory", "CPU_TENSOR_BYTES", 32 * MIB),
)
_ROWS = (
    "the Laplace fits' default Jacobian rows held at once",
    _setting("_memory", "DEFAULT_JACOBIAN_BYTES", 32 * MIB),
)
_GROWTH = ("the growth rule's cap on what is timed", _setting("_tuning", "GROWTH", 4))

#: figures the MEASURED pattern finds that are not measurements: page -> {the exact phrase
#: (whitespace collapsed): (why it may stand, a check that the setting it states is the
#: library's, or None)}. Each phrase must still be on its page, so the list does not go stale.
NOT_MEASURED: dict[str, dict[str, tuple[str, Callable[[], bool] | None]]] = {
    "README.md": {"exhausts a 24 GB GPU": _GPU},
    "docs/guide-ewc.md": {"exhausts a 24 GB GPU": _GPU},
    "docs/padded.md": {
        "per-sample loop is estimated under 0.1 s": (
            "the small-job threshold",
            _setting("engine", "SMALL_JOB_S", 0.1),
        ),
    },
    "docs/derived.md": {
        "per-sample gradients would take 32 MiB": _TENSOR_CAP,
        "per-sample gradients of one tensor would pass 32 MiB": _TENSOR_CAP,
        "the per-layer temporaries, 8 MiB by default": (
            "the layer-wise rules' default temporaries",
            _setting("_memory", "DEFAULT_TEMP_BYTES", 8 * MIB),
        ),
    },
    "docs/design.md": {
        "(64 MiB on CPU, where small chunks measured fastest; 2 GiB on CUDA)": _WORKSET,
        "within **3x** of the fastest (`RETIME`)": (
            "the retime rule",
            _setting("_tuning", "RETIME", 3.0),
        ),
        "within **5%** of the fastest (`TIE`)": ("the tie rule", _setting("_tuning", "TIE", 1.05)),
        "loop is estimated under 0.1 s runs the cheapest plan": (
            "the small-job threshold",
            _setting("engine", "SMALL_JOB_S", 0.1),
        ),
        "is estimated at most **10%** of that loop": (
            "the planning share of a small job",
            _setting("engine", "PLANNING_SHARE", 0.1),
        ),
        "stay under 32 MiB": _TENSOR_CAP,
        "1.4 MiB of gradient per sample": (
            "a size from the shape: 369k float32 entries (128 -> 320 channels, 3x3)",
            None,
        ),
        "2 MiB of gradient per sample": ("a size from the shape: 2048 x 256 float32 entries", None),
    },
    "docs/benchmarks.md": {
        "Laplace fit once rose 137 MiB under it;": ("issue 27's report, quoted: the case", None),
        "64 MiB for the subset Jacobian, whose result alone takes 47 MiB": (
            "the subset cell's budget (FIRST_BUDGETS) and its result's size, (8, 3104, 500) "
            "float32 entries",
            None,
        ),
        "absolute times in under 8 minutes": (
            "the GPU check's limit (issue 29's promise for one call), not a measured time",
            None,
        ),
    },
    "docs/entries.md": {"(64 MiB on CPU)": _WORKSET},
    "docs/guide-subnet-laplace.md": {"default: 32 MiB of Jacobian rows": _ROWS},
    "docs/laplace.md": {
        "`memory_budget` (128 MiB by default)": (
            "the prior search's default budget, four times the default rows",
            _setting("_memory", "DEFAULT_JACOBIAN_BYTES", 32 * MIB),
        ),
        "32 MiB of Jacobian rows are held at a time": _ROWS,
        "working set (64 MiB on CPU)": _WORKSET,
    },
}


def _published(page: str) -> str:
    """The page's text outside its blocks and fenced code, whitespace collapsed."""
    return " ".join(_outside_blocks((ROOT / page).read_text()).split())


def test_every_page_is_scanned() -> None:
    assert {"README.md", "docs/benchmarks.md", "docs/design.md"} <= set(PAGES)
    assert set(NOT_MEASURED) | set(RENDERED_WHOLE) <= set(PAGES)
    assert any(p.startswith("docs/api/") for p in PAGES)


@pytest.mark.parametrize("page", [p for p in PAGES if p not in RENDERED_WHOLE])
def test_measured_figures_stand_only_in_blocks(page: str) -> None:
    text = _published(page)
    for phrase in NOT_MEASURED.get(page, {}):
        assert phrase in text, f"{page}: the listed phrase {phrase!r} is gone: drop it"
        text = text.replace(phrase, " ")
    found = MEASURED.findall(text)
    assert found == [], f"{page} states figures outside the rendered blocks: {found}"


@pytest.mark.parametrize(("page", "phrase"), [(p, f) for p, fs in NOT_MEASURED.items() for f in fs])
def test_listed_figures_are_the_settings_they_name(page: str, phrase: str) -> None:
    why, check = NOT_MEASURED[page][phrase]
    assert why
    if check is not None:
        assert check(), f"{page}: {phrase!r} no longer states the library's setting ({why})"


def test_the_report_page_is_what_its_results_file_renders() -> None:
    report = ROOT / "docs" / "report"
    results = json.loads((report / "results.json").read_text())
    images = [
        Path(f"grid_{k}.png")
        for k in ("main", "batch", "entries")
        if (report / f"grid_{k}.png").exists()
    ]
    assert (report / "report.md").read_text() == render.report_text(results, images)


def test_the_pages_that_cite_measurements_carry_their_blocks() -> None:
    for page, names in {
        "docs/guide-ewc.md": {"guide-fisher"},
        "docs/guide-jacobian-regularisation.md": {"guide-jacnorm"},
        "docs/laplace.md": {"laplace-diag"},
        "docs/padded.md": {"packing"},
    }.items():
        assert names <= set(_blocks(ROOT / page)), page


def test_ci_times_come_from_the_summary_lines_ci_prints(tmp_path: Path) -> None:
    """``.ci/run`` keeps pytest's last line of the suite and of the fast tier; ``--ci-run``
    turns them into a run's record (skipped tests do not count as run), which the ``ci``
    block states."""
    suite, fast = tmp_path / "suite.log", tmp_path / "fast.log"
    suite.write_text(
        "... \n= 2730 passed, 17 skipped, 2 xfailed, 81 warnings in 242.13s (0:04:02) =\n"
    )
    fast.write_text("1517 passed, 9 skipped, 1221 deselected, 2 xfailed in 59.70s (0:00:59)\n")
    rec = render.ci_run(str(suite), str(fast))
    assert rec["suite"] == {
        "seconds": 242.13,
        "tests": 2732,
        "passed": 2730,
        "skipped": 17,
        "xfailed": 2,
    }
    assert rec["fast"]["seconds"] == 59.7 and rec["fast"]["tests"] == 1519
    text = render.ci_times({"runs": [rec, {**rec, "suite": {**rec["suite"], "seconds": 330.0}}]})
    assert "(2,732 tests) took 4.0 to 5.5 minutes" in text and "1,519 of them, 60 s" in text
