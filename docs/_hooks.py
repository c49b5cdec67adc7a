"""MkDocs hooks (mkdocs.yml ``hooks:``): values filled into pages at build time.

* ``{{ version }}``: ``multiscale_jac.__version__``, read from ``multiscale_jac/__init__.py``
  (the landing page states the version the site was built from).
* ``{{ cli_help }}``: the ``--help`` text of ``multiscale-jac`` and of each subcommand, from the
  argument parser itself (the command-line reference page), wrapped at 88 columns.

Only pages that contain a placeholder are touched; the package is imported only for
``{{ cli_help }}``.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
_VERSION = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)


@functools.cache
def version() -> str:
    text = (_ROOT / "multiscale_jac" / "__init__.py").read_text(encoding="utf-8")
    match = _VERSION.search(text)
    if match is None:
        raise RuntimeError("multiscale_jac/__init__.py defines no __version__")
    return match.group(1)


@functools.cache
def cli_help() -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "88"
    try:
        from multiscale_jac.cli import build_parser

        parser = build_parser()
        blocks = [("multiscale-jac --help", parser.format_help())]
        for action in parser._subparsers._group_actions if parser._subparsers else ():
            for name, sub in (getattr(action, "choices", None) or {}).items():
                blocks.append((f"multiscale-jac {name} --help", sub.format_help()))
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    parts = []
    for command, text in blocks:
        title = command.removesuffix(" --help")
        parts.append(f"## `{title}`\n\n```text\n$ {command}\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if "{{ version }}" in markdown:
        markdown = markdown.replace("{{ version }}", version())
    if "{{ cli_help }}" in markdown:
        markdown = markdown.replace("{{ cli_help }}", cli_help())
    return markdown
