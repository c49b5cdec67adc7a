"""Every Python block of README.md and the docs pages runs as written and prints what it says.

Each ```python block of README.md and of every page under docs/ (a block that includes a file
with pymdownx.snippets, ``--8<-- "path"``, runs that file: docs/examples.md shows the example
scripts so) runs on its own, as a reader would paste it, in a fresh interpreter
(``tests/_docs_runner.py``, in an empty working directory, under :data:`BLOCK_SECONDS`): its own
imports, its own model and data, nothing from the block before it. Nothing is skipped; an
exemption would be an entry of :data:`EXEMPT`, with its reason.

What a block prints is checked two ways:

* a ``print(...)  # text`` line is a claim: that very ``print`` call must run and print
  ``text`` (its first line when it prints several); a claimed ``print`` that never runs fails;
* a block followed by a paragraph ending in "prints:" and a ```text block shows its output:
  the block prints that text, line for line, its numbers with a decimal point to within one
  unit of their last printed digit (the last digit of a float may round the other way on
  another CPU), every other character exactly.

The example scripts print lines the docs rely on (:data:`EXAMPLE_PRINTS`).
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import runpy
import subprocess
import sys
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "_docs_runner.py"
#: the pages whose Python blocks are run
PAGES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")),
]
#: the longest a block may take (2 CPU cores; the slowest takes a few seconds)
BLOCK_SECONDS = 60
#: pages whose blocks run in the fast tier (the others are slow: each block is a fresh process)
FAST_PAGES = {"README.md", "docs/index.md"}
#: blocks that are not run, by id, each with its reason (none today: every block runs)
EXEMPT: dict[str, str] = {}
#: the environment a block runs in, beyond the test's, by id, each with its reason
BLOCK_ENV: dict[str, tuple[dict[str, str], str]] = {
    "docs/examples.md:examples/subnet_laplace_segmentation.py": (
        {"MULTISCALE_JAC_QUICK": "1"},
        "the script's documented quick run (--quick: the same code on smaller images and 200 "
        "weights, a few seconds; what it runs under CI=true anyway): its full run takes "
        "50 to 90 s on 2 cores, over BLOCK_SECONDS",
    ),
}

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_INCLUDE = re.compile(r'^\s*--8<--\s+"(?P<path>[^"]+)"\s*$')


@dataclass(frozen=True)
class Block:
    """A ```python block of a page: where it is, its code (includes expanded), the output the
    page shows for it (or None) and the file it includes whole (or None)."""

    page: str
    line: int
    code: str
    shown: str | None
    included: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.included or self.line}"

    @property
    def label(self) -> str:
        """The name the block's code runs under (tracebacks, the runner's print record)."""
        return str(ROOT / self.included) if self.included else f"{self.page}:{self.line}"


def _fenced(text: str) -> list[tuple[int, int, str, list[str]]]:
    """(first line, line after the block, language, lines dedented) of every fenced block."""
    lines, found, k = text.splitlines(), [], 0
    while k < len(lines):
        fence = _FENCE.match(lines[k])
        if not fence:
            k += 1
            continue
        indent, start = len(fence["indent"]), k
        k += 1
        body = []
        while k < len(lines) and lines[k].strip() != "```":
            body.append(lines[k][indent:])
            k += 1
        found.append((start + 1, k + 1, fence["lang"], body))
        k += 1
    return found


def _shown_after(
    lines: list[str], end: int, fences: dict[int, tuple[str, list[str]]]
) -> str | None:
    """The ```text block that a paragraph ending in "prints:" introduces right after line
    ``end`` (1-based, the block's closing fence), or None."""
    k = end
    while k < len(lines) and not lines[k].strip():
        k += 1
    para = []
    while k < len(lines) and lines[k].strip() and not _FENCE.match(lines[k]):
        para.append(lines[k].strip())
        k += 1
    if not para or not " ".join(para).endswith("prints:"):
        return None
    while k < len(lines) and not lines[k].strip():
        k += 1
    lang, body = fences.get(k + 1, ("", []))
    return "\n".join(body) + "\n" if lang == "text" else None


def page_blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text(encoding="utf-8")
    lines = text.splitlines()
    fenced = _fenced(text)
    by_line = {start: (lang, body) for start, _, lang, body in fenced}
    blocks = []
    for start, end, lang, body in fenced:
        if lang != "python":
            continue
        included = [m["path"] for m in map(_INCLUDE.match, body) if m]
        code = "\n".join(
            (ROOT / m["path"]).read_text(encoding="utf-8") if (m := _INCLUDE.match(line)) else line
            for line in body
        )
        whole = (
            included[0] if len(included) == 1 and len([b for b in body if b.strip()]) == 1 else None
        )
        blocks.append(Block(page, start, code + "\n", _shown_after(lines, end, by_line), whole))
    return blocks


BLOCKS = [block for page in PAGES for block in page_blocks(page)]


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


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def same_output(got: str, shown: str) -> bool:
    """``got`` is the ``shown`` text: the same characters outside numbers, the same numbers,
    those with a decimal point (no exponent) to within one unit of their last digit."""

    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip("\n").splitlines()]

    got_text, shown_text = "\n".join(lines(got)), "\n".join(lines(shown))
    if _NUMBER.split(got_text) != _NUMBER.split(shown_text):
        return False
    pairs = list(zip(_NUMBER.findall(got_text), _NUMBER.findall(shown_text)))
    for a, b in pairs:
        if a == b:
            continue
        if "." not in b or "e" in b or "." not in a:
            return False
        unit = 10.0 ** -len(b.split(".")[1])
        if abs(float(a) - float(b)) > 1.001 * unit:
            return False
    return True


@pytest.fixture(scope="module")
def block_env() -> dict[str, str]:
    """The environment of the blocks: the test's (the machine's calibration is the one a user
    of this machine gets: measured by the first block that needs it, then kept in its file),
    one thread unless OMP_NUM_THREADS says otherwise (two cores are shared with other work), and
    without the variable pytest sets while a test runs."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _param(block: Block):
    marks = [] if block.page in FAST_PAGES else [pytest.mark.slow]
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_block_runs_as_written_and_prints_what_the_page_says(
    block: Block, block_env: dict[str, str], tmp_path: Path
) -> None:
    if block.id in EXEMPT:
        pytest.skip(EXEMPT[block.id])
    code, record = tmp_path / "block.py", tmp_path / "printed.json"
    code.write_text(block.code, encoding="utf-8")
    env = {**block_env, **BLOCK_ENV.get(block.id, ({}, ""))[0]}
    work = tmp_path / "cwd"
    work.mkdir()
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(RUNNER), str(code), block.label, str(record)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_SECONDS,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id} ran past {BLOCK_SECONDS} s")
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    printed = {int(k): v for k, v in json.loads(record.read_text()).items()}
    if not block.included:
        for number, claim in _claims(block.code).items():
            calls = printed.get(number)
            assert calls, f"{block.id} line {number}: this print never ran; the page says {claim!r}"
            lines = calls[0].strip().splitlines()
            got = lines[0].strip() if lines else ""
            assert got == claim, (
                f"{block.id} line {number}: printed {got!r}, the page says {claim!r}"
            )
    if block.shown is not None:
        assert same_output(done.stdout, block.shown), (
            f"{block.id} printed\n{done.stdout}\nthe page shows\n{block.shown}"
        )
    if block.included in EXAMPLES:
        check_example_output(Path(block.included).name, done.stdout)
    print(f"{block.id}: {seconds:.1f} s")


def test_blocks_are_found_and_exemptions_name_blocks() -> None:
    ids = [b.id for b in BLOCKS]
    assert len(ids) == len(set(ids))
    assert set(EXEMPT) | set(BLOCK_ENV) <= set(ids)
    assert all(why for why in EXEMPT.values()) and all(why for _, why in BLOCK_ENV.values())
    per_page = {page: sum(b.page == page for b in BLOCKS) for page in PAGES}
    assert per_page["README.md"] >= 1 and per_page["docs/laplace.md"] >= 4, per_page
    # the guides and the testing page show what their blocks print
    shown = {b.page for b in BLOCKS if b.shown is not None}
    assert {
        "docs/guide-ewc.md",
        "docs/guide-jacobian-regularisation.md",
        "docs/guide-subnet-laplace.md",
        "docs/testing.md",
    } <= shown, shown


@pytest.mark.parametrize("page", PAGES)
def test_output_a_page_shows_is_printed_by_the_block_before_it(page: str) -> None:
    """A ```text block that a paragraph ending in "prints:" introduces comes right after the
    Python block that prints it (and so is checked above), and no block is fenced without its
    language."""
    text = (ROOT / page).read_text(encoding="utf-8")
    lines = text.splitlines()
    fenced = _fenced(text)
    by_line = {start: (lang, body) for start, _, lang, body in fenced}
    attached = {b.shown for b in page_blocks(page) if b.shown is not None}
    for start, end, lang, _ in fenced:
        assert lang, f"{page} line {start}: a block without its language (python, bash, text)"
        shown = _shown_after(lines, end, by_line)
        if shown is not None and lang != "python":
            pytest.fail(f"{page} line {start}: output is shown after a {lang} block")
    for start, _, lang, body in fenced:
        if lang != "text":
            continue
        k = start - 2
        while k >= 0 and lines[k].strip():
            k -= 1
        intro = " ".join(line.strip() for line in lines[k + 1 : start - 1])
        if intro.endswith("prints:"):
            assert "\n".join(body) + "\n" in attached, (
                f"{page} line {start}: shown output that no Python block right before it prints"
            )


def test_same_output_compares_numbers_to_their_last_digit() -> None:
    assert same_output("loss 0.730, S 92.38\n", "loss 0.729, S 92.38")
    assert not same_output("loss 0.731, S 92.38", "loss 0.729, S 92.38")
    assert not same_output("row 3 of 4", "row 2 of 4")
    assert not same_output("loss 0.729 S 92.38", "loss 0.729, S 92.38")
    assert same_output("a\n  b  \n", "a\n  b")


# ------------------------------------------------------------------ README
def test_readme_is_short_and_opens_with_an_example() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 100, f"README.md has {len(lines)} lines"
    first = next(k for k, line in enumerate(lines, 1) if line.startswith("```python"))
    assert first <= 40, f"README.md's first Python block starts at line {first}"


def _commands(text: str) -> list[str]:
    """The shell commands of a script's lines: comments and pipes into ``tee``/``tail``
    dropped, ``&&`` chains split, the CI venv (``"$venv"``) written as README's ``.venv``."""
    found = []
    for line in text.splitlines():
        line = re.sub(r'"\$venv(/[^"]*)?"', lambda m: ".venv" + (m[1] or ""), line)
        line = re.sub(r"\s*\|\s*(tee|tail)\b.*$", "", re.sub(r"(^|\s+)#.*$", "", line))
        found += [c.strip() for c in line.split("&&") if c.strip()]
    return found


def test_readme_commands_are_the_ones_ci_runs() -> None:
    """README's set-up and test commands are what ``.ci/run`` runs (in its own venv)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = set(_commands((ROOT / ".ci" / "run").read_text(encoding="utf-8")))
    shell = [
        c
        for _, _, lang, body in _fenced(readme)
        if lang == "bash"
        for c in _commands("\n".join(body))
    ]
    assert "python -m pytest" in shell and any(c.startswith("pip install torch==") for c in shell)
    missing = [c for c in shell if c not in ci]
    assert not missing, f"README commands .ci/run does not run: {missing}"


# ------------------------------------------------------------------ the examples
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
        (r"^(quick run: )?\d+ training and \d+ test images", 1),
        (r"^fit on \d+ images: first call ", 1),
        (r"^mean predictive entropy: \S+ nats on correct pixels, \S+ on wrong ones", 1),
    ],
}
EXAMPLES = {f"examples/{name}" for name in EXAMPLE_PRINTS}


def check_example_output(name: str, out: str) -> None:
    lines = out.splitlines()
    for pattern, count in EXAMPLE_PRINTS[name]:
        found = [line for line in lines if re.search(pattern, line)]
        assert len(found) == count, f"{name}: {len(found)} lines match {pattern!r}, not {count}"
    diffs = [re.search(r"max \|engine - loop\| = (\S+)", line) for line in lines]
    for diff in filter(None, diffs):
        assert float(diff.group(1)) < 1e-4, diff.group(0)


def test_every_example_says_what_it_prints_and_is_shown() -> None:
    names = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert names == set(EXAMPLE_PRINTS), "EXAMPLE_PRINTS lists every example, and only them"
    shown = {b.included for b in BLOCKS if b.page == "docs/examples.md"}
    assert shown == EXAMPLES, "docs/examples.md shows every example (and so runs it)"


@pytest.mark.slow
def test_subnet_laplace_example_writes_its_picture(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    module = runpy.run_path(str(ROOT / "examples" / "subnet_laplace_segmentation.py"))
    out = tmp_path / "seg.png"
    module["main"](["--quick", "--out", str(out)])
    assert out.is_file() and out.stat().st_size > 1000
