"""The parts of ``multiscale_jac.laplace``: a posterior is made of parts (composition: at most
two bases per class, explicit signatures, no attribute set in one module and read in another),
and the posterior forms answer the same protocol alike."""

from __future__ import annotations

import ast
import inspect
import pydoc
from pathlib import Path

import pytest
import torch
from torch import nn

import multiscale_jac as mj
from multiscale_jac.laplace._forms import (
    DiagForm,
    FullForm,
    NotPositiveDefinite,
    PosteriorForm,
    PrecisionTerms,
)

D = torch.float64


LAPLACE = Path(mj.__file__).parent / "laplace"


def _classes() -> list[tuple[str, ast.ClassDef]]:
    return [
        (f.name, node)
        for f in sorted(LAPLACE.glob("*.py"))
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.ClassDef)
    ]


def test_the_classes_are_made_of_parts() -> None:
    """Each Laplace class is the one base plus its form and curvature; no class in laplace/
    has more than two bases."""
    for cls in (mj.SubnetLaplace, mj.DiagLaplace, mj.laplace.KronLaplace):
        assert cls.__bases__ == (mj.laplace.LaplaceBase,), cls
    assert not issubclass(mj.DiagLaplace, mj.SubnetLaplace)
    model = nn.Linear(3, 2)
    assert isinstance(mj.SubnetLaplace(model, "regression").form, FullForm)
    assert isinstance(mj.DiagLaplace(model, "regression").form, DiagForm)
    wide = [(f, c.name, len(c.bases)) for f, c in _classes() if len(c.bases) > 2]
    assert wide == []


def test_signatures_are_explicit_and_help_lists_every_option() -> None:
    """No ``**options`` on a public call; ``help()`` of ``Laplace`` and the classes lists every
    option of :class:`LaplaceOptions` and of the prior."""
    options = [f for f in mj.laplace.LaplaceOptions.__dataclass_fields__ if f != "backend_name"]
    options += ["prior_precision", "prior_mean", "sigma_noise", "temperature", "backend"]
    for obj in (mj.laplace.Laplace, mj.SubnetLaplace, mj.laplace.KronLaplace, mj.DiagLaplace):
        text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
        missing = [o for o in options if f"{o}:" not in text and f"{o}=" not in text]
        assert missing == [], (obj, missing)
    from multiscale_jac.laplace._frontdoor import CLASS_OPTIONS

    assert set(CLASS_OPTIONS) <= set(inspect.signature(mj.laplace.Laplace).parameters)
    for cls in (mj.SubnetLaplace, mj.laplace.KronLaplace, mj.DiagLaplace):
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_") and name != "__init__":
                continue
            kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
            assert inspect.Parameter.VAR_KEYWORD not in kinds or name == "__call__", name


def _attributes(tree: ast.AST) -> tuple[set[str], list[tuple[str, str, int]]]:
    """``self.x`` names assigned, and every assignment to another object's attribute."""
    mine: set[str] = set()
    foreign: list[tuple[str, str, int]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [
                t for tt in node.targets for t in (tt.elts if isinstance(tt, ast.Tuple) else [tt])
            ]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute):
                owner = t.value.id if isinstance(t.value, ast.Name) else ast.unparse(t.value)
                if owner == "self":
                    mine.add(t.attr)
                else:
                    foreign.append((owner, t.attr, t.lineno))
    return mine, foreign


def test_no_attribute_is_set_in_one_module_and_read_in_another() -> None:
    """State stays in the module that owns it: a private attribute is read only in the module
    that sets it, a module reads no ``self.x`` that another module sets (no mixins sharing
    state), and no module assigns another object's attributes except through a property's
    setter (public API)."""
    trees = {f.name: ast.parse(f.read_text()) for f in sorted(LAPLACE.glob("*.py"))}
    setters = {
        node.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any(ast.unparse(d).endswith(".setter") for d in node.decorator_list)
    }
    data = {name: _attributes(tree)[0] for name, tree in trees.items()}
    defined = {  # methods, properties and class-level fields (dataclasses, NamedTuples)
        name: {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        | {
            a.target.id
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef)
            for a in c.body
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
        }
        for name, tree in trees.items()
    }
    problems = []
    for name, tree in trees.items():
        _, foreign = _attributes(tree)
        problems += [(name, f"{o}.{a} =", line) for o, a, line in foreign if a not in setters]
        others = set().union(*(v for k, v in data.items() if k != name))
        others -= data[name] | defined[name]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
                continue
            is_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if node.attr in others and (is_self or private):
                problems.append((name, f"reads {ast.unparse(node)}", node.lineno))
    assert problems == []


def test_forms_implement_the_protocol() -> None:
    wanted = {n for n, _ in inspect.getmembers(PosteriorForm) if not n.startswith("_")}
    assert wanted == {
        "precision",
        "scale",
        "logdet",
        "variance",
        "covariance",
        "whiten",
        "draw",
        "kept_bytes",
    }
    for form in (FullForm, DiagForm):
        for name in wanted:
            mine = inspect.signature(getattr(form, name)).parameters
            theirs = inspect.signature(getattr(PosteriorForm, name)).parameters
            assert list(mine) == list(theirs), (form.__name__, name)


def test_full_and_diag_forms_agree_on_a_diagonal_curvature() -> None:
    g = torch.Generator().manual_seed(0)
    d = torch.rand(5, generator=g, dtype=D)
    prior = torch.rand(5, generator=g, dtype=D) + 0.5
    full, diag = FullForm(), DiagForm()
    tf, td = PrecisionTerms(torch.diag(d), 0.7, prior), PrecisionTerms(d, 0.7, prior)
    torch.testing.assert_close(full.precision(tf).diagonal(), diag.precision(td))
    torch.testing.assert_close(full.logdet(tf), diag.logdet(td))
    sf, sd = full.scale(tf), diag.scale(td)
    torch.testing.assert_close(full.variance(tf, lambda: sf), diag.variance(td, lambda: sd))
    torch.testing.assert_close(full.covariance(tf, lambda: sf), diag.covariance(td, lambda: sd))
    jac = torch.randn(3, 5, generator=g, dtype=D)
    vf, vd = full.whiten(sf, jac), diag.whiten(sd, jac)
    torch.testing.assert_close(vf.T @ vf, vd.T @ vd)  # J Sigma J^T
    z = torch.randn(5, 4, generator=g, dtype=D)
    torch.testing.assert_close(full.draw(sf, z), diag.draw(sd, z))
    subset = mj.ParamSubset.all(nn.Linear(2, 1))  # P = 3
    assert full.kept_bytes(subset, 8) == 2 * 9 * 8 + 4 * 3 * 8
    assert diag.kept_bytes(subset, 8) == 6 * 3 * 8


def test_full_form_names_a_precision_without_a_factor() -> None:
    terms = PrecisionTerms(-torch.eye(2, dtype=D), 1.0, torch.full((2,), 0.5, dtype=D))
    with pytest.raises(NotPositiveDefinite, match="increase prior_precision"):
        FullForm().scale(terms)
