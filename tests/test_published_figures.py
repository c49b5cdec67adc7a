"""The published benchmark figures equal the results file they name.

README.md and docs/*.md publish measurements only inside blocks that name their results file,
``<!-- figures: NAME from benchmarks/results/grid.json -->`` ... ``<!-- /figures -->``, which
``benchmarks/render.py`` renders from that file (units included); ``python
benchmarks/render.py`` rewrites them after a run. The benchmark pages state no measured
figure outside such blocks."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_render", ROOT / "benchmarks" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)

#: a number or a range of them with the unit of a measurement (time, memory, a ratio,
#: training steps)
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
MEASURED = re.compile(
    rf"(?<![\w.=/-]){_NUMBER}(?:-{_NUMBER})?\s?(?:x\b|s\b|ms\b|MiB|GiB|KiB|MB\b|GB\b|KB\b|"
    r"(?:training )?steps?\b)"
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
    for rel in ("README.md", "benchmarks/results/grid.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    (tmp_path / "docs").mkdir()
    readme = tmp_path / "README.md"
    text = readme.read_text()
    body = render.BLOCK.search(text)["body"]
    digit = re.search(r"\d", body)
    changed = body[: digit.start()] + str((int(digit[0]) + 1) % 10) + body[digit.end() :]
    readme.write_text(text.replace(body, changed))
    assert render.stale_blocks(tmp_path) == ["README.md: readme from benchmarks/results/grid.json"]
    render.update_pages(tmp_path)
    assert render.stale_blocks(tmp_path) == []


def _outside_blocks(text: str) -> str:
    text = render.BLOCK.sub("", text)
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks.md"])
def test_measured_figures_stand_only_in_blocks(page: str) -> None:
    text = (ROOT / page).read_text()
    if page == "README.md":  # its performance section
        text = text.split("\n## Performance", 1)[1].split("\n## ", 1)[0]
    found = MEASURED.findall(_outside_blocks(text))
    assert found == [], f"{page} states figures outside the rendered blocks: {found}"
