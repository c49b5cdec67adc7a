"""The documentation site: it builds under ``mkdocs build --strict``, every local link and anchor
in the built HTML resolves, lists render as lists, and no page carries internal project wording.

The source checks (lists, wording) run without mkdocs; the built-site checks build the site once
into a temporary folder (about 15 s, so they are marked slow) and are skipped without the docs
extra (``pip install -e ".[docs]"``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import multiscale_jac

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

#: words of the project's own bookkeeping that mean nothing to a reader of the site
FORBIDDEN = re.compile(
    r"seed thread|\bW[12]\b|\bissues?\b|\bacceptance\b|Status:|_StrEnum", flags=re.IGNORECASE
)
_LIST_ITEM = re.compile(r"^( *)([-*+]|\d+\.) \S")
_FENCE = re.compile(r"^ *(```|~~~)")

#: characters a code block of the site shows in a line at the theme's widest content column
#: (measured in Chromium; the phone layout is narrower and scrolls). Code blocks do not wrap
#: (docs/stylesheets/extra.css): a wrapped line would continue at column 0.
CODE_WIDTH = 80
#: fenced blocks that may be wider (they scroll sideways): program output and tables
_WIDE_LANGUAGES = {"text"}
#: pages whose code lines are not checked, and why
_WIDE_PAGES = {
    # shows the example scripts themselves (--8<--), formatted at the repository's 100 columns
    "examples.md": "the example scripts, included",
    # written whole by benchmarks/render.py from its results file (no code blocks today)
    "report/report.md": "written by multiscale-jac bench",
}


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a markdown page outside fenced code blocks and the options of
    ``::: name`` API blocks."""
    lines, fenced, directive = [], False, False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        directive = line.startswith(":::") or (directive and line.startswith(" "))
        if not fenced and not directive:
            lines.append((number, line))
    return lines


# ------------------------------------------------------------------ source checks (no mkdocs)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_lists_are_written_so_that_python_markdown_renders_them(page: Path) -> None:
    """Python-Markdown (what mkdocs uses) only starts a list after a blank line, and a nested
    list needs four spaces of indentation; otherwise the items run into the text before them."""
    lines = _prose_lines(page.read_text(encoding="utf-8"))
    previous = ""
    in_list = False
    problems = []
    for number, line in lines:
        item = _LIST_ITEM.match(line)
        if not line.strip():
            pass
        elif item:
            indent = len(item.group(1))
            if not in_list and previous.strip() and not previous.lstrip().startswith("|"):
                problems.append(f"line {number}: a list needs a blank line before it")
            if indent % 4:
                problems.append(f"line {number}: a nested list needs 4 spaces per level")
            in_list = True
        elif not line.startswith(" "):
            in_list = False
        previous = line
    assert not problems, f"{page.name}: " + "; ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_pages_carry_no_internal_wording(page: Path) -> None:
    found = [
        f"line {number}: {match.group(0)!r}"
        for number, line in _prose_lines(page.read_text(encoding="utf-8"))
        for match in FORBIDDEN.finditer(line)
    ]
    assert not found, f"{page.name}: " + "; ".join(found)


def test_landing_page_example_prints_what_its_comment_says(capsys) -> None:
    text = (DOCS / "index.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    code = [line for line in block.splitlines() if line.strip()]
    assert len(code) == 5, "the landing page's example is five lines of code"
    exec(compile(block, "index.md", "exec"), {"__name__": "__docs__"})
    (claim,) = re.findall(r"^print\(.*\)\s+#\s*(.+)$", block, flags=re.M)
    assert capsys.readouterr().out.strip() == claim.strip()


def _code_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, language, line) of every line inside a fenced code block."""
    found, language = [], None
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^ *(?:```|~~~)\s*([\w-]*)", line)
        if fence:
            language = (fence.group(1) or "plain") if language is None else None
        elif language is not None:
            found.append((number, language, line))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_code_lines_fit_the_code_block(page: Path) -> None:
    """No line of a page's code blocks (Python, shell) is wider than a code block shows:
    docs/.ruff.toml formats the pages' Python at that width, comments and shell lines are
    wrapped by hand."""
    name = page.relative_to(DOCS).as_posix()
    if name in _WIDE_PAGES:
        pytest.skip(_WIDE_PAGES[name])
    wide = [
        f"line {number} ({len(line)} characters, {language}): {line.strip()[:60]}"
        for number, language, line in _code_lines(page.read_text(encoding="utf-8"))
        if language not in _WIDE_LANGUAGES and len(line) > CODE_WIDTH
    ]
    assert not wide, f"{name}: code lines over {CODE_WIDTH} characters: " + "; ".join(wide)


def test_segmentation_guide_shows_the_figure_it_describes() -> None:
    """The guide describes the example's five-column picture and shows it: the committed PNG
    is the example's figure (2.5 inches a column at 100 dpi; three rows: 2.2 inches each
    and 1.9 for titles, colour bars and caption)."""
    text = (DOCS / "guide-subnet-laplace.md").read_text(encoding="utf-8")
    assert "five columns" in text
    (src,) = re.findall(r"!\[[^\]]*\]\((figures/[^)]+\.png)\)", text)
    png = (DOCS / src).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (5 * 250, 3 * 220 + 190)


def test_docs_ruff_config_formats_at_the_code_block_width() -> None:
    config = (DOCS / ".ruff.toml").read_text(encoding="utf-8")
    assert re.search(rf"^line-length = {CODE_WIDTH}$", config, flags=re.M)


# ------------------------------------------------------------------ the built site
class _Page(HTMLParser):
    """The ids, the local links and the visible text of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.text: list[str] = []  # visible text outside code, scripts and styles
        self.paragraphs: list[str] = []  # text of <p> and <li> (code left out)
        self._skip = 0
        self._para: list[list[str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        if tag == "a" and values.get("name"):
            self.ids.add(values["name"])
        for key in ("href", "src"):
            if values.get(key) and tag in ("a", "img", "script", "link"):
                self.links.append(values[key])
        if tag in ("script", "style", "code", "pre"):
            self._skip += 1
        if tag in ("p", "li"):
            self._para.append([])

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style", "code", "pre"):
            self._skip -= 1
        if tag in ("p", "li") and self._para:
            self.paragraphs.append("".join(self._para.pop()))

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        self.text.append(data)
        for para in self._para:
            para.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def pages(site: Path) -> dict[Path, _Page]:
    parsed = {}
    for path in sorted(site.rglob("*.html")):
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        parsed[path] = page
    return parsed


def _target(site: Path, page: Path, url: str) -> tuple[Path, str] | None:
    """The file and fragment a local link of ``page`` points to (None for external links)."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or url.startswith(("mailto:", "javascript:", "data:")):
        return None
    if not parts.path:
        return page, unquote(parts.fragment)
    target = (page.parent / unquote(parts.path)).resolve()
    if parts.path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, unquote(parts.fragment)


@pytest.mark.slow
def test_every_local_link_and_anchor_resolves(site: Path, pages: dict[Path, _Page]) -> None:
    assert (site / "index.html").is_file()
    assert any("api" in p.parts for p in pages), "the API reference was not built"
    broken = []
    for path, page in pages.items():
        if path.name == "404.html":  # links there are absolute, for any depth of URL
            continue
        for url in page.links:
            found = _target(site, path, url)
            if found is None:
                continue
            target, fragment = found
            where = f"{path.relative_to(site)}: {url}"
            if not target.exists():
                broken.append(f"{where} (no file {target})")
            elif fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else set()
                if fragment not in ids:
                    broken.append(f"{where} (no id {fragment!r})")
    assert not broken, "\n".join(broken)


@pytest.mark.slow
def test_built_pages_carry_no_internal_wording_or_private_bases(
    site: Path, pages: dict[Path, _Page]
) -> None:
    found = []
    for path, page in pages.items():
        text = " ".join(page.text)
        found += [f"{path.relative_to(site)}: {m.group(0)!r}" for m in FORBIDDEN.finditer(text)]
        if "Bases:" in text:
            found.append(f"{path.relative_to(site)}: a 'Bases:' line")
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_lists_render_as_lists(site: Path, pages: dict[Path, _Page]) -> None:
    """No paragraph or list item of the built site contains a line that starts like a list
    item: that is a list Python-Markdown did not recognise and ran into the text."""
    found = []
    for path, page in pages.items():
        for para in page.paragraphs:
            for line in para.splitlines()[1:]:
                if _LIST_ITEM.match(line.strip()):
                    found.append(f"{path.relative_to(site)}: {line.strip()[:60]!r}")
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_the_site_is_built_with_the_pinned_theme(site: Path) -> None:
    """pyproject.toml pins the theme to a release that builds without printing a notice; the
    site names the release that built it."""
    (pin,) = re.findall(r'"mkdocs-material==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    html = (site / "index.html").read_text(encoding="utf-8")
    assert f"mkdocs-material-{pin}" in html, re.findall(r'generator" content="[^"]*"', html)


@pytest.mark.slow
def test_landing_page_states_the_package_version(site: Path) -> None:
    page = _Page()
    page.feed((site / "index.html").read_text(encoding="utf-8"))
    text = " ".join(page.text)
    assert f"multiscale_jac {multiscale_jac.__version__}" in text
    assert "{{" not in text, "a placeholder was not filled in"


@pytest.mark.slow
def test_long_signatures_are_wrapped(site: Path) -> None:
    """``per_sample_jacobian``'s signature is formatted one parameter a line (a formatter is
    installed with the docs extra), so no line of it is cut off at the page's width."""
    html = (site / "api" / "engine" / "index.html").read_text(encoding="utf-8")
    start = html.index('id="multiscale_jac.per_sample_jacobian"')
    block = re.search(r'<div class="[^"]*doc-signature[^"]*">(.*?)</div>', html[start:], flags=re.S)
    assert block is not None
    code = re.sub(r"<[^>]+>", "", block.group(1))
    lines = [ln for ln in code.splitlines() if ln.strip()]
    assert len(lines) > 10, code
    assert max(len(ln) for ln in lines) <= CODE_WIDTH, max(lines, key=len)


#: an element that makes the browser fetch something (an <a> link is only followed on a click)
_FETCHING = re.compile(
    r"<(?:script|img|iframe|source|video|audio)\b[^>]*\bsrc=\"(?P<src>[^\"]*)\""
    r"|<link\b[^>]*\bhref=\"(?P<href>[^\"]*)\"",
    flags=re.I,
)


@pytest.mark.slow
def test_the_site_loads_nothing_from_the_network(site: Path) -> None:
    """Every script, stylesheet, font and image a page or a stylesheet of the site loads is a
    file of the site: it reads the same offline (the theme's web font is off, formulas need no
    script)."""
    remote = []
    for path in sorted(site.rglob("*.html")):
        for match in _FETCHING.finditer(path.read_text(encoding="utf-8")):
            url = match.group("src") or match.group("href")
            if urlsplit(url).scheme in ("http", "https") or url.startswith("//"):
                remote.append(f"{path.relative_to(site)}: {url}")
    for path in sorted(site.rglob("*.css")):
        for url in re.findall(r"url\(\s*['\"]?([^'\")]+)", path.read_text(encoding="utf-8")):
            if urlsplit(url).scheme in ("http", "https") or url.startswith("//"):
                remote.append(f"{path.relative_to(site)}: {url}")
    assert not remote, "\n".join(remote)


@pytest.mark.slow
def test_formulas_are_mathml_written_at_build_time(site: Path) -> None:
    """Every formula of the site is MathML in the page (docs/_hooks.py), no TeX is left for a
    script to typeset, and the math font the stylesheet names is part of the site."""
    count, raw = 0, []
    for path in sorted(site.rglob("*.html")):
        html = path.read_text(encoding="utf-8")
        for element in re.findall(r'class="arithmatex">(.*?)</(?:span|div)>', html, flags=re.S):
            count += 1
            if not element.startswith("<math") or "\\(" in element or "\\[" in element:
                raw.append(f"{path.relative_to(site)}: {element[:80]}")
    assert count >= 50, f"only {count} formulas found"
    assert not raw, "\n".join(raw)
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    (font,) = re.findall(r'src: url\("\.\./([^"]+)"\)', css)
    assert (site / font).is_file() and (site / font).stat().st_size > 100_000


@pytest.mark.slow
def test_enum_members_are_listed(site: Path) -> None:
    html = (site / "api" / "engine" / "index.html").read_text(encoding="utf-8")
    for member in ("AUTO", "VMAP", "BUCKETED", "PADDED", "LOOP"):
        assert f'id="multiscale_jac.Strategy.{member}"' in html, member
