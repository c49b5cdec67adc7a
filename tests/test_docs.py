"""The README's quick start and the examples run and say what they claim.

A ``print(...)  # text`` line of a docs page is a claim: that very ``print`` call must run and
print ``text`` (its first line when it prints several). A claimed ``print`` that never runs, or
prints something else, fails; so does an example that stops printing a line the docs rely on.
"""

from __future__ import annotations

import ast
import builtins
import io
import re
import runpy
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _claims(block: str) -> dict[int, str]:
    """First line (1-based, within the block) of each ``print(...)`` call whose last line
    carries a comment -> that comment, the text the call claims to print (a call wrapped over
    several lines by a formatter keeps its claim)."""
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(block).readline)
        if token.type == tokenize.COMMENT
    }
    return {
        node.lineno: comments[node.end_lineno]
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
        and node.end_lineno in comments
    }


def _run_block(block: str, where: str, namespace: dict) -> dict[int, list[str]]:
    """Run ``block`` in ``namespace``; what each ``print`` call of the block printed, by its line
    number (the text also goes to stdout, for capsys)."""
    printed: dict[int, list[str]] = {}

    def recording_print(*args, sep=" ", end="\n", file=None, flush=False):
        if file is None or file is sys.stdout:
            caller = sys._getframe(1)
            if caller.f_code.co_filename == where:
                text = io.StringIO()
                builtins.print(*args, sep=sep, end=end, file=text)
                printed.setdefault(caller.f_lineno, []).append(text.getvalue())
        builtins.print(*args, sep=sep, end=end, file=file, flush=flush)

    namespace["print"] = recording_print
    try:
        exec(compile(block, where, "exec"), namespace)
    finally:
        del namespace["print"]
    return printed


def _check_claims(block: str, where: str, printed: dict[int, list[str]]) -> int:
    """Every claimed ``print`` of ``block`` ran and printed its claim; the number of claims."""
    claims = _claims(block)
    for number, claim in claims.items():
        calls = printed.get(number)
        assert calls, f"{where} line {number}: this print never ran; the page says {claim!r}"
        lines = calls[0].strip().splitlines()
        got = lines[0].strip() if lines else ""
        assert got == claim, f"{where} line {number}: printed {got!r}, the page says {claim!r}"
    return len(claims)


@pytest.mark.slow
def test_readme_quick_start_runs(capsys) -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    exec(compile(blocks[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "torch.Size([4, 3104, 500]) vmap fwd" in out  # the comment in the README is true
    # the tensors run structured: a tuple of selected tensor names (which ones is this
    # machine's cost model's choice)
    assert re.search(r"^\((('conv\.\d\.weight',? ?)*)\)$", out, flags=re.M), out


@pytest.mark.parametrize(
    "page",
    ["packing.md", "padded.md", pytest.param("getting-started.md", marks=pytest.mark.slow)],
)
def test_docs_page_blocks_run_and_print_what_they_say(page: str) -> None:
    """The python blocks of a docs page run in order in one namespace; every
    ``print(...)  # expected`` runs and prints the expected text."""
    text = (ROOT / "docs" / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{page} has no python block"
    namespace: dict = {"__name__": "__docs__"}
    checked = 0
    for k, block in enumerate(blocks):
        where = f"{page}[block {k}]"
        checked += _check_claims(block, where, _run_block(block, where, namespace))
    assert checked, f"{page}: no `print(...)  # expected` line to check"


#: lines every example prints (a pattern, and how many printed lines match it); the docs show
#: or rely on them. An example without an entry fails: say what it prints.
EXAMPLE_PRINTS = {
    "distributed_fisher.py": [(r"^rank 0: Fisher over 101 samples, .* log marginal likelihood", 1)],
    "ewc.py": [(r"^task-A accuracy after B: \S+ without EWC, \S+ with EWC$", 1)],
    "fpn_ragged.py": [
        (r"^padding waste if everything were padded", 1),
        (r"^outputs per sample:", 1),
    ],
    "jacobian_regularisation.py": [
        (r"^lam = 0 \(no penalty; S only measured\):$", 1),
        (r"^lam = 0\.001:$", 1),
        (r"^final penalty S: ", 1),
        (r"^one training step, warm ", 1),
    ],
    "seed_convblock.py": [(r"^max \|engine - loop\| = \S+$", 2), (r"warm speed-up \S+x$", 1)],
    "subnet_laplace_segmentation.py": [
        (r"^fit on \d+ images: first call ", 1),
        (r"^mean predictive entropy: \S+ nats on correct pixels, \S+ on wrong ones", 1),
    ],
}


def test_every_example_says_what_it_prints() -> None:
    names = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert names == set(EXAMPLE_PRINTS), "EXAMPLE_PRINTS lists every example, and only them"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_example_runs(name: str, capsys) -> None:
    runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    for pattern, count in EXAMPLE_PRINTS[name]:
        found = [line for line in lines if re.search(pattern, line)]
        assert len(found) == count, f"{name}: {len(found)} lines match {pattern!r}, not {count}"
    diffs = [re.search(r"max \|engine - loop\| = (\S+)", line) for line in lines]
    for diff in filter(None, diffs):
        assert float(diff.group(1)) < 1e-4, diff.group(0)


def test_testing_page_runs_and_shows_what_it_prints(capsys) -> None:
    """docs/testing.md: the python blocks run in order in one namespace (the Hypothesis
    property test included); a block followed by "It prints:" and a text block prints exactly
    that text, and a ``print(...)  # expected`` line prints the expected text."""
    text = (ROOT / "docs" / "testing.md").read_text()
    pattern = r"```python\n(.*?)```(?:\n\nIt prints:\n\n```text\n(.*?)```)?"
    blocks = re.findall(pattern, text, flags=re.S)
    assert len(blocks) >= 4 and sum(bool(shown) for _, shown in blocks) >= 2
    namespace: dict = {"__name__": "__docs__"}
    checked = 0
    for k, (block, shown) in enumerate(blocks):
        where = f"testing.md[block {k}]"
        printed = _run_block(block, where, namespace)
        out = capsys.readouterr().out
        if shown:
            assert out.strip() == shown.strip(), (k, out)
        checked += _check_claims(block, where, printed)
    assert checked, "testing.md: no `print(...)  # expected` line to check"


@pytest.mark.slow
def test_subnet_laplace_example_writes_its_picture(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    module = runpy.run_path(str(ROOT / "examples" / "subnet_laplace_segmentation.py"))
    out = tmp_path / "seg.png"
    module["main"](["--quick", "--out", str(out)])
    assert out.is_file() and out.stat().st_size > 1000
