"""Griffe extension for the API reference (mkdocs.yml): Sphinx roles in docstrings as code.

The package's docstrings are Google style but refer to names with Sphinx roles
(:class:`ParamSubset`, :func:`~multiscale_jac.pack`). Markdown has no such roles, so they would
show as ":class:ParamSubset", and a role before a colon in a Returns section would be read as a
name. This rewrites each role to inline code: ``~a.b.C`` shows ``C``, anything else as written.
Only the rendered text changes; the source docstrings stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:attr|class|data|exc|func|meth|mod|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRolesAsCode(griffe.Extension):
    """Rewrites ``:role:`target``` to ```target``` in every docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
