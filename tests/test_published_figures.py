"""The published benchmark figures equal the results file they name.

README.md and the docs pages (docs/**/*.md) publish measurements only inside blocks that name
their results file, ``<!-- figures: NAME from benchmarks/results/grid.json -->`` ...
``<!-- /figures -->``, which ``benchmarks/render.py`` renders from that file (units included);
``python benchmarks/render.py`` rewrites them after a run. No page states a measured figure
outside such blocks (:data:`MEASURED`: a number with a unit; :data:`RATIO`: a ratio without
one, "3.2 times faster", "12-fold", "a speed-up of 40", "about twice as fast"), read as the site
shows it (:func:`passages`): the files it includes with ``--8<--`` are part of the page
(:func:`expand_snippets`, as pymdownx.snippets resolves them) and quoted output in fenced blocks
is read too, except the output tests/test_docs.py checks by running the block before it
(:func:`verified_outputs`). The figures that look like measurements but are settings of the
library or sizes are listed, each with its reason (:data:`NOT_MEASURED`), and the report page
is rendered whole from its own results file (:data:`RENDERED_WHOLE`).

One measurement is stated with one value (:func:`stated_twice`): a block name is rendered from
one results file on every page, and every value a block (or a page rendered whole) reads from a
results file is a measurement, identified by the benchmark the file records and its JSON path;
two blocks that read one measurement with different values (two runs) fail."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import test_docs as docs_test  # tests/ is on sys.path (conftest.py): the docs' block runner

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_render", ROOT / "benchmarks" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)

#: a number or a range of them with the unit of a measurement (time, memory, a ratio,
#: training steps); a comma only as a thousands separator (``torch.ones(2, x.shape[-1])`` is
#: no figure)
_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
MEASURED = re.compile(
    rf"(?<![\w.=/-]){_NUMBER}(?:-{_NUMBER})?\s?(?:x\b|\u00d7|s\b|ms\b|µs|MiB|GiB|KiB|TiB|MB\b|GB\b|"
    r"KB\b|TB\b|(?:milli)?seconds?\b|minutes?\b|hours?\b|(?:training )?steps?\b|%|per ?cent\b)"
)
#: how many, in digits (a range too) or in words
_WORD = (
    r"(?:two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|fifteen|twenty|thirty|"
    r"forty|fifty|hundred|thousand)"
)
_HOW_MANY = rf"(?:{_NUMBER}(?:-{_NUMBER})?|{_WORD}|a hundred|a thousand)"
_ROUGHLY = r"(?:(?:about|around|roughly|nearly|almost|over|under|up to|at least|at most|some)\s+)?"
#: a ratio without a unit: "3.2 times faster", "12-fold", "three times", "twofold", "a speed-up
#: of 40", "a 40x speed-up", "about twice as fast", "half the time", "halves the memory", "in
#: half", "an order of magnitude" (N x, N% faster: :data:`MEASURED`)
RATIO = re.compile(
    r"(?i:"
    rf"(?<![\w.=/-]){_HOW_MANY}[\s-]?(?:times|fold)\b"
    rf"|\b{_WORD}fold\b"
    rf"|\b(?:speed-?ups?|slow-?downs?|factor|gain)\s+of\s+{_ROUGHLY}{_HOW_MANY}(?![\w.])"
    rf"|(?<![\w.=/-]){_NUMBER}\s?(?:x|\u00d7)?[\s-]?(?:speed-?ups?|slow-?downs?)\b"
    r"|\b(?:twice|thrice|half)\s+(?:as\s+\w+|the\s+(?:time|memory|speed|cost|work|runtime))\b"
    r"|\bin\s+half(?![\w-])"
    r"|\b(?:doubles?|doubled|doubling|halves|halved|halving|triples?|tripled)\s+(?:the\s+|its\s+)?"
    r"(?:time|speed|memory|cost|throughput|runtime|work)\b"
    r"|\borders?\s+of\s+magnitude\b"
    r")"
)


def figures_in(texts: Iterable[str]) -> list[str]:
    """Every figure :data:`MEASURED` or :data:`RATIO` finds in ``texts``, in order."""
    found = []
    for text in texts:
        matches = sorted(
            (m.start(), -m.end(), m[0])
            for pattern in (MEASURED, RATIO)
            for m in pattern.finditer(text)
        )
        end = -1
        for start, minus_end, figure in matches:  # overlapping finds: the first (longest) once
            if start >= end:
                found.append(figure)
                end = -minus_end
    return found


def _blocks(page: Path) -> list[str]:
    return [m["name"] for m in render.BLOCK.finditer(page.read_text())]


def test_every_block_equals_what_its_results_file_renders() -> None:
    assert render.stale_blocks(ROOT) == []


def test_the_benchmark_page_is_blocks_and_the_readme_has_none() -> None:
    """Every measured figure is on the site, stated once: README.md links to it."""
    assert _blocks(ROOT / "README.md") == []
    published = set(_blocks(ROOT / "docs" / "benchmarks.md"))
    assert {"runs", "main", "choice", "batch-fisher", "batch-jacnorm"} <= published
    assert {"dense", "laplace-torch", "first-call"} <= published


def test_a_changed_figure_fails(tmp_path: Path) -> None:
    """Change one figure of the EWC guide's sentence (in a copy): the check names the block."""
    for rel in ("README.md", "docs/guide-ewc.md", "benchmarks/results/grid.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    page = tmp_path / "docs" / "guide-ewc.md"
    text = page.read_text()
    (body,) = [m["body"] for m in render.BLOCK.finditer(text) if m["name"] == "guide-fisher"]
    digit = re.search(r"\d", body)
    changed = body[: digit.start()] + str((int(digit[0]) + 1) % 10) + body[digit.end() :]
    page.write_text(text.replace(body, changed))
    assert render.stale_blocks(tmp_path) == [
        "docs/guide-ewc.md: guide-fisher from benchmarks/results/grid.json"
    ]
    render.update_pages(tmp_path)
    assert render.stale_blocks(tmp_path) == []


# ---------------------------------------------------------------------- a page as the site shows it
class SnippetMissing(Exception):
    """A ``--8<--`` include that pymdownx.snippets (``check_paths: true``) fails the build on."""


def snippets_config(root: Path = ROOT) -> dict[str, Any] | None:
    """pymdownx.snippets' options in ``root/mkdocs.yml`` over the extension's defaults, or None
    where the site does not use the extension (an include line is then text). The file is read
    without a YAML library (one need not be installed): the options are ``key: value`` lines
    indented under ``- pymdownx.snippets:``, each value JSON or a bare word."""
    config: dict[str, Any] = {
        "base_path": ["."],
        "restrict_base_path": True,
        "check_paths": False,
        "dedent_subsections": False,
    }
    lines = (root / "mkdocs.yml").read_text(encoding="utf-8").splitlines()
    at = [
        k
        for k, line in enumerate(lines)
        if line.strip() in ("- pymdownx.snippets", "- pymdownx.snippets:")
    ]
    if not at:
        return None
    indent = len(lines[at[0]]) - len(lines[at[0]].lstrip())
    for line in lines[at[0] + 1 :]:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if len(line) - len(line.lstrip()) <= indent:
            break
        key, _, value = line.strip().partition(":")
        value = value.split(" #")[0].strip()
        try:
            config[key] = json.loads(value)
        except json.JSONDecodeError:
            config[key] = value.strip("'\"")
    if isinstance(config["base_path"], str):
        config["base_path"] = [config["base_path"]]
    return config


# pymdownx.snippets' notation (its RE_ALL_SNIPPETS, RE_SNIPPET_SECTION and RE_SNIPPET_FILE)
_SNIPPET = re.compile(
    r"""^(?P<space>[ \t]*)(?P<escape>;*)(?P<all>(?P<inline_marker>-+8<-+[ \t]+)"""
    r"""(?P<snippet>(?:"(?:\\"|[^"\n\r])+?"|'(?:\\'|[^'\n\r])+?'))(?![ \t])|"""
    r"""(?P<block_marker>-+8<-+)(?![ \t]))\r?$"""
)
_SECTION = re.compile(
    r"(?i)^(?P<pre>.*?)(?<!;)(?!(?<=-)-)(?P<escape>;*)(?P<inline_marker>-+8<-+[ \t]+)"
    r"(?P<section>\[[ \t]*(?P<type>start|end)[ \t]*:[ \t]*(?P<name>[a-z][-_0-9a-z]*)[ \t]*\])"
    r"(?P<post>.*?)$"
)
_SNIPPET_FILE = re.compile(
    r"(?i)(.*?)(?:((?::-?[0-9]*){1,2}(?:(?:,(?=[-0-9:])-?[0-9]*)(?::-?[0-9]*)?)*)|"
    r"(:[a-z][-_0-9a-z]*))?$"
)


def _unescaped_section(m: re.Match[str]) -> str:
    return (
        m["pre"] + m["escape"].replace(";", "", 1) + m["inline_marker"] + m["section"] + m["post"]
    )


def _select(lines: list[str], ranges: str | None, section: str | None, config: dict) -> list[str]:
    """The lines a snippet's ``:start:end`` ranges or ``:section`` name select."""
    if not lines or not (ranges or section):
        return lines
    picked: list[str] = []
    if ranges:
        total = len(lines)
        for span in ranges[1:].split(","):
            ends = span.split(":")
            start = int(ends[0]) if ends[0] else None
            start = start if start is None or start < 0 else max(0, start - 1)
            end = int(ends[1]) if len(ends) > 1 and ends[1] else None
            if start and start < 0:
                start = min(max(total + start, 0), total)
            if end and end < 0:
                end = min(max(total + 1 + end, 0), total)
            picked += lines[start:end]
    else:
        inside = found = False
        for line in lines:
            m = _SECTION.match(line) if "8<-" in line else None
            if m and m["escape"]:
                line = _unescaped_section(m)
            elif m and m["name"] == section[1:]:
                if m["type"] == "start":
                    inside = found = True
                    continue
                break
            elif m and inside:
                continue
            if inside:
                picked.append(line)
        if not found and config["check_paths"]:
            raise SnippetMissing(f"snippet section {section[1:]!r} not found")
    return (
        textwrap.dedent("\n".join(picked)).split("\n") if config["dedent_subsections"] else picked
    )


def expand_snippets(text: str, root: Path = ROOT) -> str:
    """``text`` with its ``--8<--`` includes replaced by what they include, as the site's
    pymdownx.snippets does it (mkdocs.yml's options; mkdocs builds from the root): each base
    path in turn, the file under it (a base path that is a file: that file only), line ranges
    and sections, includes inside included files, an escaped ``;--8<--`` kept as text, a
    missing file an error where ``check_paths`` is on. Downloads (URLs) are not read: an error.
    :func:`test_includes_are_expanded_as_pymdownx_snippets_does` checks it against the extension."""
    config = snippets_config(root)
    if config is None:
        return text
    bases = [os.path.abspath(root / b) for b in config["base_path"]]
    bases = [b for b in bases if os.path.exists(b)]

    def find(path: str) -> str | None:
        for base in bases:
            if os.path.isdir(base):
                name = os.path.abspath(os.path.join(base, path))
                if config["restrict_base_path"] and not name.startswith(
                    base.rstrip(os.sep) + os.sep
                ):
                    continue
                if os.path.exists(name):
                    return name
            else:
                name = os.path.join(os.path.dirname(base), path)
                if os.path.exists(name) and os.path.samefile(name, base):
                    return name
        return None

    def expand(lines: list[str], seen: frozenset[str], in_section: bool) -> list[str]:
        out, block = [], False
        for line in lines:
            m = _SNIPPET.match(line)
            if m and m["escape"]:
                out.append(line.replace(";", "", 1))
                continue
            if m and not m["inline_marker"]:
                block = not block
                continue
            if m and block:  # an inline include right under a block one is dropped
                continue
            if not m and not block:
                s = _SECTION.match(line) if "8<-" in line and not in_section else None
                if s and s["escape"]:
                    line, s = _unescaped_section(s), None
                if s is None:
                    out.append(line)
                continue
            if m:
                space, path = m["space"], m["snippet"][1:-1].strip()
            else:
                space, path = re.match(r"^([ \t]*)(.*?)\r?$", line).groups()
                path = path.strip()
                if not path:
                    out.append("")
                    continue
            if path.startswith(";"):
                continue
            name, ranges, section = _SNIPPET_FILE.match(path).groups()
            found = find(name.strip()) if name.strip() else None
            if found is None:
                if config["check_paths"]:
                    raise SnippetMissing(f"snippet {path!r} not found under {config['base_path']}")
                continue
            if found in seen:
                continue
            content = Path(found).read_text(encoding="utf-8")
            picked = _select(content.split("\n") if content else [], ranges, section, config)
            space = space.expandtabs(4)
            out += [space + x for x in expand(picked, seen | {found}, section is not None)]
        return out

    return "\n".join(expand(text.split("\n"), frozenset(), False))


def _python_block_id(page: str, start: int, body: list[str]) -> str:
    """tests/test_docs.py's id of the ```python block opening at line ``start``."""
    included = [m["path"] for m in map(docs_test._INCLUDE.match, body) if m]
    whole = len(included) == 1 and len([b for b in body if b.strip()]) == 1
    return f"{page}:{included[0] if whole else start}"


def verified_outputs(page: str, text: str) -> list[tuple[int, int]]:
    """(opening line, closing line) of each ```text block of ``text`` (the page ``page``) that
    tests/test_docs.py compares with what the ```python block before it prints: one that a
    paragraph ending in "prints:" introduces right after a block it runs (not in its EXEMPT).
    Output that a run produces and a test compares is not quoted from a measurement; every
    other fenced line is read."""
    lines = text.splitlines()
    fenced = docs_test._fenced(text)
    by_line = {start: (lang, body) for start, _, lang, body in fenced}
    spans = {start: (start, end) for start, end, _, _ in fenced}
    verified = []
    for start, end, lang, body in fenced:
        if lang != "python" or _python_block_id(page, start, body) in docs_test.EXEMPT:
            continue
        if docs_test._shown_after(lines, end, by_line) is not None:
            # the shown block is the first fenced block after this one (a paragraph between)
            verified.append(spans[min(s for s in spans if s > end)])
    return verified


#: what stands where a rendered block or a fenced block was cut out of the prose (so that the
#: text on either side does not join into a figure)
_CUT = " ¶ "


def passages(page: str, root: Path = ROOT) -> list[str]:
    """What ``page`` states outside its rendered blocks, as the site shows it: its prose (the
    files it includes with ``--8<--`` expanded, whitespace collapsed) and each line of each
    fenced block (included files' lines too), except the blocks of output that
    tests/test_docs.py checks by running the code (:func:`verified_outputs`). Blocks of the
    page itself are cut out; a block in an included file is not checked by
    ``render.stale_blocks``, so it is read."""
    text = (root / page).read_text(encoding="utf-8")
    lines = text.splitlines()
    for start, end in verified_outputs(page, text):
        lines[start : end - 1] = [""] * (end - 1 - start)
    text = render.BLOCK.sub(_CUT, "\n".join(lines) + "\n")
    lines = expand_snippets(text, root).splitlines()
    prose, fenced = list(lines), []
    for start, end, _, body in docs_test._fenced("\n".join(lines)):
        fenced += [" ".join(line.split()) for line in body if line.strip()]
        prose[start - 1 : end] = [_CUT] * (end - start + 1)
    return [" ".join("\n".join(prose).split()), *fenced]


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

#: figures MEASURED or RATIO finds that are not measurements: page -> {the exact phrase
#: (whitespace collapsed): (why it may stand, a check that the setting it states is the
#: library's, or None)}. Each phrase must still be on its page, so the list does not go stale.
NOT_MEASURED: dict[str, dict[str, tuple[str, Callable[[], bool] | None]]] = {
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
        "no route holding more than `GROWTH` = 4 times the first route's working set": _GROWTH,
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
        "up to 512 MiB (half of 1 GiB;": (
            "the GP Laplace's default bytes of its context's Jacobians (a setting)",
            _setting("_memory", "GP_CONTEXT_BYTES", 1024 * MIB),
        ),
    },
}


def test_every_page_is_scanned() -> None:
    assert {"README.md", "docs/benchmarks.md", "docs/design.md"} <= set(PAGES)
    assert set(NOT_MEASURED) | set(RENDERED_WHOLE) <= set(PAGES)
    assert any(p.startswith("docs/api/") for p in PAGES)


def figures_outside_blocks(page: str, root: Path = ROOT, allowed: Iterable[str] = ()) -> list[str]:
    """The figures ``page`` states outside its rendered blocks (:func:`passages`), the
    ``allowed`` phrases taken out first."""
    texts = passages(page, root)
    for phrase in allowed:
        texts = [text.replace(phrase, _CUT) for text in texts]
    return figures_in(texts)


@pytest.mark.parametrize("page", [p for p in PAGES if p not in RENDERED_WHOLE])
def test_measured_figures_stand_only_in_blocks(page: str) -> None:
    texts = passages(page)
    for phrase in NOT_MEASURED.get(page, {}):
        assert any(phrase in text for text in texts), (
            f"{page}: the listed phrase {phrase!r} is gone: drop it"
        )
    found = figures_outside_blocks(page, allowed=NOT_MEASURED.get(page, {}))
    assert found == [], f"{page} states figures outside the rendered blocks: {found}"


@pytest.mark.parametrize(("page", "phrase"), [(p, f) for p, fs in NOT_MEASURED.items() for f in fs])
def test_listed_figures_are_the_settings_they_name(page: str, phrase: str) -> None:
    why, check = NOT_MEASURED[page][phrase]
    assert why
    if check is not None:
        assert check(), f"{page}: {phrase!r} no longer states the library's setting ({why})"


# ---------------------------------------------------------------------- one measurement, one value
#: the pages rendered whole: page -> (its results file, what renders it from that file)
RENDERED_FROM: dict[str, tuple[str, Callable[[Any], str]]] = {
    "docs/report/report.md": ("docs/report/results.json", render.report_text),
}


def _item(index: int, item: object) -> str:
    """A list item's name in a JSON path: a cell by its family and name, a run by its id, a
    row by its method; else its place."""
    if isinstance(item, dict) and "name" in item:
        return f"[{item['family']}:{item['name']}]" if "family" in item else f"[{item['name']}]"
    for key in ("id", "method", "row"):
        if isinstance(item, dict) and key in item:
            return f"[{key}={item[key]}]"
    return f"[{index}]"


def _recorded(value: object, path: str, log: dict[str, object]) -> object:
    if isinstance(value, dict):
        return _ReadDict(value, path, log)
    if isinstance(value, list):
        return _ReadList(value, path, log)
    return value


class _ReadDict(Mapping):
    """A results file's object that notes, in ``log``, every value read from it by its path."""

    def __init__(self, data: dict, path: str, log: dict[str, object]) -> None:
        self._data = {k: _recorded(v, f"{path}.{k}" if path else k, log) for k, v in data.items()}
        self._path, self._log = path, log

    def __getitem__(self, key: str) -> object:
        value = self._data[key]
        if not isinstance(value, (_ReadDict, _ReadList)):
            self._log[f"{self._path}.{key}" if self._path else key] = value
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class _ReadList(Sequence):
    """A results file's list that notes every value read from it (as :class:`_ReadDict`)."""

    def __init__(self, data: list, path: str, log: dict[str, object]) -> None:
        self._names = [path + _item(k, v) for k, v in enumerate(data)]
        self._data = [_recorded(v, name, log) for v, name in zip(data, self._names)]
        self._log = log

    def __getitem__(self, index: int | slice) -> object:
        if isinstance(index, slice):
            return [self[k] for k in range(len(self))[index]]
        value = self._data[index]
        if not isinstance(value, (_ReadDict, _ReadList)):
            self._log[self._names[index]] = value
        return value

    def __len__(self) -> int:
        return len(self._data)


def measurements_read(render_fn: Callable[[Any], str], results: dict) -> tuple[str, dict]:
    """What ``render_fn`` renders from ``results`` and every value it reads, by JSON path."""
    log: dict[str, object] = {}
    return render_fn(_recorded(results, "", log)), log


def _benchmark(path: str, results: dict) -> str:
    """What a results file measured: the benchmark it names (the grid and the report it
    writes both say ``bench_peers``), else its file name."""
    name = results.get("benchmark")
    return name if isinstance(name, str) else Path(path).name


def stated_twice(root: Path = ROOT) -> list[str]:
    """One measurement stated twice with different values: a block name rendered from two
    results files (two runs of the figures it states), or one measurement (the benchmark its
    file names, the JSON path of the value) read with two values by the blocks and the pages
    rendered whole (the report's copy of the grid from another run than the benchmark page's)."""
    found, files = [], {}
    read: dict[tuple[str, str], dict[str, list[str]]] = {}
    sources = []
    for page in render.pages(root):
        rel = page.relative_to(root).as_posix()
        for m in render.BLOCK.finditer(page.read_text(encoding="utf-8")):
            where = f"{rel}: {m['name']} from {m['path']}"
            files.setdefault(m["name"], {}).setdefault(m["path"], []).append(where)
            if m["name"] in render.FIGURES and (root / m["path"]).exists():
                sources.append((where, m["path"], render.FIGURES[m["name"]]))
        if rel in RENDERED_FROM and (root / RENDERED_FROM[rel][0]).exists():
            path, fn = RENDERED_FROM[rel]
            sources.append((f"{rel} (rendered whole from {path})", path, fn))
    for name, paths in files.items():
        if len(paths) > 1:
            found.append(f"block {name} is rendered from {len(paths)} results files: {paths}")
    cache: dict[str, dict] = {}
    for where, path, fn in sources:
        if path not in cache:
            cache[path] = json.loads((root / path).read_text())
        try:
            _, log = measurements_read(fn, cache[path])
        except (KeyError, TypeError, ValueError, StopIteration):
            continue  # a block that cannot render from its file: render.stale_blocks names it
        for key, value in log.items():
            values = read.setdefault((_benchmark(path, cache[path]), key), {})
            values.setdefault(json.dumps(value), []).append(where)
    for (bench, key), values in read.items():
        if len(values) > 1:
            stated = "; ".join(f"{v} in {', '.join(dict.fromkeys(w))}" for v, w in values.items())
            found.append(f"{bench} {key}: {stated}")
    return found


def test_the_report_page_is_what_its_results_file_renders() -> None:
    report = ROOT / "docs" / "report"
    results = json.loads((report / "results.json").read_text())
    images = [Path(p.name) for p in sorted(report.glob("grid_*.png"))]
    assert (report / "report.md").read_text() == render.report_text(results, images)


def test_the_pages_that_cite_measurements_carry_their_blocks() -> None:
    for page, names in {
        "docs/guide-ewc.md": {"guide-fisher"},
        "docs/guide-jacobian-regularisation.md": {"guide-jacnorm"},
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


# ---------------------------------------------------------------------- the reading's checks
def test_no_measurement_is_stated_with_two_values() -> None:
    assert stated_twice(ROOT) == []


def test_the_recorded_reads_render_what_the_pages_state() -> None:
    """The values :func:`stated_twice` compares are the ones the blocks render from: through
    the recording wrapper every block and the report render as from the plain file."""
    for page in render.pages(ROOT):
        for m in render.BLOCK.finditer(page.read_text(encoding="utf-8")):
            results = json.loads((ROOT / m["path"]).read_text())
            text, log = measurements_read(render.FIGURES[m["name"]], results)
            assert text == render.FIGURES[m["name"]](results) and log, m["name"]
    for path, fn in RENDERED_FROM.values():
        results = json.loads((ROOT / path).read_text())
        assert measurements_read(fn, results)[0] == fn(results)


def test_the_output_left_unread_is_what_test_docs_checks() -> None:
    """The fenced blocks :func:`passages` does not read are the shown outputs tests/test_docs.py
    compares with what the block before them prints, on every page: no more, no fewer."""
    left = 0
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        lines = text.splitlines()
        unread = ["\n".join(lines[a : b - 1]) + "\n" for a, b in verified_outputs(page, text)]
        checked = [
            b.shown
            for b in docs_test.page_blocks(page)
            if b.shown is not None and b.id not in docs_test.EXEMPT
        ]
        assert unread == checked, page
        left += len(unread)
    assert left >= 4


def test_the_snippets_options_are_mkdocs_yml_s() -> None:
    yaml = pytest.importorskip("yaml")
    config = snippets_config(ROOT)
    assert config is not None
    extensions = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["markdown_extensions"]
    (given,) = [e["pymdownx.snippets"] for e in extensions if "pymdownx.snippets" in e]
    assert given and all(config[key] == value for key, value in given.items())


def _snippet_fixture(root: Path) -> str:
    """A page with every include form the site's extension reads (in ``root``)."""
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    (root / "snips").mkdir()
    (root / "snips" / "a.md").write_text(
        'first\n--8<-- [start:part]\nin the part\n--8<-- [end:part]\nlast\n\t--8<-- "snips/b.md"\n'
    )
    (root / "snips" / "b.md").write_text('nested\n;--8<-- "not/included.md"\n--8<-- "snips/a.md"\n')
    (root / "snips" / "c.py").write_text("".join(f"line {k}\n" for k in range(1, 8)))
    return (
        'Text\n\n--8<-- "snips/a.md"\n\n```python\n    --8<-- "snips/c.py:2:3,-2:"\n```\n\n'
        '--8<-- "snips/a.md:part"\n\n--8<--\nsnips/b.md\n\n;skipped.md\nsnips/c.py\n--8<--\n'
        ';--8<-- "escaped.md"\n'
    )


def test_includes_are_expanded_as_pymdownx_snippets_does(tmp_path: Path) -> None:
    """:func:`expand_snippets` gives what the site's pymdownx.snippets gives (mkdocs.yml's
    options), on every page and on a page with every form of include."""
    pytest.importorskip("pymdownx.snippets")
    import markdown

    def site(text: str, root: Path) -> str:
        config = snippets_config(root)
        config = {**config, "base_path": [str(root / b) for b in config["base_path"]]}
        md = markdown.Markdown(
            extensions=["pymdownx.snippets"], extension_configs={"pymdownx.snippets": config}
        )
        return "\n".join(md.preprocessors["snippet"].run(text.split("\n")))

    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        assert expand_snippets(text, ROOT) == site(text, ROOT), page
    assert "seed_convblock" in expand_snippets((ROOT / "docs" / "examples.md").read_text())
    text = _snippet_fixture(tmp_path)
    expanded = expand_snippets(text, tmp_path)
    assert expanded == site(text, tmp_path)
    assert "```python\n    line 2\n    line 3\n    line 7\n" in expanded  # the file ends in "\n"
    assert "\n\nin the part\n\n" in expanded and '\n--8<-- "escaped.md"\n' in expanded
    assert '    nested\n    --8<-- "not/included.md"\n' in expanded


# ---------------------------------------------------------------------- the checks can fail
def _root(tmp_path: Path, pages: dict[str, str], *copied: str) -> Path:
    for rel in ("mkdocs.yml", *copied):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    for rel, text in pages.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


#: sentences with a ratio and no unit, each with the figure the check names
RATIOS = {
    "The engine is 3.2 times faster than the loop.": "3.2 times",
    "Packing is 12-fold cheaper.": "12-fold",
    "We measured a speed-up of 40 on the FPN.": "speed-up of 40",
    "A 40x speed-up on one core.": "40x speed-up",
    "Forward mode is about twice as fast here.": "twice as fast",
    "The canvas takes half the time.": "half the time",
    "It runs 20% faster.": "20%",
    "That is three times the loop.": "three times",
    "Folding cuts the rows in half.": "in half",
    "An order of magnitude below the loop.": "order of magnitude",
    "The fit halves the memory.": "halves the memory",
    "A slowdown of 1.5 on ResNet-8.": "slowdown of 1.5",
}


@pytest.mark.parametrize("page", ["README.md", "docs/guide.md", "docs/api/deep.md"])
def test_a_ratio_without_a_unit_fails(tmp_path: Path, page: str) -> None:
    """Each ratio phrasing outside a rendered block is named, on any page; inside a block
    (whose text render.stale_blocks checks) it stands."""
    prose = "\n".join(RATIOS) + "\n"
    root = _root(tmp_path, {page: "# A page\n\n" + prose})
    assert figures_outside_blocks(page, root) == list(RATIOS.values())
    block = "<!-- figures: main from benchmarks/results/grid.json -->\n" + prose
    (root / page).write_text("# A page\n\n" + block + "<!-- /figures -->\n\nNo figure here.\n")
    assert figures_outside_blocks(page, root) == []


def test_quoted_output_in_a_fence_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A figure in a fenced block is named: quoted output, a command's comment, output shown
    after a bash block; the output test_docs.py compares with what the Python block before it
    prints is not read (unless that block is exempt from running)."""
    page = "docs/output.md"
    text = (
        "# Output\n\n```text\nstep 3: warm 0.41 s, 3.2 times the loop\n```\n\n"
        "```bash\npython bench.py  # about 12 minutes\n```\n\n"
        '```python\nprint("warm", 0.41, "s")\n```\n\nIt prints:\n\n```text\nwarm 0.41 s\n```\n\n'
        "```bash\npython bench.py\n```\n\nIt prints:\n\n```text\nwarm 0.52 s\n```\n"
    )
    root = _root(tmp_path, {page: text})
    assert verified_outputs(page, text) == [(17, 19)]
    assert figures_outside_blocks(page, root) == ["0.41 s", "3.2 times", "12 minutes", "0.52 s"]
    monkeypatch.setitem(docs_test.EXEMPT, f"{page}:11", "not run")
    assert figures_outside_blocks(page, root) == [
        "0.41 s",
        "3.2 times",
        "12 minutes",
        "0.41 s",
        "0.52 s",
    ]


def test_an_included_file_is_read_as_part_of_the_page(tmp_path: Path) -> None:
    """The files a page includes with ``--8<--`` are read as the site shows them: a script's
    docstring in a fenced block and a Markdown file in the prose; the path is resolved from
    mkdocs.yml's base_path (the repository root), not the page's folder; a missing file fails
    as it fails the site's build."""
    page = "docs/included.md"
    root = _root(
        tmp_path,
        {
            page: '# Included\n\n```python\n--8<-- "examples/bench.py"\n```\n\n--8<-- "notes/fit.md"\n',
            "examples/bench.py": '"""Times the engine: 3.2 times faster than the loop."""\n',
            "notes/fit.md": "The fit took\n12 s on two cores.\n",
            "docs/notes/fit.md": "Nothing measured.\n",
        },
    )
    assert figures_outside_blocks(page, root) == ["12 s", "3.2 times"]
    (root / page).write_text('# Included\n\n--8<-- "fit.md"\n')
    with pytest.raises(SnippetMissing):
        passages(page, root)
    (root / page).write_text('# Included\n\n;--8<-- "notes/fit.md"\n')
    assert figures_outside_blocks(page, root) == []


def _rerun(root: Path, path: str, cell: str, factor: float) -> None:
    """Write the grid to ``path`` (in ``root``) as another run measured it: ``cell``'s auto
    time in training steps times ``factor``."""
    results = json.loads((ROOT / "benchmarks" / "results" / "grid.json").read_text())
    (found,) = [c for c in results["cells"] if c["family"] == "main" and c["name"] == cell]
    found["methods"]["library_auto"]["ratio_to_train_step"] *= factor
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(json.dumps(results))


def test_a_measurement_stated_twice_fails(tmp_path: Path) -> None:
    """One block name on two pages from two results files (two runs): the block and the value
    that differs are named; from one file it stands. The report's copy of the grid from
    another run than the benchmark page's blocks: the value is named."""
    grid = "benchmarks/results/grid.json"
    one = "<!-- figures: guide-fisher from {} -->\n<!-- /figures -->\n"
    pages = {"docs/a.md": one.format(grid), "docs/b.md": one.format(grid)}
    root = _root(tmp_path, pages, grid)
    render.update_pages(root)
    assert stated_twice(root) == []
    _rerun(root, "benchmarks/results/grid-rerun.json", "fisher/vgg11_bn_q", 1.1)
    (root / "docs" / "b.md").write_text(one.format("benchmarks/results/grid-rerun.json"))
    render.update_pages(root)
    assert render.stale_blocks(root) == []
    found = stated_twice(root)
    assert len(found) == 2, found
    assert found[0].startswith("block guide-fisher is rendered from 2 results files")
    key = "bench_peers cells[main:fisher/vgg11_bn_q].methods.library_auto.ratio_to_train_step"
    assert found[1].startswith(key + ": ") and "docs/a.md" in found[1] and "docs/b.md" in found[1]

    (root / "docs" / "b.md").unlink()
    _rerun(root, "docs/report/results.json", "fisher/vgg11_bn_q", 1.1)
    (root / "docs" / "report" / "report.md").write_text("# report\n")
    (root / "docs" / "a.md").write_text(one.replace("guide-fisher", "main").format(grid))
    render.update_pages(root)
    found = stated_twice(root)
    assert len(found) == 1 and found[0].startswith(key + ": "), found
    assert "docs/report/report.md (rendered whole from docs/report/results.json)" in found[0]
