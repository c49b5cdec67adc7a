"""The README's quick start and the examples run and say what they claim."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_readme_quick_start_runs(capsys) -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    exec(compile(blocks[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "torch.Size([4, 3104, 500]) vmap fwd" in out  # the comment in the README is true
    assert "('conv.2.weight',)" in out


@pytest.mark.parametrize("page", ["packing.md"])
def test_docs_code_runs_and_prints_what_its_comments_say(page: str, capsys) -> None:
    """Every python block of the page runs; a ``print(...)  # text`` comment is what it prints
    (its first line)."""
    text = (ROOT / "docs" / page).read_text()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        exec(compile(block, page, "exec"), {"__name__": "__docs__"})
        printed = capsys.readouterr().out.splitlines()
        claims = re.findall(r"^print\(.*\)\s+#\s*(.+)$", block, flags=re.M)
        for claim, line in zip(claims, printed):
            assert line.strip() == claim.strip(), (claim, line)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_example_runs(name: str, capsys) -> None:
    runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
    out = capsys.readouterr().out
    for diff in re.findall(r"max \|engine - loop\| = (\S+)", out):
        assert float(diff) < 1e-4


@pytest.mark.parametrize("page", ["padded.md"])
def test_docs_page_blocks_run_and_print_what_they_say(page: str, capsys) -> None:
    """The python blocks of a docs page run in order; every ``print(...)  # expected`` prints
    the expected text."""
    text = (ROOT / "docs" / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    namespace: dict = {}
    for k, block in enumerate(blocks):
        expected = [
            m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s+#\s*(.+)$", block, flags=re.M)
        ]
        exec(compile(block, f"{page}[block {k}]", "exec"), namespace)
        printed = [ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.strip()]
        assert printed[-len(expected) :] if expected else True
        for want, got in zip(expected, printed[-len(expected) :] if expected else []):
            assert got == want, (k, want, got)


def test_testing_page_runs_and_shows_what_it_prints(capsys) -> None:
    """docs/testing.md: the python blocks run in order in one namespace (the Hypothesis
    property test included); a block followed by "It prints:" and a text block prints exactly
    that text, and a ``print(...)  # expected`` line prints the expected text."""
    text = (ROOT / "docs" / "testing.md").read_text()
    pattern = r"```python\n(.*?)```(?:\n\nIt prints:\n\n```text\n(.*?)```)?"
    blocks = re.findall(pattern, text, flags=re.S)
    assert len(blocks) >= 4 and sum(bool(shown) for _, shown in blocks) >= 2
    namespace: dict = {"__name__": "__docs__"}
    for k, (block, shown) in enumerate(blocks):
        exec(compile(block, f"testing.md[block {k}]", "exec"), namespace)
        printed = capsys.readouterr().out
        if shown:
            assert printed.strip() == shown.strip(), (k, printed)
        claims = re.findall(r"^print\(.*\)\s+#\s*(.+)$", block, flags=re.M)
        lines = [ln.strip() for ln in printed.splitlines() if ln.strip()]
        for claim, line in zip(claims, lines):
            assert line == claim.strip(), (k, claim, line)


@pytest.mark.slow
def test_subnet_laplace_example_writes_its_picture(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    module = runpy.run_path(str(ROOT / "examples" / "subnet_laplace_segmentation.py"))
    out = tmp_path / "seg.png"
    module["main"](["--quick", "--out", str(out)])
    assert out.is_file() and out.stat().st_size > 1000
