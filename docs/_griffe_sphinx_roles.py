"""Griffe extension for the API reference (mkdocs.yml): Sphinx roles as code, page paths as links.

The package's docstrings are Google style but refer to names with Sphinx roles
(:class:`ParamSubset`, :func:`~multiscale_jac.pack`). Markdown has no such roles, so they would
show as ":class:ParamSubset", and a role before a colon in a Returns section would be read as a
name. This rewrites each role to inline code: ``~a.b.C`` shows ``C``, anything else as written.

Docstrings also point to the documentation pages by path (``docs/design.md``), which reads well
in ``help()`` but is a dead end on the site. Each such path becomes a link to that page, titled
with the page's heading, through mkdocs-autorefs (``[title][heading-id]``), so the link is right
from whichever API page shows the docstring; "the options table in ``docs/design.md``" links to
that table's section. Only the rendered text changes; the source docstrings stay as they are.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import griffe
from markdown.extensions.toc import slugify

_ROLE = re.compile(
    r":(?:py:)?(?:attr|class|data|exc|func|meth|mod|obj|const):`(~?)([^`]+)`"
)
_DOCS = Path(__file__).resolve().parent
_OPTIONS_TABLE = re.compile(r"the options table\s+in\s+``docs/design\.md``")
_PAGE = re.compile(r"``docs/([a-z0-9_-]+)\.md``")


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


@functools.cache
def _page_heading(stem: str) -> tuple[str, str] | None:
    """(title, anchor id) of the first heading of ``docs/<stem>.md``, as the toc makes it."""
    path = _DOCS / f"{stem}.md"
    if not path.is_file():
        return None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            title = line[2:].strip()
            return title, slugify(title.replace("`", ""), "-")
    return None


def _page_link(match: re.Match[str]) -> str:
    found = _page_heading(match.group(1))
    if found is None:  # not a page of this site: leave the path as code
        return match.group(0)
    title, anchor = found
    return f"[{title.replace('`', '')}][{anchor}]"


def _options_table(stem: str) -> str:
    for line in (_DOCS / f"{stem}.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("## Options"):
            return slugify(line[3:].strip().replace("`", ""), "-")
    raise LookupError("docs/design.md has no 'Options' section")


class SphinxRolesAsCode(griffe.Extension):
    """Rewrites ``:role:`target``` to ```target``` and ````docs/x.md```` to a link to that page
    in every docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        text = _ROLE.sub(_code, obj.docstring.value)
        text = _OPTIONS_TABLE.sub(
            lambda _: f"[the options table][{_options_table('design')}]", text
        )
        obj.docstring.value = _PAGE.sub(_page_link, text)
