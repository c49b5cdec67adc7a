"""Subnetwork Laplace and the linearised (GLM) predictive for multiscale networks.

The posterior over a :class:`~multiscale_jac.subset.ParamSubset` ``theta`` (``P`` entries,
everything else fixed at the MAP) is ``N(theta_MAP, Sigma)`` with precision

    ``P_post = H / (sigma^s T) + diag(prior_precision)``

where ``H = sum_i J_i^T Lambda_i J_i`` is accumulated over the data by :meth:`SubnetLaplace.fit`
(``J_i`` ``(O_i, P)``: the per-sample Jacobian of the outputs on the subset; ``Lambda_i``: the
Hessian of the negative log-likelihood w.r.t. the outputs at ``sigma = 1``), ``T`` the
temperature and ``s = 2`` (``s = 4`` for the empirical Fisher of a regression, whose gradients
carry ``1/sigma^2`` each). Conventions follow laplace-torch (Immer et al. 2021, Daxberger et al.
2021) so the numbers agree with it where it can run:

* classification: ``Lambda_i`` per output position is ``diag(p) - p p^T`` (softmax over dim 1
  of the model output, so vector logits ``(C,)`` and dense logits ``(C, *spatial)`` per sample);
  positions whose label is ``ignore_index`` contribute nothing; ``sigma_noise`` must be 1.
* regression: ``Lambda_i = I``; the loss is ``0.5 sum (f - y)^2``.
* ``log_marginal_likelihood = -loss / (sigma^2 T) - c - 0.5 (log det P_post - log det P_0 +
  (theta - mu_0)^T P_0 (theta - mu_0))`` with ``c = n_out log(sigma sqrt(2 pi))`` for regression
  (``n_out``: output entries seen by :meth:`~SubnetLaplace.fit`), 0 for classification.

Only a chunk of Jacobian rows is ever held (``memory_budget``): never ``N x O x P`` and never
the model's full Jacobian. Padded positions of ragged multi-level batches do not exist in the
per-sample outputs (every sample runs unpadded through the engine), so they contribute nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ._checks import (
    check_bool,
    check_chunk_size,
    check_generator,
    check_int,
    check_memory_budget,
    check_positive_int,
    check_positive_number,
    prepare,
    warn_fallback,
)
from ._distributed import Reducer
from ._likelihood import check_target, ggn_factors, nll_sum, output_gradient
from ._planning import EngineOptions
from ._stream import Capture, pair, raw_output, split_targets, with_progress
from .adapter import PerSampleFunction
from .engine import run_engine
from .enums import (
    BatchNormPolicy,
    Entries,
    HessianKind,
    InputKind,
    Likelihood,
    LinkApprox,
    MemoryBudgetError,
    PriorStructure,
    Randomness,
    parse_enum,
)
from .packing import PackedBatch
from .subset import ParamSubset

__all__ = [
    "GLMPredictive",
    "SubnetLaplace",
]


class _Block(NamedTuple):
    """Rows of one sample's Jacobian: ``out`` the outputs of the rows (classification:
    ``(C, m)``, all classes of ``m`` positions; regression: ``(rows,)``), ``jac`` ``(rows, P)``,
    ``span`` the positions (classification) or entries (regression) ``[a, b)`` covered and
    ``shape`` the sample's whole output shape (no batch dim)."""

    i: int
    out: Tensor
    jac: Tensor
    span: tuple[int, int]
    shape: torch.Size


#: default bytes for the Jacobian rows held at once (per chunk of samples or output positions)
DEFAULT_JACOBIAN_BYTES = 32 * 2**20


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


class SubnetLaplace:
    """Laplace approximation over a subset of a model's parameter entries.

    Args:
        model: Any ``nn.Module`` at its MAP; never changed (inputs: anything
            :func:`~multiscale_jac.pack` accepts).
        likelihood: ``classification`` or ``regression``.
        subset: A :class:`ParamSubset` (entries or whole tensors), a name/glob or list of them.
        prior_precision: A number, a ``(P,)`` diagonal, one value per selected tensor (a
            sequence or ``{name: value}``).
        sigma_noise: Gaussian noise scale (regression; must be 1 for classification).
        temperature: ``T``; the curvature is divided by it.
        prior_mean: A number or a ``(P,)`` vector.
        hessian: ``ggn`` (default) or ``empirical``.
        output_fn: Applied to the model's output (batch dim of one kept).
        ignore_index: Label of positions left out of dense classification.
        input_kind: How to read inputs where it is ambiguous (:func:`~multiscale_jac.pack`).
        chunk_size: Samples per engine call (default: as many as the Jacobian rows allow).
        memory_budget: Bytes of the working set of :meth:`fit` and :meth:`predictive`,
            including the ``(P, P)`` curvature and its factor. Samples are taken in chunks and
            a sample whose Jacobian rows do not fit in slices of its output positions. Default:
            32 MiB of Jacobian rows at a time and the engine's default working set.
        randomness: ``error``, ``different`` or ``same``, as in ``torch.func.vmap``; the
            outputs and Jacobians of a sample come from one pass (one set of masks).
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.
        strict: Raise instead of letting the engine fall back to another strategy.
        entries: How the engine forms single-entry columns (``auto``, ``structured`` or
            ``generic``; see :func:`~multiscale_jac.per_sample_jacobian`).

    The options shared with the other entry points mean the same everywhere (the options table
    in ``docs/design.md``); the subset is called ``subset`` here, as in laplace-torch.

    Raises:
        TypeError, ValueError: bad arguments (the message names the value).
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: ParamSubset | str | Sequence[str],
        *,
        prior_precision: Any = 1.0,
        sigma_noise: float = 1.0,
        temperature: float = 1.0,
        prior_mean: Any = 0.0,
        hessian: str | HessianKind = "ggn",
        output_fn: Callable[[Any], Any] | None = None,
        ignore_index: int = -100,
        input_kind: str | InputKind | None = None,
        chunk_size: int | None = None,
        memory_budget: int | None = None,
        randomness: str | Randomness = "error",
        batch_norm: str | BatchNormPolicy = "error",
        strict: bool = False,
        entries: str | Entries = "auto",
    ) -> None:
        self._prep = prepare(
            model,
            params=subset,
            params_name="subset",
            output_fn=output_fn,
            batch_norm=batch_norm,
            randomness=randomness,
            input_kind=input_kind,
        )
        self.model, self.subset, self.output_fn = model, self._prep.subset, output_fn
        self.likelihood = parse_enum(Likelihood, likelihood, "likelihood")
        self.hessian = parse_enum(HessianKind, hessian, "hessian")
        self.ignore_index = check_int(ignore_index, "ignore_index")
        self.chunk_size = check_chunk_size(chunk_size)
        self.memory_budget = check_memory_budget(memory_budget)
        self.strict = check_bool(strict, "strict")
        self.entries = parse_enum(Entries, entries, "entries")
        self.mean = self.subset.flatten(self.subset.check_model(model)).detach().clone()
        self.temperature = check_positive_number(temperature, "temperature")
        self.sigma_noise = check_positive_number(sigma_noise, "sigma_noise")
        if self.likelihood is Likelihood.CLASSIFICATION and self.sigma_noise != 1.0:
            raise ValueError(f"sigma_noise must be 1 for classification; got {sigma_noise!r}")
        self.prior_mean = self._vector(prior_mean, "prior_mean", positive=False)
        self._prior_precision = self._vector(prior_precision, "prior_precision", positive=True)
        self.H: Tensor | None = None
        self.loss = 0.0
        self.n_data = 0
        self.n_outputs = 0
        self._chol: Tensor | None = None
        self._fallbacks: list[str] = []

    # ------------------------------------------------------------------ fitting
    def fit(
        self,
        data: Iterable[tuple[Any, Any]],
        *,
        progress: bool = False,
        override: bool = True,
        process_group: Any = None,
    ) -> SubnetLaplace:
        """Accumulate the subset curvature ``H`` (``(P, P)``) and the loss at the MAP.

        Args:
            data: An iterable of ``(inputs, targets)`` (a DataLoader); ``inputs`` in any form
                :func:`~multiscale_jac.pack` accepts, ``targets`` a tensor with a leading batch
                dim or a list of per-sample tensors (ragged label maps).
            progress: A tqdm bar over the batches when a terminal is attached.
            override: Start from zero (``False`` adds to a previous fit: online / continual
                learning).
            process_group: With ``torch.distributed`` initialised, every rank fits its shard of
                ``data`` and ``H``, the loss and the counts are all-reduced once at the end:
                every rank ends with the fit over all of the data (``None``: the default group).

        Returns:
            ``self``.
        """
        progress = check_bool(progress, "progress")
        override = check_bool(override, "override")
        reducer = Reducer(process_group)
        p = self.subset.numel
        previous = None if override or self.H is None else self.H
        stats = (0.0, 0, 0) if previous is None else (self.loss, self.n_data, self.n_outputs)
        # this rank's shard from zero, summed over the ranks at the end
        self.H = self.mean.new_zeros(p, p)
        self.loss, self.n_outputs = 0.0, 0
        seen = 0
        for batch in with_progress(reducer.shard(data), progress, "SubnetLaplace.fit"):
            inputs, targets = pair(batch)
            packed = self._prep.pack(inputs, finite=True)
            per_sample = [t.to(self.mean.device) for t in split_targets(targets, len(packed))]
            pending: Tensor | None = None  # empirical: a sample's gradient, over its blocks
            for block in self._jacobians(packed):
                y = check_target(
                    per_sample[block.i],
                    block.shape,
                    self.likelihood,
                    self.ignore_index,
                    seen + block.i,
                )
                g = self._accumulate(block, y)
                if g is None:
                    continue
                if pending is not None and block.span[0] == 0:  # a new sample starts
                    self.H.addr_(pending, pending)
                    pending = None
                pending = g if pending is None else pending + g
            if pending is not None:
                self.H.addr_(pending, pending)
            seen += packed.num_samples
        reducer.sum_([self.H])
        loss, seen_f, n_out = reducer.sum_numbers(
            [self.loss, float(seen), float(self.n_outputs)], self.H
        )
        if seen_f == 0:
            self.H = previous
            raise ValueError("data yielded no samples")
        if previous is not None:
            self.H += previous
        self.loss = stats[0] + loss
        self.n_data = stats[1] + int(seen_f)
        self.n_outputs = stats[2] + int(n_out)
        self._chol = None
        self._warn_fallbacks()
        return self

    def _accumulate(self, block: _Block, y: Tensor) -> Tensor | None:
        """Add one block's GGN and loss (``y``: the sample's checked, flat target); the
        empirical Fisher's gradient part is returned (its outer product is taken once a
        sample's blocks are summed)."""
        h = self._fitted()
        out, jac, (a, b) = block.out, block.jac, block.span
        regression = self.likelihood is Likelihood.REGRESSION
        y = y[a:b].to(out.dtype) if regression else y[a:b]
        valid = None if regression else y != self.ignore_index
        rows = out.reshape(1, -1) if regression else out.unsqueeze(0)
        self.loss += float(nll_sum(rows, y.unsqueeze(0), self.likelihood, 1.0, self.ignore_index))
        self.n_outputs += out.numel() if regression else 0
        if self.hessian is HessianKind.EMPIRICAL:
            return jac.T @ output_gradient(out, y, self.likelihood, valid)
        root, mixed = ggn_factors(out, jac, self.likelihood, valid)
        h.addmm_(root.T, root)
        if mixed is not None:
            h.addmm_(mixed.T, mixed, alpha=-1.0)
        return None

    # ------------------------------------------------------------------ posterior
    @property
    def prior_precision(self) -> Tensor:
        """The prior precision as a ``(P,)`` diagonal. Assign any form the constructor takes;
        the cached posterior factor is then recomputed."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: Any) -> None:
        self._prior_precision = self._vector(value, "prior_precision", positive=True)
        self._chol = None

    def _factor(self, sigma: Tensor | float) -> Tensor | float:
        """``1 / (sigma^s T)``: ``s = 4`` for a regression's empirical Fisher, else 2."""
        empirical_regression = (
            self.hessian is HessianKind.EMPIRICAL and self.likelihood is Likelihood.REGRESSION
        )
        return 1.0 / (sigma ** (4 if empirical_regression else 2) * self.temperature)

    def posterior_precision_matrix(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Tensor:
        """``P_post`` ``(P, P)`` (differentiable in tensor-valued arguments)."""
        h = self._fitted()
        prior = self._prior(prior_precision)
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        return h * self._factor(sigma) + torch.diag_embed(prior)

    @property
    def posterior_precision(self) -> Tensor:
        """``P_post`` ``(P, P)`` at the current prior precision and noise."""
        return self.posterior_precision_matrix()

    @property
    def posterior_scale(self) -> Tensor:
        """Lower Cholesky factor ``L`` of ``P_post`` (``Sigma = L^{-T} L^{-1}``), cached."""
        if self._chol is None:
            self._chol = _cholesky(self.posterior_precision)
        return self._chol

    @property
    def posterior_covariance(self) -> Tensor:
        """``Sigma = P_post^{-1}`` ``(P, P)``."""
        return torch.cholesky_inverse(self.posterior_scale)

    @property
    def posterior_variance(self) -> Tensor:
        """``diag(Sigma)`` ``(P,)``."""
        return self.posterior_covariance.diagonal()

    def log_likelihood(self, sigma_noise: Any = None) -> Tensor:
        """``log p(D | theta_MAP)`` with the temperature applied (see the module docstring)."""
        self._fitted()
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        sigma_t = torch.as_tensor(sigma, dtype=self.mean.dtype, device=self.mean.device)
        ll = -self.loss / (sigma_t**2 * self.temperature)
        if self.likelihood is Likelihood.REGRESSION:
            ll = ll - self.n_outputs * torch.log(sigma_t * math.sqrt(2 * math.pi))
        return ll

    def log_marginal_likelihood(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Tensor:
        """The Laplace approximation of ``log p(D)``; differentiable in tensor arguments.

        Args:
            prior_precision: Overrides the stored prior precision (any form the constructor
                takes; a tensor that requires grad keeps the graph).
            sigma_noise: Overrides the noise scale (regression only).
        """
        if sigma_noise is not None and self.likelihood is not Likelihood.REGRESSION:
            raise ValueError("sigma_noise can only be changed for regression")
        prior = self._prior(prior_precision)
        post = self.posterior_precision_matrix(prior, sigma_noise)
        chol = _cholesky(post)
        logdet_post = 2 * chol.diagonal().log().sum()
        logdet_prior = prior.log().sum()
        delta = self.mean - self.prior_mean
        scatter = (delta * prior) @ delta
        return self.log_likelihood(sigma_noise) - 0.5 * (logdet_post - logdet_prior + scatter)

    def optimize_prior_precision(
        self,
        method: str = "marglik",
        *,
        prior_structure: str | PriorStructure = "scalar",
        n_steps: int = 100,
        lr: float = 0.1,
        init_prior_prec: float = 1.0,
    ) -> Tensor:
        """Maximise the log marginal likelihood over the prior precision (Adam on its log).

        Args:
            method: ``marglik`` (the only one).
            prior_structure: ``scalar`` or ``tensor`` (one precision per selected tensor).
            n_steps: Adam steps.
            lr: Adam learning rate.
            init_prior_prec: Starting value.

        Returns:
            The optimised precision (scalar or one per tensor); also stored.
        """
        if method != "marglik":
            raise ValueError(f"method must be 'marglik'; got {method!r}")
        structure = parse_enum(PriorStructure, prior_structure, "prior_structure")
        n_steps = check_positive_int(n_steps, "n_steps")
        lr = check_positive_number(lr, "lr")
        init = check_positive_number(init_prior_prec, "init_prior_prec")
        self._fitted()
        k = 1 if structure is PriorStructure.SCALAR else len(self.subset.names)
        log_prec = torch.full((k,), math.log(init), dtype=self.mean.dtype, device=self.mean.device)
        log_prec.requires_grad_(True)
        opt = torch.optim.Adam([log_prec], lr=lr)
        for _ in range(n_steps):
            opt.zero_grad()
            prec = log_prec.exp()
            arg = prec[0] if structure is PriorStructure.SCALAR else prec
            loss = -self.log_marginal_likelihood(prior_precision=arg)
            loss.backward()
            opt.step()
        best = log_prec.detach().exp()
        self.prior_precision = best[0] if structure is PriorStructure.SCALAR else best
        return best[0] if structure is PriorStructure.SCALAR else best

    # ------------------------------------------------------------------ sampling / predictive
    def sample(self, n: int, *, generator: torch.Generator | None = None) -> Tensor:
        """``n`` draws ``(n, P)`` from the posterior over the subset."""
        n = check_positive_int(n, "n")
        generator = check_generator(generator)
        chol = self.posterior_scale
        z = torch.randn(n, self.subset.numel, generator=generator, dtype=self.mean.dtype)
        eps = torch.linalg.solve_triangular(chol.T, z.to(chol.device).T, upper=True).T
        return self.mean + eps

    def predictive(
        self,
        inputs: Any,
        *,
        link_approx: str | LinkApprox = "probit",
        n_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> GLMPredictive:
        """The GLM predictive at ``inputs`` (any form :func:`~multiscale_jac.pack` accepts).

        Marginal variances are ``||L^{-1} j_o||^2`` per output row ``j_o``, computed in chunks
        of rows; dense outputs never form an ``O x O`` matrix.

        Args:
            inputs: The batch.
            link_approx: ``probit``, ``mc`` or ``bridge`` (classification).
            n_samples: Joint samples for ``mc``.
            generator: Seeds ``mc``.
        """
        link = parse_enum(LinkApprox, link_approx, "link_approx")
        n_samples = check_positive_int(n_samples, "n_samples")
        generator = check_generator(generator)
        chol = self.posterior_scale
        packed = self._prep.pack(inputs)
        n = packed.num_samples
        means: list[list[Tensor]] = [[] for _ in range(n)]
        variances: list[list[Tensor]] = [[] for _ in range(n)]
        covs: list[list[Tensor]] = [[] for _ in range(n)]
        probs: list[list[Tensor]] = [[] for _ in range(n)]
        shapes: list[torch.Size] = [torch.Size()] * n
        vector = True
        for i, out, jac, _, shape in self._jacobians(packed):
            shapes[i] = shape
            v = torch.linalg.solve_triangular(chol, jac.T, upper=False)  # (P, rows)
            var = (v * v).sum(0)
            f = out.reshape(-1)
            means[i].append(f)
            variances[i].append(var)
            is_vec = len(shapes[i]) <= 1
            vector = vector and is_vec
            if is_vec:
                covs[i].append(v.T @ v)
            if self.likelihood is Likelihood.CLASSIFICATION:
                c = out.shape[0]
                logits = f.view(c, -1)
                if link is LinkApprox.PROBIT:
                    kappa = torch.rsqrt(1 + math.pi / 8 * var.view(c, -1))
                    pr = torch.softmax(kappa * logits, dim=0)
                elif link is LinkApprox.BRIDGE:
                    vc = v.view(-1, c, logits.shape[1])  # (P, C, m)
                    cov = torch.einsum("pcm,pdm->mcd", vc, vc)
                    pr = _bridge(logits.T, cov).T
                else:
                    z = torch.randn(n_samples, v.shape[0], generator=generator, dtype=v.dtype).to(
                        v.device
                    )
                    eps = torch.linalg.solve_triangular(chol.T, z.T, upper=True)  # (P, S)
                    fs = f.unsqueeze(0) + (jac @ eps).T  # (S, rows)
                    pr = torch.softmax(fs.view(n_samples, c, -1), dim=1).mean(0)
                probs[i].append(pr.reshape(-1))
        cls = self.likelihood is Likelihood.CLASSIFICATION
        mean = _stack_or_list([_join(b, s, cls) for b, s in zip(means, shapes)])
        variance = _stack_or_list([_join(b, s, cls) for b, s in zip(variances, shapes)])
        cov_out = None
        if vector and all(len(c) == 1 for c in covs):
            cov_out = _stack_or_list([c[0] for c in covs])
        prob_out = (
            _stack_or_list([_join(b, s, cls) for b, s in zip(probs, shapes)]) if cls else None
        )
        self._warn_fallbacks()
        return GLMPredictive(
            mean,
            variance,
            cov_out,
            prob_out,
            link if self.likelihood is Likelihood.CLASSIFICATION else None,
        )

    def functional_samples(
        self,
        inputs: Any,
        n_samples: int,
        *,
        linearized: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor | list[Tensor]:
        """``n_samples`` output samples per input: ``(n_samples, N, *out)`` (a list of
        ``(n_samples, *out)`` for ragged outputs).

        Args:
            linearized: ``f + J (theta_s - theta_MAP)`` (the GLM predictive); ``False`` runs the
                model with the sampled entries in place (a functional call; the model itself is
                not changed).
        """
        n_samples = check_positive_int(n_samples, "n_samples")
        linearized = check_bool(linearized, "linearized")
        thetas = self.sample(n_samples, generator=generator)  # (S, P)
        packed = self._prep.pack(inputs)
        n = packed.num_samples
        cls = self.likelihood is Likelihood.CLASSIFICATION
        out: list[Tensor] = []
        if linearized:
            delta = (thetas - self.mean).T  # (P, S)
            parts: list[list[Tensor]] = [[] for _ in range(n)]
            shapes: list[torch.Size] = [torch.Size()] * n
            for block in self._jacobians(packed):
                shapes[block.i] = block.shape
                f = block.out.reshape(-1).unsqueeze(-1)
                parts[block.i].append((f + block.jac @ delta).T)  # (S, rows)
            out = [_join(p, s, cls, lead=n_samples) for p, s in zip(parts, shapes)]
        else:
            fn = self._function(packed)
            with torch.no_grad():
                for i in range(n):
                    levels = tuple(packed.sample(i))
                    rows = [
                        raw_output(fn, tuple(self.subset.split(theta).values()), levels)[0]
                        for theta in thetas
                    ]
                    out.append(torch.stack(rows))
        self._warn_fallbacks()
        return _stack_or_list(out, dim=1)

    # ------------------------------------------------------------------ internals
    def _fitted(self) -> Tensor:
        if self.H is None:
            raise RuntimeError("SubnetLaplace is not fitted: call fit(data) first")
        return self.H

    def _function(
        self, packed: PackedBatch, output_fn: Callable[[Any], Any] | None = None
    ) -> PerSampleFunction:
        return self._prep.function(
            packed, output_fn=output_fn or Capture(self.output_fn, "SubnetLaplace")
        )

    def _budget(
        self, packed: PackedBatch, shapes: list[torch.Size], options: EngineOptions
    ) -> tuple[int, int | None]:
        """Bytes of Jacobian rows held at once (3 copies of each: rows, a copy, a product) and
        the engine's ``memory_budget``, from :attr:`memory_budget`: the ``(P, P)`` curvature and
        its factor, and the engine's working set for the rows (asked of the engine itself, for
        the rows of one output position of the largest sample) must fit."""
        if self.memory_budget is None:
            return DEFAULT_JACOBIAN_BYTES, None
        p, s = self.subset.numel, self.mean.element_size()
        kept = 2 * p * p * s + 4 * p * s
        cls = self.likelihood is Likelihood.CLASSIFICATION
        i = packed.largest_sample
        least = int(shapes[i][0]) if cls else 1  # the rows of one output position
        try:  # the engine's own minimum for those rows (it plans, then refuses a 1-byte budget)
            probe = dataclasses.replace(options, memory_budget=1, strict=False)
            self._engine(packed.select([i]), _span_fn(self.output_fn, 0, 1, cls), probe)
            engine = 0
        except MemoryBudgetError as err:
            engine = err.minimum
        ours = 3 * p * s  # per row: the rows, a copy, a product
        if kept + least * ours + engine > self.memory_budget:
            raise MemoryBudgetError(
                self.memory_budget,
                kept + least * ours + engine,
                f"the curvature and its factor over P={p} entries take {kept} bytes, the "
                f"Jacobian rows of one output position {least * ours} and the engine computing "
                f"them {engine}",
            )
        # the engine's working set grows by about 3 rows per row (its result, the outputs and
        # the per-sample pieces)
        grows = 3 * (p + 1) * s
        base = max(0, engine - least * grows)
        rows = max(least, (self.memory_budget - kept - base) // (ours + grows))
        return rows * ours, self.memory_budget - kept - rows * ours

    def _jacobians(self, packed: PackedBatch) -> Iterator[_Block]:
        """The Jacobian rows of every sample with the outputs of the same pass, in sample order,
        a chunk of samples (or, for one sample above the budget, of its output positions) at a
        time."""
        fn = self._function(packed)
        values = fn.values()
        n = packed.num_samples
        with torch.no_grad():
            shapes = [raw_output(fn, values, tuple(packed.sample(i))).shape[1:] for i in range(n)]
        per_row = max(1, self.subset.numel * self.mean.element_size() * 3)
        options = EngineOptions(
            entries=self.entries,
            chunk_size=self.chunk_size,
            randomness=self._prep.randomness,
            strict=self.strict,
        )
        row_bytes, engine_budget = self._budget(packed, shapes, options)
        options = dataclasses.replace(options, memory_budget=engine_budget)
        most = self.chunk_size or n
        start = 0
        while start < n:
            stop, rows = start + 1, math.prod(shapes[start])
            while (
                stop < n
                and stop - start < most
                and (rows + math.prod(shapes[stop])) * per_row <= row_bytes
            ):
                rows += math.prod(shapes[stop])
                stop += 1
            if rows * per_row > row_bytes and stop - start == 1:  # slices of its positions
                yield from self._sliced(packed, start, shapes[start], row_bytes, options)
            else:
                idx = list(range(start, stop))
                res = self._engine(packed.select(idx), None, options)
                for k, i in enumerate(idx):
                    o = res.output_sizes[k]
                    out = self._rows(res.outputs[k, :o], shapes[i])
                    yield _Block(i, out, res.jacobian[k, :o], (0, out.shape[-1]), shapes[i])
            start = stop

    def _rows(self, flat: Tensor, shape: torch.Size) -> Tensor:
        """A sample's flat outputs as block rows: ``(C, positions)`` or ``(entries,)``."""
        if self.likelihood is Likelihood.CLASSIFICATION:
            if len(shape) == 0:
                raise ValueError("classification needs logits with a class dim; got a scalar")
            return flat.reshape(shape[0], -1)
        return flat.reshape(-1)

    def _sliced(
        self,
        packed: PackedBatch,
        i: int,
        shape: torch.Size,
        row_bytes: int,
        options: EngineOptions,
    ) -> Iterator[_Block]:
        one = packed.select([i])
        cls = self.likelihood is Likelihood.CLASSIFICATION
        width = math.prod(shape[1:]) if cls else math.prod(shape)
        per_row = max(1, self.subset.numel * self.mean.element_size() * 3)
        step = max(1, row_bytes // (per_row * (shape[0] if cls else 1)))
        for a in range(0, width, step):
            b = min(width, a + step)
            res = self._engine(one, _span_fn(self.output_fn, a, b, cls), options)
            rows = res.output_sizes[0]
            out = self._rows(res.outputs[0, :rows], shape)
            yield _Block(i, out, res.jacobian[0, :rows], (a, b), shape)

    def _engine(
        self,
        packed: PackedBatch,
        output_fn: Callable[[Any], Any] | None,
        options: EngineOptions,
    ) -> Any:
        fn = self._prep.function(packed, output_fn=output_fn or self.output_fn)
        res = run_engine(fn, packed, options)
        self._fallbacks.append(res.fallback or "")
        return res

    def _warn_fallbacks(self) -> None:
        fallbacks, self._fallbacks = self._fallbacks, []
        warn_fallback(fallbacks)

    def _vector(self, value: Any, what: str, positive: bool) -> Tensor:
        """A number, ``(P,)``, one value per selected tensor (sequence or dict) -> ``(P,)``."""
        p, names = self.subset.numel, self.subset.names
        dtype, device = self.mean.dtype, self.mean.device
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in names]
            missing = [k for k in names if k not in value]
            if unknown or missing:
                raise ValueError(
                    f"{what}: keys must be the selected tensors {list(names)}; unknown "
                    f"{unknown}, missing {missing}"
                )
            value = [value[k] for k in names]
        if isinstance(value, bool) or not isinstance(value, (int, float, Tensor, list, tuple)):
            raise TypeError(f"{what} must be a number, a tensor or a sequence; got {value!r}")
        t = (
            torch.as_tensor(value, dtype=dtype, device=device)
            if not isinstance(value, Tensor)
            else value.to(dtype=dtype, device=device)
        )
        if t.dim() == 0:
            vec = t.expand(p)
        elif t.dim() == 1 and t.numel() == p:
            vec = t
        elif t.dim() == 1 and t.numel() == len(names):
            sizes = [b - a for a, b in self.subset.offsets.values()]
            vec = self.subset.to_flat_order(
                torch.repeat_interleave(t, torch.tensor(sizes, device=device))
            )
        else:
            raise ValueError(
                f"{what} must be a number, P={p} values or one per selected tensor "
                f"({len(names)}); got shape {tuple(t.shape)}"
            )
        if positive and not bool((vec.detach() > 0).all()):
            raise ValueError(f"{what} must be positive; got {value!r}")
        return vec

    def _prior(self, prior_precision: Any) -> Tensor:
        if prior_precision is None:
            return self._prior_precision
        return self._vector(prior_precision, "prior_precision", positive=True)

    def __repr__(self) -> str:
        fitted = f"fitted on {self.n_data} samples" if self.H is not None else "not fitted"
        return (
            f"SubnetLaplace(likelihood={self.likelihood.value!r}, P={self.subset.numel}, "
            f"hessian={self.hessian.value!r}, {fitted})"
        )


# ---------------------------------------------------------------------- helpers
def _cholesky(mat: Tensor) -> Tensor:
    chol, info = torch.linalg.cholesky_ex(mat)
    if int(info) != 0:
        raise ValueError(
            "the posterior precision is not positive definite (leading minor "
            f"{int(info)}); increase prior_precision"
        )
    return chol


def _span_fn(
    user: Callable[[Any], Any] | None, a: int, b: int, classes: bool
) -> Callable[[Any], Any]:
    """``output_fn`` keeping output positions ``[a, b)`` of every class (``classes``) or flat
    output entries ``[a, b)``."""

    def fn(out: Any) -> Tensor:
        out = user(out) if user is not None else out
        if classes:
            return out.reshape(out.shape[0], out.shape[1], -1)[:, :, a:b]
        return out.reshape(out.shape[0], -1)[:, a:b]

    return fn


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


def _bridge(mean: Tensor, cov: Tensor) -> Tensor:
    """Laplace bridge: ``mean`` ``(m, C)``, ``cov`` ``(m, C, C)`` -> probabilities ``(m, C)``."""
    k = mean.shape[-1]
    total = cov.sum(dim=(1, 2)).unsqueeze(-1)
    mean = mean - cov.sum(-1) * mean.sum(-1, keepdim=True) / total
    cov = cov - torch.einsum("bi,bj->bij", cov.sum(-1), cov.sum(-2)) / total.unsqueeze(-1)
    var = torch.diagonal(cov, dim1=1, dim2=2)
    sum_exp = torch.exp(-mean).sum(dim=1, keepdim=True)
    alpha = (1 - 2 / k + mean.exp() / k**2 * sum_exp) / var
    return torch.nan_to_num(alpha / alpha.sum(dim=1, keepdim=True), nan=1.0)
