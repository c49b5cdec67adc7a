"""The parts of ``multiscale_jac.laplace``: the two classes share parts instead of one
subclassing the other, and the posterior forms answer the same protocol alike."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import multiscale_jac as mj
from multiscale_jac.laplace._posterior import (
    DiagForm,
    FullForm,
    NotPositiveDefinite,
    PosteriorForm,
    PrecisionTerms,
)

D = torch.float64


def test_the_classes_share_parts_without_subclassing() -> None:
    assert not issubclass(mj.DiagLaplace, mj.SubnetLaplace)
    assert not issubclass(mj.SubnetLaplace, mj.DiagLaplace)
    shared = set(mj.SubnetLaplace.__mro__) & set(mj.DiagLaplace.__mro__)
    assert len(shared) > 2  # more than the base and object
    assert isinstance(mj.SubnetLaplace.form, FullForm)
    assert isinstance(mj.DiagLaplace.form, DiagForm)


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
