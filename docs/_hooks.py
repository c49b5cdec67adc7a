r"""MkDocs hooks (mkdocs.yml ``hooks:``): values filled into pages at build time.

* ``{{ version }}``: ``multiscale_jac.__version__``, read from ``multiscale_jac/__init__.py``
  (the landing page states the version the site was built from).
* ``{{ cli_help }}``: the ``--help`` text of ``multiscale-jac`` and of each subcommand, from the
  argument parser itself (the command-line reference page), wrapped at 80 columns.
* Formulas: ``pymdownx.arithmatex`` (generic mode) marks up ``$...$`` and ``$$...$$`` as
  ``<span class="arithmatex">\(...\)</span>`` and ``<div class="arithmatex">\[...\]</div>``;
  :func:`on_page_content` replaces the TeX with MathML (``latex2mathml``, the docs extra), which
  browsers render themselves: the site shows its formulas offline and loads no script for them.
  A formula that does not convert fails the build.

Only pages that contain a placeholder are touched; the package is imported only for
``{{ cli_help }}``.
"""

from __future__ import annotations

import functools
import html
import os
import re
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
_VERSION = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)
#: a formula as pymdownx.arithmatex (generic mode) writes it: inline \( \) or display \[ \]
_FORMULA = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*\\(?P<open>[(\[])(?P<tex>.*?)\\[)\]]\s*</(?P=tag)>',
    re.S,
)


@functools.cache
def version() -> str:
    text = (_ROOT / "multiscale_jac" / "__init__.py").read_text(
        encoding="utf-8"
    )
    match = _VERSION.search(text)
    if match is None:
        raise RuntimeError("multiscale_jac/__init__.py defines no __version__")
    return match.group(1)


@functools.cache
def cli_help() -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        from multiscale_jac.cli import build_parser

        parser = build_parser()
        blocks = [("multiscale-jac --help", parser.format_help())]
        for action in (
            parser._subparsers._group_actions if parser._subparsers else ()
        ):
            for name, sub in (getattr(action, "choices", None) or {}).items():
                blocks.append(
                    (f"multiscale-jac {name} --help", sub.format_help())
                )
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    parts = []
    for command, text in blocks:
        title = command.removesuffix(" --help")
        parts.append(
            f"## `{title}`\n\n```text\n$ {command}\n{text.rstrip()}\n```\n"
        )
    return "\n".join(parts)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if "{{ version }}" in markdown:
        markdown = markdown.replace("{{ version }}", version())
    if "{{ cli_help }}" in markdown:
        markdown = markdown.replace("{{ cli_help }}", cli_help())
    return markdown


#: operator names: ``\operatorname{diag}``, ``\log``, ...
_OPERATOR = re.compile(
    r"\\operatorname\{([A-Za-z]+)\}|\\(log|ln|det|exp|max|min|sup|inf|tr)(?![A-Za-z])"
)
#: what may follow an operator name without TeX's thin space (a bracket, a script, a space)
_TIGHT_AFTER = ("(", "[", "\\{", "\\big", "\\Big", "\\left", "^", "_", "\\,")
#: an ``<mo>`` that is a bracket: TeX puts no space inside brackets
_FENCE = re.compile(r"<mo((?: [a-z]+=\"[^\"]*\")*)>([^<]*)</mo>")
_FENCES = set("()[]{}|\u2016\u27e8\u27e9")


def _operator_names(tex: str) -> str:
    r"""Operator names as upright text with TeX's thin space beside an ordinary symbol:
    latex2mathml makes ``\operatorname{diag}`` an ``<mo>`` with an operator's wide space on
    both sides (``diag (p)``) and runs ``\log p`` together (``logp``)."""
    out: list[str] = []
    last = 0
    for match in _OPERATOR.finditer(tex):
        out.append(tex[last : match.start()])
        last = match.end()
        before = "".join(out).rstrip()
        after = tex[last:].lstrip()
        if before and (before[-1].isalnum() or before[-1] in ")]}"):
            out.append("\\,")
        out.append(f"\\text{{{match.group(1) or match.group(2)}}}")
        if (
            after
            and not after.startswith(_TIGHT_AFTER)
            and after[0] not in ")]}|,.;"
        ):
            out.append("\\,")
    return "".join(out) + tex[last:]


def _tight_fence(match: re.Match[str]) -> str:
    """A bracket without space beside it; one sized by ``\\big`` and the like stretches to its
    contents instead (a bracket held at 1.2em is drawn with a gap on both sides)."""
    attrs, text = match.group(1), match.group(2)
    if html.unescape(text) not in _FENCES or "lspace=" in attrs:
        return match.group(0)
    attrs = re.sub(r' (minsize|maxsize)="[^"]*"', "", attrs)
    return f'<mo{attrs} lspace="0" rspace="0">{text}</mo>'


def mathml(tex: str, *, display: bool) -> str:
    """The MathML of one TeX formula (``latex2mathml``), with TeX's spacing around operator
    names and brackets (an unrecognised bracket in the middle of a formula gets an operator's
    space on both sides in the browser: ``( f )``)."""
    from latex2mathml.converter import convert

    math = convert(
        _operator_names(tex.strip()), display="block" if display else "inline"
    )
    return _FENCE.sub(_tight_fence, math)


def on_page_content(html_text: str, page: Any, **kwargs: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        tex = html.unescape(match.group("tex"))
        display = match.group("open") == "["
        try:
            math = mathml(tex, display=display)
        except (
            Exception
        ) as err:  # latex2mathml raises its own errors and plain ones
            where = page.file.src_uri
            raise RuntimeError(
                f"{where}: formula {tex!r} does not convert: {err}"
            ) from err
        tag = match.group("tag")
        return f'<{tag} class="arithmatex">{math}</{tag}>'

    return _FORMULA.sub(replace, html_text)
