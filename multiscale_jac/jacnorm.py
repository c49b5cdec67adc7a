"""The Jacobian-norm regulariser ``S(theta) = sum_i sum_o sum_{p in subset} J_iop^2`` and its
exact gradient, computed chunk by chunk so that memory does not grow with the number of samples.

Gradient: with ``g_io = grad_theta f_o(x_i)`` and ``M`` the 0/1 mask of the selected entries,
``S = sum_io |M g_io|^2`` and ``grad S = 2 sum_io H_io (M g_io)``, one Hessian-vector product
per output row (forward-over-reverse: ``jvp`` of ``grad``), with ``H_io`` the Hessian of
``f_o(x_i)`` w.r.t. *all* parameters. (A tempting shortcut,
``[sum_i d/dtheta_p (df/dtheta_p)^2]_p``, keeps only the diagonal ``H_pp`` terms; that is not the
gradient of ``S``.)

Hutchinson: with ``K`` random output-space probes ``u`` (Rademacher, ``E[u u^T] = I``),
``S_hat = sum_i 1/K sum_k |M grad (u_k . f(x_i))|^2`` is unbiased for ``S``; its gradient is the
gradient of ``S_hat`` (the same products with ``u_k . f`` as the output).

:func:`jacobian_sq_norm` returns ``S`` as a scalar whose ``backward()`` runs the chunked
gradient (a custom autograd function: nothing of the forward is kept but the inputs);
:func:`jacobian_sq_norm_backward` does both at once and adds into ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, jvp, vmap

from ._checks import (
    Prepared,
    check_bool,
    check_chunk_size,
    check_generator,
    check_memory_budget,
    check_positive_int,
    prepare,
    warn_fallback,
)
from ._distributed import Reducer
from ._planning import measure
from ._stream import with_progress
from .enums import (
    BatchNormPolicy,
    Estimator,
    InputKind,
    JacNormMethod,
    MemoryBudgetError,
    Randomness,
    parse_enum,
)
from .layerwise import LayerwisePlan, NotLayerwiseError, batched_run, plan_layers
from .subset import ParamSubset

__all__ = ["jacobian_sq_norm", "jacobian_sq_norm_backward"]

#: per-sample gradients a layer-wise chunk keeps in its graph, at most (default chunk size)
_LAYERWISE_BYTES = 16 * 2**20
#: samples per vectorised call of the ``hvp`` route by default
_HVP_CHUNK = 16


def jacobian_sq_norm(
    model: nn.Module,
    inputs: Any,
    *,
    params: ParamSubset | str | list[str] | None = None,
    output_fn: Callable[[Any], Any] | None = None,
    input_kind: str | InputKind | None = None,
    method: str | JacNormMethod = "auto",
    estimator: str | Estimator = "exact",
    num_probes: int | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    randomness: str | Randomness = "error",
    batch_norm: str | BatchNormPolicy = "error",
    strict: bool = False,
    progress: bool = False,
    generator: torch.Generator | None = None,
    accumulate_grad: bool = False,
    scale: float = 1.0,
    process_group: Any = None,
) -> Tensor:
    """``S(theta) = sum_i sum_o sum_p J_iop^2`` over the selected entries ``p``, differentiable.

    ``(task_loss + lam * S).backward()`` adds ``lam * grad S`` (exact, w.r.t. every parameter
    of ``model`` that requires grad) into ``.grad``; the backward recomputes per chunk of
    ``chunk_size`` samples, so memory is bounded whatever the number of samples. Options shared
    with the other entry points mean the same everywhere (the options table in
    ``docs/design.md``).

    Args:
        model: Any ``nn.Module`` (never changed).
        inputs: Anything :func:`~multiscale_jac.pack` accepts.
        params: The entries ``p`` summed over (a :class:`ParamSubset`, names or globs).
        output_fn: Applied to the model's output (batch dim of one kept) before flattening.
        input_kind: How to read ``inputs`` where it is ambiguous (:func:`~multiscale_jac.pack`).
        method: ``auto``, ``layerwise`` or ``hvp`` (see :class:`~multiscale_jac.JacNormMethod`).
        estimator: ``exact`` or ``hutchinson``.
        num_probes: Probes per sample for ``hutchinson`` (default 8).
        chunk_size: Samples per batched run (``layerwise``; default: as many as keep the
            chunk's per-sample gradients under 16 MiB) or per vectorised call (``hvp``;
            default 16).
        memory_budget: Bytes of the working set (the gradient included); picks the chunks.
        randomness: ``error``, ``different`` or ``same``, as in ``torch.func.vmap``. With
            dropout in train mode, ``different`` runs the layer-wise route, where the value and
            its gradient see the same masks (the backward restores the random state of the
            forward); the ``hvp`` route and ``same`` need a deterministic model.
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.
        strict: Raise instead of falling back from ``layerwise`` to ``hvp`` at run time.
        progress: A tqdm bar over the chunks when a terminal is attached.
        generator: Seeds the probes (drawn once, so value and gradient use the same ones).
        accumulate_grad: Compute value and gradient in one pass now and add
            ``scale * grad S`` into ``.grad``; the returned value is then detached.
        scale: The factor of the accumulated gradient (only with ``accumulate_grad=True``;
            otherwise multiply the returned value).
        process_group: ``accumulate_grad=True`` only: ``inputs`` are this rank's samples,
            and ``S`` and its gradient are summed over the ranks before the gradient is added.

    Returns:
        A 0-d tensor.
    """
    accumulate_grad = _check_accumulate(accumulate_grad, scale, process_group)
    prep = prepare(
        model,
        inputs,
        params=params,
        output_fn=output_fn,
        batch_norm=batch_norm,
        randomness=randomness,
        input_kind=input_kind,
    )
    job = _Job(
        prep,
        method=parse_enum(JacNormMethod, method, "method"),
        estimator=parse_enum(Estimator, estimator, "estimator"),
        num_probes=num_probes,
        chunk_size=check_chunk_size(chunk_size),
        memory_budget=check_memory_budget(memory_budget),
        strict=check_bool(strict, "strict"),
        progress=check_bool(progress, "progress"),
        generator=check_generator(generator),
    )
    if not accumulate_grad:
        return _SqNorm.apply(job, *job.trainable.values())
    reducer = Reducer(process_group)
    value, grads = job.run(with_grad=True)
    reducer.sum_([value, *grads.values()])
    for name, p in job.trainable.items():
        g = (grads[name] * scale).to(p.dtype)
        p.grad = g if p.grad is None else p.grad + g
    return value


def jacobian_sq_norm_backward(
    model: nn.Module,
    inputs: Any,
    *,
    params: ParamSubset | str | list[str] | None = None,
    output_fn: Callable[[Any], Any] | None = None,
    input_kind: str | InputKind | None = None,
    method: str | JacNormMethod = "auto",
    estimator: str | Estimator = "exact",
    num_probes: int | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    randomness: str | Randomness = "error",
    batch_norm: str | BatchNormPolicy = "error",
    strict: bool = False,
    progress: bool = False,
    generator: torch.Generator | None = None,
    scale: float = 1.0,
    process_group: Any = None,
) -> Tensor:
    """Compute ``S`` and add ``scale * grad S`` into every trainable parameter's ``.grad``,
    chunk by chunk (each chunk's work freed before the next); returns ``S`` (detached).

    The arguments mean what they mean for :func:`jacobian_sq_norm` (this is
    ``jacobian_sq_norm(..., accumulate_grad=True)``). For training loops with many samples:
    equivalent to ``(scale * jacobian_sq_norm(...)).backward()`` in one pass over the data.
    """
    return jacobian_sq_norm(
        model,
        inputs,
        params=params,
        output_fn=output_fn,
        input_kind=input_kind,
        method=method,
        estimator=estimator,
        num_probes=num_probes,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
        randomness=randomness,
        batch_norm=batch_norm,
        strict=strict,
        progress=progress,
        generator=generator,
        accumulate_grad=True,
        scale=scale,
        process_group=process_group,
    )


def _check_accumulate(accumulate_grad: Any, scale: Any, process_group: Any) -> bool:
    accumulate_grad = check_bool(accumulate_grad, "accumulate_grad")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number; got {scale!r}")
    if not accumulate_grad and scale != 1.0:
        raise ValueError(
            f"scale={scale!r} only applies with accumulate_grad=True; multiply the returned "
            "value instead"
        )
    if not accumulate_grad and process_group is not None:
        raise ValueError("process_group needs accumulate_grad=True (jacobian_sq_norm_backward)")
    return accumulate_grad


class _SqNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, job: _Job, *leaves: Tensor) -> Tensor:  # type: ignore[override]
        ctx.job = job
        value, _ = job.run(with_grad=False)
        return value

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple:  # type: ignore[override]
        _, grads = ctx.job.run(with_grad=True)
        return (None, *(g * grads[name] for name in ctx.job.trainable))


class _Job:
    """Everything one evaluation needs: the function, the data, the route and the probes."""

    def __init__(
        self,
        prep: Prepared,
        *,
        method: JacNormMethod,
        estimator: Estimator,
        num_probes: int | None,
        chunk_size: int | None,
        memory_budget: int | None,
        strict: bool,
        progress: bool,
        generator: torch.Generator | None,
    ) -> None:
        if num_probes is not None:
            num_probes = check_positive_int(num_probes, "num_probes")
            if estimator is Estimator.EXACT:
                raise ValueError("num_probes is only used with estimator='hutchinson'")
        self.packed = prep.packed
        self.subset = prep.subset
        self.randomness = prep.randomness
        self.fn = prep.function(self.packed, subset=ParamSubset.all(prep.model))
        self.devices = [self.fn.device] if self.fn.device.type == "cuda" else []
        self.requested = method
        self.strict = strict or method is JacNormMethod.LAYERWISE
        self.progress = progress
        self.notes: list[str] = []
        self.checked = False
        self.method, self.plan = self._choose(prep, method)
        named = dict(prep.model.named_parameters())
        self.trainable = {n: p for n, p in named.items() if p.requires_grad}
        dtype = named[self.subset.names[0]].dtype
        ones = torch.ones(self.subset.numel, dtype=dtype)
        self.mask = {n: t.to(named[n].device) for n, t in self.subset.embed(ones).items()}
        #: outputs per sample of every bucket, keyed by its first sample
        self.outputs = {b.indices[0]: self._outputs(b.indices[:1]) for b in self.packed.buckets()}
        self.chunk = self._chunk(chunk_size, memory_budget, dtype)
        self.probes = None
        if estimator is Estimator.HUTCHINSON:
            self.probes = self._probes(num_probes or 8, generator, dtype)
        # the backward's recomputation draws the forward's random masks
        self.rng_state: tuple[Tensor, Tensor | None] | None = None
        if self.randomness is not Randomness.ERROR:
            cuda = torch.cuda.get_rng_state(self.fn.device) if self.devices else None
            self.rng_state = (torch.get_rng_state(), cuda)

    def _choose(
        self, prep: Prepared, method: JacNormMethod
    ) -> tuple[JacNormMethod, LayerwisePlan | None]:
        random = self.randomness is not Randomness.ERROR
        if method is JacNormMethod.HVP:
            if random:
                raise ValueError(
                    f"jacobian_sq_norm(method='hvp') needs a deterministic model; with "
                    f"randomness={self.randomness.value!r} use method='layerwise' or 'auto'"
                )
            return method, None
        try:
            if self.randomness is Randomness.SAME:
                raise NotLayerwiseError(
                    "randomness='same' (one mask for all samples) has no batched layer-wise run"
                )
            plan = plan_layers(prep.model, self.subset, eval_batch_norm=prep.eval_batch_norm)
            plan.require_all()
        except NotLayerwiseError as err:
            if method is JacNormMethod.LAYERWISE or random:
                raise ValueError(f"jacobian_sq_norm(method='layerwise'): {err}") from err
            self.notes.append(f"hvp: {err}")
            return JacNormMethod.HVP, None
        return JacNormMethod.LAYERWISE, plan

    def _chunk(self, chunk_size: int | None, budget: int | None, dtype: torch.dtype) -> int:
        """Samples per chunk: ``chunk_size``, else what ``memory_budget`` allows (checked
        against one sample's measured working set), else the route's default."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = sum(p.numel() for p in self.trainable.values())
        rows = max(self.outputs.values())
        if self.method is JacNormMethod.LAYERWISE:
            default = max(1, _LAYERWISE_BYTES // (4 * max(1, self.subset.numel)))
        else:
            default = _HVP_CHUNK
        if budget is None:
            return chunk_size or default
        kept = 2 * numel * itemsize  # the gradient and its chunk's part
        levels = tuple(self.packed.sample(self.packed.largest_sample))
        activations = measure(self.fn, self.fn.values(), levels).activations
        if self.method is JacNormMethod.LAYERWISE:
            one = 3 * activations + 2 * self.subset.numel * itemsize
        else:
            one = rows * (activations + 2 * numel * itemsize)
        if kept + one > budget:
            raise MemoryBudgetError(
                budget,
                kept + one,
                f"the gradient of {numel} parameters takes {kept} bytes and one sample's "
                f"{self.method.value} pass about {one}",
            )
        return chunk_size or max(1, (budget - kept) // one)

    def _probes(
        self, k: int, generator: torch.Generator | None, dtype: torch.dtype
    ) -> dict[int, Tensor]:
        probes = {}
        for b in self.packed.buckets():
            o = self.outputs[b.indices[0]]
            for i in b.indices:
                u = torch.randint(0, 2, (k, o), generator=generator).to(dtype)
                probes[i] = (2 * u - 1).to(self.fn.device)
        return probes

    def _outputs(self, idx: list[int]) -> int:
        levels = tuple(t[0] for t in self.packed.stack(idx))
        with torch.no_grad(), torch.random.fork_rng(devices=self.devices):
            return int(self.fn.call(self.fn.params, levels).numel())

    def _chunks(self) -> list[tuple[int, list[int]]]:
        """``(first sample of the bucket, chunk's samples)`` for every chunk."""
        return [
            (b.indices[0], b.indices[s : s + self.chunk])
            for b in self.packed.buckets()
            for s in range(0, len(b.indices), self.chunk)
        ]

    def run(self, *, with_grad: bool) -> tuple[Tensor, dict[str, Tensor]]:
        """``S`` and (optionally) ``grad S`` w.r.t. every parameter, summed over chunks."""
        with torch.random.fork_rng(devices=self.devices, enabled=self.rng_state is not None):
            if self.rng_state is not None:
                torch.set_rng_state(self.rng_state[0])
                if self.rng_state[1] is not None:
                    torch.cuda.set_rng_state(self.rng_state[1], self.fn.device)
            if self.method is JacNormMethod.LAYERWISE:
                try:
                    return self._run_layerwise(with_grad)
                except NotLayerwiseError as err:
                    if self.strict or self.rng_state is not None:
                        raise ValueError(f"jacobian_sq_norm(method='layerwise'): {err}") from err
                    msg = f"layer-wise closed forms failed ({err}); ran hvp"
                    warn_fallback([msg])
                    self.notes.append(msg)
                    self.method = JacNormMethod.HVP
            return self._run_hvp(with_grad)

    def _run_layerwise(self, with_grad: bool) -> tuple[Tensor, dict[str, Tensor]]:
        """Per chunk: batched forward, one backward per output row / probe with the layer-wise
        hooks (``create_graph`` for the gradient), ``S_chunk``, then its backward."""
        if self.plan is None:  # not reachable: method is layerwise only with a plan
            raise NotLayerwiseError("no layer-wise plan")
        params = list(self.trainable.values())
        value = params[0].new_zeros(()) if params else torch.zeros(())
        grads = {n: torch.zeros_like(p) for n, p in self.trainable.items()} if with_grad else {}
        chunks = self._chunks()
        for _, idx in with_progress(chunks, self.progress, "jacobian_sq_norm", len(chunks)):
            lv, out, run = batched_run(
                self.fn,
                self.packed.stack(idx),
                self.plan,
                create_graph=with_grad,
                check=not self.checked,
                random=self.rng_state is not None,
            )
            self.checked = True
            with torch.enable_grad():
                flat = out.reshape(out.shape[0], -1)
                if self.probes is None:
                    objectives = [(flat[:, o].sum(), 1.0) for o in range(flat.shape[1])]
                else:
                    us = torch.stack([self.probes[i] for i in idx])  # (n, K, O)
                    k = us.shape[1]
                    objectives = [((flat * us[:, j]).sum(), 1.0 / k) for j in range(k)]
                sums = run.backward(objectives, lv)
                part = sum((sums[n] * self.mask[n]).sum() for n in self.mask)
                if with_grad and params:
                    got = torch.autograd.grad(part, params, allow_unused=True)
                    for (n, _), g in zip(self.trainable.items(), got):
                        if g is not None:
                            grads[n] += g
            value = value + part.detach()
        return value, grads

    def _run_hvp(self, with_grad: bool) -> tuple[Tensor, dict[str, Tensor]]:
        base = self.fn.params
        fn, mask = self.fn, self.mask
        value = next(iter(base.values())).new_zeros(())
        grads = {n: torch.zeros_like(p) for n, p in base.items()} if with_grad else {}

        def out_dot(p: dict[str, Tensor], u: Tensor, levels: tuple[Tensor, ...]) -> Tensor:
            return (fn.call(p, levels) * u).sum()

        def one(u: Tensor, levels: tuple[Tensor, ...]) -> tuple[Tensor, dict[str, Tensor]]:
            g = grad(out_dot)(base, u, levels)
            v = {n: g[n] * mask[n] if n in mask else torch.zeros_like(g[n]) for n in g}
            val = sum((v[n] ** 2).sum() for n in mask)
            if not with_grad:
                return val, {}
            _, hv = jvp(lambda p: grad(out_dot)(p, u, levels), (base,), (v,))
            return val, {n: 2 * hv[n] for n in hv}

        def per_sample(us: Tensor, *levels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            vals, hvs = vmap(lambda u: one(u, levels))(us)
            scale = 1.0 if self.probes is None else 1.0 / us.shape[0]
            return vals.sum() * scale, {n: h.sum(0) * scale for n, h in hvs.items()}

        chunks = self._chunks()
        for first, idx in with_progress(chunks, self.progress, "jacobian_sq_norm", len(chunks)):
            o = self.outputs[first]
            levels = self.packed.stack(idx)
            if self.probes is None:
                eye = torch.eye(o, dtype=value.dtype, device=value.device)
                us = eye.expand(len(idx), o, o)
            else:
                us = torch.stack([self.probes[i] for i in idx])
            with torch.no_grad():
                vals, hvs = vmap(per_sample)(us, *levels)
            value = value + vals.sum()
            for n, h in hvs.items():
                grads[n] += h.sum(0)
        return value, grads
