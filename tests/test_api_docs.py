"""Every public name is in the API reference (docs/api/*.md); the site's nav lists every page.

The site itself is built and its links checked by tests/test_docs_site.py (and by
``mkdocs build --strict`` in .ci/run).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import multiscale_jac

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"


def _documented() -> list[str]:
    """The names of the ``::: multiscale_jac.<name>`` blocks of the API pages (docs/api/)."""
    text = "\n".join(p.read_text() for p in sorted(API.glob("*.md")))
    return re.findall(r"^::: multiscale_jac\.(\w+)\s*$", text, flags=re.M)


@pytest.mark.parametrize("name", multiscale_jac.__all__)
def test_public_name_is_in_api_reference(name: str) -> None:
    assert name in _documented(), f"add '::: multiscale_jac.{name}' to a page of docs/api/"


def test_api_reference_documents_only_public_names_once() -> None:
    documented = _documented()
    assert sorted(set(documented)) == sorted(documented), "a name is documented twice"
    assert set(documented) <= set(multiscale_jac.__all__), "docs/api/ names a private object"


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    return [p for item in node for p in _nav_pages(item)]


def test_every_docs_page_is_in_the_nav() -> None:
    """mkdocs.yml's nav lists every page of docs/ and nothing else (a cheap check of the
    config; the strict build in .ci/run catches the rest)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("the docs extra is not installed")
    import yaml  # a dependency of mkdocs

    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert len(nav) == len(set(nav)), "a page is listed twice"
    assert set(nav) == pages
