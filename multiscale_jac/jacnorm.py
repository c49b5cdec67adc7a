"""The Jacobian-norm regulariser ``S(theta) = sum_i sum_o sum_{p in subset} J_iop^2`` and its
exact gradient, computed chunk by chunk so that memory does not grow with the number of samples.

Gradient: with ``g_io = grad_theta f_o(x_i)`` and ``M`` the 0/1 mask of the selected entries,
``S = sum_io |M g_io|^2`` and ``grad S = 2 sum_io H_io (M g_io)``, one Hessian-vector product
per output row (forward-over-reverse: ``jvp`` of ``grad``), with ``H_io`` the Hessian of
``f_o(x_i)`` w.r.t. *all* parameters. (The second seed thread's last rewrite,
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

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, jvp, vmap

from ._checks import (
    check_bool,
    check_chunk_size,
    check_generator,
    check_model,
    check_output_fn,
    check_positive_int,
    check_train_mode_layers,
)
from ._distributed import Reducer
from .adapter import PerSampleFunction
from .enums import (
    BatchNormPolicy,
    Estimator,
    FallbackWarning,
    JacNormMethod,
    Randomness,
    parse_enum,
)
from .layerwise import LayerwisePlan, NotLayerwiseError, batched_run, plan_layers
from .packing import PackedBatch, pack
from .subset import ParamSubset, resolve_subset

__all__ = ["jacobian_sq_norm", "jacobian_sq_norm_backward"]

#: per-sample gradients a layer-wise chunk keeps in its graph, at most (default chunk size)
_LAYERWISE_BYTES = 16 * 2**20


def jacobian_sq_norm(
    model: nn.Module,
    inputs: Any,
    *,
    params: ParamSubset | str | list[str] | None = None,
    output_fn: Callable[[Any], Any] | None = None,
    method: str | JacNormMethod = "auto",
    chunk_size: int | None = None,
    estimator: str | Estimator = "exact",
    num_probes: int | None = None,
    generator: torch.Generator | None = None,
    batch_norm: str | BatchNormPolicy = "error",
    accumulate_grad: bool = False,
    scale: float = 1.0,
    strict: bool = False,
    process_group: Any = None,
) -> Tensor:
    """``S(theta) = sum_i sum_o sum_p J_iop^2`` over the selected entries ``p``, differentiable.

    ``(task_loss + lam * S).backward()`` adds ``lam * grad S`` (exact, w.r.t. every parameter
    of ``model`` that requires grad) into ``.grad``; the backward recomputes per chunk of
    ``chunk_size`` samples, so memory is bounded whatever the number of samples.

    Args:
        model: Any ``nn.Module`` (never changed).
        inputs: Anything :func:`~multiscale_jac.pack` accepts.
        params: The entries ``p`` summed over (a :class:`ParamSubset`, names or globs).
        output_fn: Applied to the model's output (batch dim of one kept) before flattening.
        method: ``auto``, ``layerwise`` or ``hvp`` (see :class:`JacNormMethod`).
        chunk_size: Samples per batched run (``layerwise``; default: as many as keep the
            chunk's per-sample gradients under 64 MiB) or per vectorised call (``hvp``;
            default 16).
        estimator: ``exact`` or ``hutchinson``.
        num_probes: Probes per sample for ``hutchinson`` (default 8).
        generator: Seeds the probes (drawn once, so value and gradient use the same ones).
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.
        accumulate_grad: Compute value and gradient in one pass now and add
            ``scale * grad S`` into ``.grad``; the returned value is then detached.
        scale: The factor of the accumulated gradient (``accumulate_grad=True`` only).
        strict: Raise instead of falling back from ``layerwise`` to ``hvp`` at run time.
        process_group: ``accumulate_grad=True`` only. With ``torch.distributed`` initialised,
            ``inputs`` are this rank's samples; ``S`` and its gradient are summed over the
            ranks (one all-reduce) before the gradient is added, so every rank gets the result
            over all ranks' samples (``None``: the default group).

    Returns:
        A 0-d tensor.
    """
    if not isinstance(accumulate_grad, bool):
        raise TypeError(f"accumulate_grad must be a bool; got {type(accumulate_grad).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number; got {type(scale).__name__}")
    job = _Job.build(
        model,
        inputs,
        params,
        output_fn,
        method,
        chunk_size,
        estimator,
        num_probes,
        generator,
        batch_norm,
    )
    job.strict = check_bool(strict, "strict") or job.requested is JacNormMethod.LAYERWISE
    if not accumulate_grad:
        if process_group is not None:
            raise ValueError("process_group needs accumulate_grad=True (jacobian_sq_norm_backward)")
        return _SqNorm.apply(job, *job.trainable.values())
    reducer = Reducer(process_group)
    value, grads = job.run(with_grad=True)
    reducer.sum_([value, *grads.values()])
    for name, p in job.trainable.items():
        g = (grads[name] * scale).to(p.dtype)
        p.grad = g if p.grad is None else p.grad + g
    return value


def jacobian_sq_norm_backward(
    model: nn.Module, inputs: Any, *, scale: float = 1.0, **options: Any
) -> Tensor:
    """Compute ``S`` and add ``scale * grad S`` into every trainable parameter's ``.grad``,
    chunk by chunk (each chunk's work freed before the next); returns ``S`` (detached).

    ``options`` are :func:`jacobian_sq_norm`'s keywords. For training loops with many samples:
    equivalent to ``(scale * jacobian_sq_norm(...)).backward()`` in one pass over the data.
    """
    return jacobian_sq_norm(model, inputs, accumulate_grad=True, scale=scale, **options)


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
    """Everything one evaluation needs: the function, the data and the probes."""

    def __init__(self) -> None:
        self.fn: PerSampleFunction
        self.packed: PackedBatch
        self.trainable: dict[str, Tensor]
        self.mask: dict[str, Tensor]
        self.chunk = 16
        self.probes: dict[int, Tensor] | None = None
        #: outputs per sample of every bucket, keyed by its first sample
        self.outputs: dict[int, int] = {}
        self.method = JacNormMethod.HVP
        self.plan: LayerwisePlan | None = None
        self.notes: list[str] = []
        self.checked = False
        self.strict = False
        self.requested = JacNormMethod.AUTO

    @classmethod
    def build(
        cls,
        model: nn.Module,
        inputs: Any,
        params: Any,
        output_fn: Any,
        method: Any,
        chunk_size: Any,
        estimator: Any,
        num_probes: Any,
        generator: Any,
        batch_norm: Any,
    ) -> _Job:
        model = check_model(model)
        output_fn = check_output_fn(output_fn)
        chunk = check_chunk_size(chunk_size)
        method = parse_enum(JacNormMethod, method, "method")
        requested = method
        est = parse_enum(Estimator, estimator, "estimator")
        policy = parse_enum(BatchNormPolicy, batch_norm, "batch_norm")
        if num_probes is not None:
            num_probes = check_positive_int(num_probes, "num_probes")
            if est is Estimator.EXACT:
                raise ValueError("num_probes is only used with estimator='hutchinson'")
        generator = check_generator(generator)
        job = cls()
        job.packed = inputs if isinstance(inputs, PackedBatch) else pack(inputs)
        subset = resolve_subset(params, model)
        eval_bn = check_train_mode_layers(model, policy, Randomness.ERROR)
        job.fn = PerSampleFunction(
            model, ParamSubset.all(model), job.packed.kind, output_fn, eval_batch_norm=eval_bn
        )
        job.packed = job.packed.to(job.fn.device)
        job.chunk = chunk or 16
        named = dict(model.named_parameters())
        job.requested = requested
        job.method, job.plan = job._choose(model, subset, method, eval_bn)
        if job.method is JacNormMethod.LAYERWISE:
            # the chunk's per-sample gradients (kept by the graph) stay under 16 MiB: measured,
            # a smaller chunk costs no time and a larger one costs memory
            job.chunk = chunk or max(1, _LAYERWISE_BYTES // (4 * max(1, subset.numel)))
        job.trainable = {n: p for n, p in named.items() if p.requires_grad}
        job.mask = {}
        for name, t in subset.embed(
            torch.ones(subset.numel, dtype=named[subset.names[0]].dtype)
        ).items():
            job.mask[name] = t.to(named[name].device)
        job.outputs = {b.indices[0]: job._outputs(b.indices[:1]) for b in job.packed.buckets()}
        if est is Estimator.HUTCHINSON:
            k = num_probes or 8
            job.probes = {}
            for b in job.packed.buckets():
                o = job.outputs[b.indices[0]]
                for i in b.indices:
                    u = torch.randint(0, 2, (k, o), generator=generator).to(
                        named[subset.names[0]].dtype
                    )
                    job.probes[i] = (2 * u - 1).to(job.fn.device)
        return job

    def _choose(
        self, model: nn.Module, subset: ParamSubset, method: JacNormMethod, eval_bn: bool
    ) -> tuple[JacNormMethod, LayerwisePlan | None]:
        if method is JacNormMethod.HVP:
            return method, None
        try:
            plan = plan_layers(model, subset, eval_batch_norm=eval_bn)
            plan.require_all()
        except NotLayerwiseError as err:
            if method is JacNormMethod.LAYERWISE:
                raise ValueError(f"jacobian_sq_norm(method='layerwise'): {err}") from err
            self.notes.append(f"hvp: {err}")
            return JacNormMethod.HVP, None
        return JacNormMethod.LAYERWISE, plan

    def _outputs(self, idx: list[int]) -> int:
        levels = tuple(t[0] for t in self.packed.stack(idx))
        with torch.no_grad():
            return int(self.fn.call(self.fn.params, levels).numel())

    def run(self, *, with_grad: bool) -> tuple[Tensor, dict[str, Tensor]]:
        """``S`` and (optionally) ``grad S`` w.r.t. every parameter, summed over chunks."""
        if self.method is JacNormMethod.LAYERWISE:
            try:
                return self._run_layerwise(with_grad)
            except NotLayerwiseError as err:
                if self.strict:
                    raise ValueError(f"jacobian_sq_norm(method='layerwise'): {err}") from err
                msg = f"layer-wise closed forms failed ({err}); falling back to hvp"
                warnings.warn(msg, FallbackWarning, stacklevel=4)
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
        for b in self.packed.buckets():
            for s in range(0, len(b.indices), self.chunk):
                idx = b.indices[s : s + self.chunk]
                lv, out, run = batched_run(
                    self.fn,
                    self.packed.stack(idx),
                    self.plan,
                    create_graph=with_grad,
                    check=not self.checked,
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

        for b in self.packed.buckets():
            o = self.outputs[b.indices[0]]
            eye = torch.eye(o, dtype=value.dtype, device=value.device)
            for s in range(0, len(b.indices), self.chunk):
                idx = b.indices[s : s + self.chunk]
                levels = self.packed.stack(idx)
                if self.probes is None:
                    us = eye.expand(len(idx), o, o)
                else:
                    us = torch.stack([self.probes[i] for i in idx])
                with torch.no_grad():
                    vals, hvs = vmap(per_sample)(us, *levels)
                value = value + vals.sum()
                for n, h in hvs.items():
                    grads[n] += h.sum(0)
        return value, grads
