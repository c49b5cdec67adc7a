"""The linearised (GLM) predictive, its link approximations and predictive samples.

:class:`Predictive` is the part of a posterior that answers ``predictive`` (``f(x)`` and ``J Sigma J^T`` from whitened
Jacobian rows, a chunk at a time; dense outputs never form ``O x O``), laplace-torch's
``la(x, ...)`` and ``predictive_samples``, posterior ``sample`` and ``functional_samples``
(linearised, or the model run with sampled entries). The link approximations of a
classification: ``probit``, the Laplace bridge and Monte Carlo.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import check_bool, check_generator, check_positive_int
from .._memory import DEFAULT_JACOBIAN_BYTES, tensor_bytes
from .._stream import raw_output
from ..adapter import check_model_kwargs
from ..enums import Likelihood, LinkApprox, PredType, parse_enum
from ._jacobian_rows import Block, JacobianRows
from ._options import LaplaceOptions
from ._posterior import Posterior

__all__ = ["GLMPredictive", "Predictive"]


@dataclass(frozen=True)
class GLMPredictive:
    """The linearised predictive ``f(x) + J (theta - theta_MAP)`` at a batch of inputs.

    Per-sample tensors are stacked to ``(N, *out)`` when every sample's output has one shape,
    and given as lists of ``(*out)`` tensors otherwise (ragged dense outputs). ``*out`` is the
    per-sample output shape after ``output_fn`` without the batch dim of one.

    Attributes:
        mean: ``f(x)``, the output at the MAP.
        variance: Marginal variances of ``f`` (``diag(J Sigma J^T)``), shaped like ``mean``;
            epistemic only (add ``sigma_noise**2`` for a regression's predictive of ``y``).
        covariance: ``J Sigma J^T`` ``(N, O, O)`` when every output is a vector (a list of
            ``(O_i, O_i)`` when their sizes differ); ``None`` for dense outputs, whose
            covariance is never formed.
        probs: Classification: class probabilities shaped like ``mean`` (``link_approx``).
        link_approx: The link approximation used, ``None`` for regression.
    """

    mean: Tensor | list[Tensor]
    variance: Tensor | list[Tensor]
    covariance: Tensor | list[Tensor] | None = None
    probs: Tensor | list[Tensor] | None = None
    link_approx: LinkApprox | None = None


class Predictive:
    """The GLM predictive at new inputs, from the posterior's Jacobian rows whitened by its
    form, and samples of the posterior and of the predictive.

    Args:
        rows: The posterior's Jacobian rows.
        posterior: The posterior.
        options: The posterior's options (``enable_backprop``, the dict batch keys).
        full_model: The model whose every parameter :meth:`sample` returns (laplace-torch's
            subnetwork Laplace; ``None``: the subset's entries only).
    """

    def __init__(
        self,
        rows: JacobianRows,
        posterior: Posterior,
        options: LaplaceOptions,
        full_model: nn.Module | None,
    ) -> None:
        self._rows, self._post, self._options = rows, posterior, options
        self._full = full_model
        self._subset = posterior.subset

    def set_options(self, options: LaplaceOptions) -> None:
        """The posterior's options after a change (``enable_backprop``)."""
        self._options = options

    def inputs(self, inputs: Any) -> Any:
        """Predictive inputs: a dict batch (holding ``dict_key_x`` and ``dict_key_y``) without
        its ``dict_key_y`` entry; a dict of levels passes unchanged."""
        kx, ky = self._options.dict_key_x, self._options.dict_key_y
        if isinstance(inputs, Mapping) and {kx, ky} <= set(inputs):
            return {k: v for k, v in inputs.items() if k != ky}
        return inputs

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """``n_samples`` draws ``(n_samples, P)`` from the posterior over the selected entries;
        built by ``Laplace(subset_of_weights="subnetwork")``, every parameter of the model
        ``(n_samples, parameters_to_vector(model.parameters()).numel())``, the others at the
        MAP, as laplace-torch's subnetwork Laplace returns them."""
        draws = self._draws(n_samples, generator)
        if self._full is None:
            return draws
        n = draws.shape[0]
        full = torch.nn.utils.parameters_to_vector(self._full.parameters()).detach()
        full = full.to(draws.dtype).repeat(n, 1)
        full[:, self._subset.flat_indices().to(full.device)] = draws
        return full

    def _draws(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        """``n_samples`` draws ``(n_samples, P)`` of the selected entries."""
        n = check_positive_int(n_samples, "n_samples")
        generator = check_generator(generator)
        mean = self._post.mean
        z = torch.randn(n, self._subset.numel, generator=generator, dtype=mean.dtype)
        return mean + self._post.draw(z.to(mean.device).T).T

    def call(
        self,
        x: Any,
        pred_type: str | PredType,
        joint: bool,
        link_approx: str | LinkApprox,
        n_samples: int,
        diagonal_output: bool,
        generator: torch.Generator | None,
        model_kwargs: dict[str, Any],
    ) -> Tensor | list[Tensor] | tuple[Any, Any]:
        """laplace-torch's predictive at ``x`` (any form :func:`~multiscale_jac.pack` accepts).

        Args:
            x: The inputs.
            pred_type: ``glm`` (linearised) or ``nn`` (the model run with posterior samples;
                it needs ``link_approx="mc"``, as laplace-torch: the others approximate the GLM's
                link).
            joint: Regression ``glm``: the joint predictive over the batch, ``(f_mu, f_cov)``
                with ``f_mu`` ``(N O,)`` and ``f_cov`` ``(N O, N O)`` (sample-major; it holds
                the whitened Jacobian rows of the whole batch, ``P x N O``); ignored for
                classification and ``pred_type="nn"``, as laplace-torch.
            link_approx: ``probit``, ``mc``, ``bridge`` or ``bridge_norm`` (classification).
            n_samples: Samples for ``mc`` and ``nn``.
            diagonal_output: Regression ``glm``: the marginal variances ``(N, O)`` instead of
                the covariance.
            generator: Seeds the sampling.
            model_kwargs: Keyword arguments for every call of the model's forward in this
                predictive (not tensors; laplace-torch's ``**model_kwargs``).

        Returns:
            Classification: probabilities ``(N, C)`` (dense logits: ``(N, C, *spatial)``, a
            softmax per position; ragged outputs: a list of ``(C, *spatial_i)``). Regression:
            ``(f_mu, f_var)`` with ``f_mu`` ``(N, O)`` and ``f_var`` ``(N, O, O)`` for vector
            outputs; for dense outputs (or ``diagonal_output``, or a sample sliced under
            ``memory_budget``) ``f_var`` holds the marginal variances shaped like ``f_mu``
            (lists for ragged outputs). ``pred_type="nn"``: the sample mean and the (unbiased)
            sample variance.
        """
        pred = parse_enum(PredType, pred_type, "pred_type")
        link = parse_enum(LinkApprox, link_approx, "link_approx")
        n_samples = check_positive_int(n_samples, "n_samples")
        diagonal_output = check_bool(diagonal_output, "diagonal_output")
        joint = check_bool(joint, "joint")
        if pred is PredType.NN and link is not LinkApprox.MC:
            raise ValueError(f"pred_type='nn' supports only link_approx='mc'; got {link.value!r}")
        with self._rows.calling(check_model_kwargs(model_kwargs)):
            if joint and pred is PredType.GLM and self._post.likelihood is Likelihood.REGRESSION:
                return self._joint(x)
            return self._call(x, pred, link, n_samples, diagonal_output, generator)

    def _joint(self, inputs: Any) -> tuple[Tensor, Tensor]:
        """Regression's joint GLM predictive over the batch: the mean ``(N O,)`` and the
        covariance ``(N O, N O)`` across samples and outputs (sample-major), from the whitened
        Jacobian rows of the whole batch (``P x N O`` held at once)."""
        self._post.fitted()
        packed = self._rows.pack(self.inputs(inputs))
        means: list[Tensor] = []
        rows: list[Tensor] = []
        blocks = self._rows.blocks(inputs, packed, self._post.likelihood)
        for group, v in self._groups(blocks):  # whole groups: no per-sample slices to join
            means.extend(b.out.reshape(-1) for b in group)
            rows.append(v)
        v = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)  # (P, N O): the batch's rows
        self._rows.warn_fallbacks()
        return torch.cat(means), v.T @ v

    def _whitened(self, blocks: Iterable[Block]) -> Iterator[tuple[Block, Tensor]]:
        """Every block with its whitened rows ``V`` ``(P, rows)`` (see :meth:`_groups`)."""
        for group, v in self._groups(blocks):
            # split: one backward node per group (a slice per block adds one each, every one
            # writing a zero-filled group-sized gradient)
            sizes = [b.jac.shape[0] for b in group]  # type: ignore[union-attr]
            yield from zip(group, v.split(sizes, dim=1), strict=True)

    def _groups(self, blocks: Iterable[Block]) -> Iterator[tuple[list[Block], Tensor]]:
        """Blocks whitened together, with their rows ``V`` ``(P, rows of the group)``, while
        their rows fit the default bytes of Jacobian rows (one call of the form for many
        small blocks; one block at a time under a ``memory_budget``). The joint and the
        marginal predictive group alike, so their variances agree to round-off."""
        cap = 0 if self._options.memory_budget is not None else DEFAULT_JACOBIAN_BYTES
        group: list[Block] = []
        size = 0
        for block in blocks:
            if block.jac is None:  # pragma: no cover - predictive blocks always carry rows
                raise RuntimeError("internal error: a predictive block without Jacobian rows")
            rows, p = block.jac.shape
            if group and tensor_bytes((size + rows) * p, block.jac.element_size()) > cap:
                yield group, self._whiten(group)
                group, size = [], 0
            group.append(block)
            size += rows
        if group:
            yield group, self._whiten(group)

    def _whiten(self, group: list[Block]) -> Tensor:
        jacs = [b.jac for b in group]
        return self._post.whiten(jacs[0] if len(jacs) == 1 else torch.cat(jacs))  # type: ignore

    def _call(
        self,
        x: Any,
        pred: PredType,
        link: LinkApprox,
        n_samples: int,
        diagonal_output: bool,
        generator: torch.Generator | None,
    ) -> Tensor | list[Tensor] | tuple[Any, Any]:
        cls = self._post.likelihood is Likelihood.CLASSIFICATION
        if pred is PredType.NN:
            samples = self.functional_samples(x, n_samples, linearized=False, generator=generator)
            if cls:
                return _per_sample(samples, lambda s: _softmax(s).mean(0))
            return _per_sample(samples, lambda s: s.mean(0)), _per_sample(
                samples, lambda s: s.var(0)
            )
        generator = check_generator(generator)
        covariance = not cls and not diagonal_output
        out = self._predictive(x, link, n_samples, generator, covariance=covariance)
        if cls:
            return out.probs  # type: ignore[return-value]
        if diagonal_output or out.covariance is None:
            return out.mean, out.variance
        return out.mean, out.covariance

    def predictive_samples(
        self,
        x: Any,
        pred_type: str | PredType = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor | list[Tensor]:
        """Samples of the predictive at ``x``: ``(n_samples, N, *out)`` (a list of
        ``(n_samples, *out_i)`` for ragged outputs); class probabilities (a softmax over the
        class dim) for classification, outputs for regression.

        Args:
            x: The inputs.
            pred_type: ``glm`` (linearised, exact joint draws over each sample's outputs) or
                ``nn`` (the model run with posterior samples).
            n_samples: Number of samples.
            diagonal_output: ``glm``: independent draws per output from the marginal variances.
            generator: Seeds the draws.
        """
        pred = parse_enum(PredType, pred_type, "pred_type")
        n_samples = check_positive_int(n_samples, "n_samples")
        generator = check_generator(generator)
        if pred is PredType.GLM and check_bool(diagonal_output, "diagonal_output"):
            mean, variance = self.functional_variance_fast(x)  # no O x O covariances

            def draw(m: Tensor, v: Tensor) -> Tensor:
                z = torch.randn((n_samples, *m.shape), generator=generator, dtype=m.dtype)
                return m + v.sqrt() * z.to(m.device)

            if isinstance(mean, list):
                samples: Tensor | list[Tensor] = [draw(m, v) for m, v in zip(mean, variance)]
            else:
                samples = draw(mean, variance)  # type: ignore[arg-type]
        else:
            samples = self.functional_samples(
                x, n_samples, linearized=pred is PredType.GLM, generator=generator
            )
        if self._post.likelihood is Likelihood.CLASSIFICATION:
            return _per_sample(samples, _softmax, batched=False)
        return samples

    def functional_variance_fast(
        self, x: Any
    ) -> tuple[Tensor | list[Tensor], Tensor | list[Tensor]]:
        """laplace-torch's call: the GLM mean ``f(x)`` and the marginal variances of ``f``, both
        shaped like the outputs (``(N, O)`` for vector outputs), without any ``O x O``
        covariance."""
        p = self._predictive(x, LinkApprox.PROBIT, 1, None, covariance=False)
        return p.mean, p.variance

    def predictive(
        self,
        inputs: Any,
        *,
        link_approx: str | LinkApprox = "probit",
        n_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> GLMPredictive:
        """The GLM predictive at ``inputs`` (any form :func:`~multiscale_jac.pack` accepts).

        Marginal variances are ``||V_o||^2`` per output row (``V = L^{-1} J^T``), computed in
        chunks of rows; dense outputs never form an ``O x O`` matrix.

        Args:
            inputs: The batch.
            link_approx: ``probit``, ``mc`` or ``bridge`` (classification).
            n_samples: Joint samples for ``mc``.
            generator: Seeds ``mc``.
        """
        link = parse_enum(LinkApprox, link_approx, "link_approx")
        n_samples = check_positive_int(n_samples, "n_samples")
        generator = check_generator(generator)
        return self._predictive(inputs, link, n_samples, generator, covariance=True)

    def _predictive(
        self,
        inputs: Any,
        link: LinkApprox,
        n_samples: int,
        generator: torch.Generator | None,
        covariance: bool,
    ) -> GLMPredictive:
        """:meth:`predictive` on checked arguments; ``covariance=False`` skips the ``O x O``
        covariances of vector outputs."""
        self._post.fitted()
        packed = self._rows.pack(self.inputs(inputs))
        n = packed.num_samples
        means: list[list[Tensor]] = [[] for _ in range(n)]
        variances: list[list[Tensor]] = [[] for _ in range(n)]
        covs: list[list[Tensor]] = [[] for _ in range(n)]
        probs: list[list[Tensor]] = [[] for _ in range(n)]
        shapes: list[torch.Size] = [torch.Size()] * n
        vector = True
        cls = self._post.likelihood is Likelihood.CLASSIFICATION
        blocks = self._rows.blocks(inputs, packed, self._post.likelihood)
        for block, v in self._whitened(blocks):  # v: (P, rows)
            i, out, jac, shape = block.i, block.out, block.jac, block.shape
            shapes[i] = shape
            var = (v * v).sum(0)
            f = out.reshape(-1)
            means[i].append(f)
            variances[i].append(var)
            vector = vector and len(shape) <= 1 and covariance
            if vector:
                covs[i].append(v.T @ v)
            if cls:
                pr = self._probs(link, f.view(out.shape[0], -1), var, v, jac, n_samples, generator)
                probs[i].append(pr.reshape(-1))
        mean = _stack_or_list([_join(b, s, cls) for b, s in zip(means, shapes)])
        variance = _stack_or_list([_join(b, s, cls) for b, s in zip(variances, shapes)])
        cov_out = None
        if vector and all(len(c) == 1 for c in covs):
            cov_out = _stack_or_list([c[0] for c in covs])
        prob_out = (
            _stack_or_list([_join(b, s, cls) for b, s in zip(probs, shapes)]) if cls else None
        )
        self._rows.warn_fallbacks()
        return GLMPredictive(mean, variance, cov_out, prob_out, link if cls else None)

    def _probs(
        self,
        link: LinkApprox,
        logits: Tensor,
        var: Tensor,
        v: Tensor,
        jac: Tensor,
        n_samples: int,
        generator: torch.Generator | None,
    ) -> Tensor:
        """Class probabilities ``(C, m)`` of one block: ``logits`` ``(C, m)``, the marginal
        variances ``var`` and the whitened rows ``v`` ``(P, C m)`` of the Jacobian rows
        ``jac``."""
        c = logits.shape[0]
        if link is LinkApprox.PROBIT:
            kappa = torch.rsqrt(1 + math.pi / 8 * var.view(c, -1))
            return torch.softmax(kappa * logits, dim=0)
        if link in (LinkApprox.BRIDGE, LinkApprox.BRIDGE_NORM):
            vc = v.view(-1, c, logits.shape[1])  # (P, C, m)
            cov = torch.einsum("pcm,pdm->mcd", vc, vc)
            return _bridge(logits.T, cov, normalised=link is LinkApprox.BRIDGE_NORM).T
        z = torch.randn(n_samples, v.shape[0], generator=generator, dtype=v.dtype).to(v.device)
        eps = self._post.draw(z.T)  # (P, S)
        fs = logits.reshape(1, -1) + (jac @ eps).T  # (S, rows)
        return torch.softmax(fs.view(n_samples, c, -1), dim=1).mean(0)

    def functional_samples(
        self,
        inputs: Any,
        n_samples: int = 100,
        *,
        linearized: bool | None = None,
        pred_type: str | PredType | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor | list[Tensor]:
        """``n_samples`` output samples per input: ``(n_samples, N, *out)`` (a list of
        ``(n_samples, *out)`` for ragged outputs).

        Args:
            linearized: ``f + J (theta_s - theta_MAP)`` (the GLM predictive; the default);
                ``False`` runs the model with the sampled entries in place (a functional call;
                the model itself is not changed).
            pred_type: laplace-torch's name for the same choice: ``glm`` (linearised) or
                ``nn``; given with ``linearized``, the two must agree.
        """
        n_samples = check_positive_int(n_samples, "n_samples")
        linearized = _linearized(linearized, pred_type)
        thetas = self._draws(n_samples, generator)  # (S, P)
        packed = self._rows.pack(self.inputs(inputs))
        n = packed.num_samples
        likelihood = self._post.likelihood
        cls = likelihood is Likelihood.CLASSIFICATION
        out: list[Tensor] = []
        if linearized:
            delta = (thetas - self._post.mean).T  # (P, S)
            parts: list[list[Tensor]] = [[] for _ in range(n)]
            shapes: list[torch.Size] = [torch.Size()] * n
            for block in self._rows.jacobians(packed, likelihood):
                shapes[block.i] = block.shape
                f = block.out.reshape(-1).unsqueeze(-1)
                parts[block.i].append((f + block.jac @ delta).T)  # (S, rows)
            out = [_join(p, s, cls, lead=n_samples) for p, s in zip(parts, shapes)]
        else:
            fn = self._rows.function(packed)
            with torch.set_grad_enabled(self._options.enable_backprop):
                for i in range(n):
                    levels = tuple(packed.sample(i))
                    rows = [
                        raw_output(fn, tuple(self._subset.split(theta).values()), levels)[0]
                        for theta in thetas
                    ]
                    out.append(torch.stack(rows))
        self._rows.warn_fallbacks()
        return _stack_or_list(out, dim=1)


def _linearized(linearized: bool | None, pred_type: str | PredType | None) -> bool:
    """``functional_samples``'s choice from ``linearized`` and laplace-torch's ``pred_type``."""
    lin = None if linearized is None else check_bool(linearized, "linearized")
    if pred_type is None:
        return True if lin is None else lin
    by_type = parse_enum(PredType, pred_type, "pred_type") is PredType.GLM
    if lin is not None and lin != by_type:
        raise ValueError(
            f"linearized={lin} and pred_type={pred_type!r} disagree (pred_type 'glm' is "
            "linearized=True, 'nn' linearized=False); give one of them"
        )
    return by_type


def _join(
    blocks: list[Tensor], shape: torch.Size, classes: bool, lead: int | None = None
) -> Tensor:
    """A sample's blocks ``(*lead, rows_k)`` (classification rows: ``C x m_k`` class-major)
    joined along positions and shaped ``(*lead, *shape)``."""
    pre = () if lead is None else (lead,)
    c = (shape[0] if len(shape) else 1) if classes else 1
    if len(blocks) == 1:
        return blocks[0].reshape(*pre, *shape)
    joined = torch.cat([b.reshape(*pre, c, -1) for b in blocks], dim=-1)
    return joined.reshape(*pre, *shape)


def _stack_or_list(parts: list[Tensor], dim: int = 0) -> Tensor | list[Tensor]:
    """Stacked along ``dim`` when all parts share one shape, else the list."""
    if len({p.shape for p in parts}) == 1:
        return torch.stack(parts, dim=dim)
    return parts


def _bridge(mean: Tensor, cov: Tensor, normalised: bool = False) -> Tensor:
    """Laplace bridge: ``mean`` ``(m, C)``, ``cov`` ``(m, C, C)`` -> probabilities ``(m, C)``;
    ``normalised``: laplace-torch's ``bridge_norm`` variance correction."""
    k = mean.shape[-1]
    total = cov.sum(dim=(1, 2)).unsqueeze(-1)
    mean = mean - cov.sum(-1) * mean.sum(-1, keepdim=True) / total
    cov = cov - torch.einsum("bi,bj->bij", cov.sum(-1), cov.sum(-2)) / total.unsqueeze(-1)
    var = torch.diagonal(cov, dim1=1, dim2=2)
    if normalised:
        scale = var.mean(dim=1, keepdim=True) / math.sqrt(k / 2)
        mean, var = mean / scale.sqrt(), var / scale
    sum_exp = torch.exp(-mean).sum(dim=1, keepdim=True)
    alpha = (1 - 2 / k + mean.exp() / k**2 * sum_exp) / var
    return torch.nan_to_num(alpha / alpha.sum(dim=1, keepdim=True), nan=1.0)


def _softmax(samples: Tensor) -> Tensor:
    """Softmax over the class dim of one sample's draws ``(S, C, *spatial)``."""
    return torch.softmax(samples, dim=1)


def _per_sample(
    samples: Tensor | list[Tensor], fn: Callable[[Tensor], Tensor], batched: bool = True
) -> Tensor | list[Tensor]:
    """``fn`` on each sample's draws ``(S, *out)``; a stacked ``(S, N, *out)`` gives the results
    stacked along dim 0 (``batched``: ``fn`` reduces the draws) or dim 1 (it keeps them)."""
    if isinstance(samples, list):
        return [fn(s) for s in samples]
    parts = [fn(samples[:, i]) for i in range(samples.shape[1])]
    return torch.stack(parts, dim=0 if batched else 1)
