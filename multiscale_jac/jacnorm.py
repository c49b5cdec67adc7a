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

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, jvp, vjp, vmap

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
from ._memory import (
    JACNORM_LAYERWISE_BYTES,
    JACNORM_VMAP_BYTES,
    cpu_chunk_cap,
    fit_budget,
    jacnorm_kept,
    jacnorm_sample,
    tensor_bytes,
)
from ._ops import twice_differentiable
from ._planning import (
    EngineOptions,
    even_chunk,
    measure,
    plan_key,
    subset_key,
)
from ._stream import with_progress
from ._tuning import GROWTH, Route, decided, tune
from .enums import (
    BatchNormPolicy,
    Estimator,
    InputKind,
    JacNormMethod,
    MemoryBudgetError,
    Randomness,
    Tune,
    parse_enum,
    parse_tune,
)
from .layerwise import LayerwisePlan, NotLayerwiseError, batched_run, plan_layers
from .subset import ParamSubset

__all__ = ["jacobian_sq_norm", "jacobian_sq_norm_backward"]


#: samples per vectorised call of the ``hvp`` route by default
_HVP_CHUNK = 16
#: samples per vectorised call of the ``vmap`` route by default (32 against 16, at the run's
#: default: 0.88x the time on an 8-conv CNN, 0.91x on a GELU CNN, 0.73x on a GroupNorm /
#: depthwise CNN, 0.77x on a small transformer; 2 CPU cores, torch 2.13)
_VMAP_CHUNK = 32
#: ``tune=True`` also times the ``vmap`` route at half its chunk when the chunk is at least this
_HALF_CHUNK_FROM = 8


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
    tune: str | bool | Tune = "auto",
    accumulate_grad: bool = False,
    scale: float = 1.0,
    process_group: Any = None,
) -> Tensor:
    """``S(theta) = sum_i sum_o sum_p J_iop^2`` over the selected entries ``p``, differentiable.

    ``(task_loss + lam * S).backward()`` adds ``lam * grad S`` (exact, w.r.t. every parameter
    of ``model`` that requires grad) into ``.grad``. One pass over chunks of ``chunk_size``
    samples computes value and gradient (kept for the backward in a parameter-sized buffer;
    under ``torch.no_grad()``, only the value): memory does not grow with the samples. Options shared
    with the other entry points mean the same everywhere (the options table in
    ``docs/design.md``).

    Args:
        model: Any ``nn.Module`` (never changed).
        inputs: Anything :func:`~multiscale_jac.pack` accepts.
        params: The entries ``p`` summed over (a :class:`ParamSubset`, names or globs).
        output_fn: Applied to the model's output (batch dim of one kept) before flattening.
        input_kind: How to read ``inputs`` where it is ambiguous (:func:`~multiscale_jac.pack`).
        method: ``auto``, ``layerwise``, ``vmap`` or ``hvp`` (:class:`~multiscale_jac.JacNormMethod`).
        estimator: ``exact`` or ``hutchinson``.
        num_probes: Probes per sample for ``hutchinson`` (default 8).
        chunk_size: Samples per batched run (``layerwise``; default: per-sample gradients
            under 16 MiB) or vectorised call (``vmap`` 32, ``hvp`` 16; CPU: under 32 MiB each).
        memory_budget: Bytes of the working set (the gradient included); picks the chunks.
        randomness: ``error``, ``different`` or ``same``, as in ``torch.func.vmap``; value
            and gradient see the same dropout masks (the backward restores the random state
            of the forward); ``hvp`` needs a deterministic model.
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.
        strict: Raise instead of falling back from ``layerwise`` to ``vmap`` at run time.
        progress: A tqdm bar over the chunks when a terminal is attached.
        generator: Seeds the probes (drawn once, so value and gradient use the same ones).
        tune: How ``method="auto"`` chooses (:class:`~multiscale_jac.Tune`): ``True`` times
            the methods on the job's first chunks, kept per shapes; ``auto`` runs such a kept
            choice, else ``vmap``; ``False``: ``vmap``, nothing recalled.
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
        tune=parse_tune(tune),
    )
    if not accumulate_grad:
        leaves = list(job.trainable.values())
        needs_grad = torch.is_grad_enabled() and bool(leaves)
        return _SqNorm.apply(job, needs_grad, *leaves)
    return _accumulate(job, scale, Reducer(process_group))


def _accumulate(job: _Job, scale: float, reducer: Reducer) -> Tensor:
    """``S`` (detached) after adding ``scale * grad S``, summed over the ranks, into ``.grad``."""
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
    tune: str | bool | Tune = "auto",
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
        tune=tune,
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
    """``S`` as a node of the caller's graph. Where the result will need a gradient (grad mode
    on and a parameter requiring grad), the forward computes ``S`` and ``grad S`` in the same
    pass over the chunks and keeps ``grad S`` (one parameter-sized buffer) for the backward:
    a separate value-only pass would cost about a quarter more. Otherwise only ``S``."""

    @staticmethod
    def forward(ctx, job: _Job, needs_grad: bool, *leaves: Tensor) -> Tensor:  # type: ignore[override]
        value, grads = job.run(with_grad=needs_grad)
        ctx.names = list(job.trainable)
        ctx.grads = grads
        return value

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple:  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None  # freed with the graph (a second backward: error)
        if grads is None:
            raise RuntimeError(
                "jacobian_sq_norm: the gradient was used by an earlier backward; call "
                "jacobian_sq_norm again (retain_graph does not keep it)"
            )
        return (None, None, *(g * grads[name] for name in ctx.names))


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
        tune: Tune = Tune.AUTO,
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
        #: what the choice of ``auto`` depends on (the plan cache's key)
        self.key = (
            "jacobian_sq_norm",
            (estimator, num_probes, chunk_size, memory_budget, self.randomness),
            subset_key(self.subset),
            plan_key(self.fn, self.packed, EngineOptions()),
        )
        named = dict(prep.model.named_parameters())
        self.trainable = {n: p for n, p in named.items() if p.requires_grad}
        dtype = named[self.subset.names[0]].dtype
        ones = torch.ones(self.subset.numel, dtype=dtype)
        self.mask = {n: t.to(named[n].device) for n, t in self.subset.embed(ones).items()}
        #: outputs per sample of every bucket, keyed by its first sample
        self.outputs = {b.indices[0]: self._outputs(b.indices[:1]) for b in self.packed.buckets()}
        self._sizing = (chunk_size, memory_budget, dtype)
        self._chunk_of: dict[JacNormMethod, int] = {}
        self.probes = None
        #: whether the routes are timed on the first chunk of the run (``tune=True``)
        self.trial = False
        if estimator is Estimator.HUTCHINSON:
            self.probes = self._probes(num_probes or 8, generator, dtype)
        # every pass (a timing probe, the run) draws the masks of the call's random state
        self.rng_state: tuple[Tensor, Tensor | None] | None = None
        if self.randomness is not Randomness.ERROR:
            cuda = torch.cuda.get_rng_state(self.fn.device) if self.devices else None
            self.rng_state = (torch.get_rng_state(), cuda)
        self._fit_budget()  # a budget too small for every route: raised here
        self.tuning = tune
        self.tune(tune)

    def _fit_budget(self) -> None:
        """Under ``auto``, where ``memory_budget`` leaves the chosen route no chunk, the first
        candidate it does (noted); raises :class:`MemoryBudgetError` where none fits."""
        try:
            self.chunk_for(self.method)
            return
        except MemoryBudgetError:
            if self.requested is not JacNormMethod.AUTO:
                raise
            for m in self.candidates():
                with contextlib.suppress(MemoryBudgetError):
                    self.chunk_for(m)
                    self.notes.append(
                        f"memory_budget: {self.method.value!r} does not fit it; ran {m.value!r}"
                    )
                    self.method = m
                    return
            raise

    def _choose(
        self, prep: Prepared, method: JacNormMethod
    ) -> tuple[JacNormMethod, LayerwisePlan | None]:
        """The method to run (``auto``: ``vmap``, tuned later by :meth:`tune`) and the
        layer-wise plan where there is one."""
        random = self.randomness is not Randomness.ERROR
        if method is JacNormMethod.HVP and random:
            raise ValueError(
                f"jacobian_sq_norm(method='hvp') needs a deterministic model; with "
                f"randomness={self.randomness.value!r} use method='layerwise', 'vmap' or 'auto'"
            )
        plan = None
        if method in (JacNormMethod.AUTO, JacNormMethod.LAYERWISE):
            try:
                if self.randomness is Randomness.SAME:
                    raise NotLayerwiseError(
                        "randomness='same' (one mask for all samples) has no batched layer-wise run"
                    )
                plan = plan_layers(prep.model, self.subset, eval_batch_norm=prep.eval_batch_norm)
                plan.require_all()
            except NotLayerwiseError as err:
                if method is JacNormMethod.LAYERWISE:
                    raise ValueError(f"jacobian_sq_norm(method='layerwise'): {err}") from err
                self.notes.append(f"no layer-wise route: {err}")
                plan = None
        if method is not JacNormMethod.AUTO:
            return method, plan
        return JacNormMethod.VMAP, plan

    def candidates(self) -> list[JacNormMethod]:
        """The methods ``auto`` may run here."""
        found = [JacNormMethod.LAYERWISE] if self.plan is not None else []
        found.append(JacNormMethod.VMAP)
        if self.randomness is Randomness.ERROR:
            found.append(JacNormMethod.HVP)
        return found

    def tune(self, tune: Tune) -> None:
        """``method="auto"``: the route ``tune=True`` chose before, or it times them now."""
        if self.requested is not JacNormMethod.AUTO or tune is Tune.ESTIMATE:
            return
        if (chosen := decided("jacobian_sq_norm", self.key)) is not None:
            self._take(*chosen)
            self.notes.append(f"plan: {chosen[0]}, chosen by tune=True before for these shapes")
        self.trial = chosen is None and tune is Tune.MEASURE

    def _take(self, name: str, chunk: int | None) -> None:
        self.method = JacNormMethod(name.split("/")[0])
        self._chunk_of[self.method] = chunk or self.chunk_for(self.method)

    def _try_routes(self) -> None:
        """Time each method at its chunk (``layerwise`` at most ``vmap``'s; ``vmap`` also at
        :meth:`_larger` and half its chunk) on the largest bucket's first chunk, dropped, the
        larger chunk first (ties: fewer calls); the fastest runs the job."""
        self.trial = False
        bucket = list(max(self.packed.buckets(), key=lambda b: len(b.indices)).indices)
        n, chunks = len(bucket), []
        for m in self.candidates():
            with contextlib.suppress(MemoryBudgetError):  # a method over budget: no candidate
                c = self.chunk_for(m)
                if m is JacNormMethod.LAYERWISE and self._sizing[0] is None:
                    c = min(c, self.chunk_for(JacNormMethod.VMAP))
                more = [self._larger(c, n), c, *([c // 2] if c >= _HALF_CHUNK_FROM else [])]
                chunks += [(m, min(k, n)) for k in (more if m is JacNormMethod.VMAP else [c])]
        chunks = sorted(dict.fromkeys(chunks), key=lambda r: -r[1])
        routes = [
            Route(f"{m.value}/{c}", partial(self._dropped, m, bucket[:c]), c) for m, c in chunks
        ]
        with torch.random.fork_rng(devices=self.devices):
            chosen = tune("jacobian_sq_norm", self.key, routes, self.devices, self.notes, samples=n)
        if chosen is not None:
            self._take(chosen.name, chosen.chunk)

    def _dropped(self, method: JacNormMethod, idx: list[int]) -> float | None:
        """``method`` on ``idx`` in one chunk, dropped: the samples (``None``: failed, noted)."""
        try:
            self._route(method)(True, [(idx[0], idx)])
        except (RuntimeError, NotLayerwiseError) as err:  # not a candidate after all
            self.notes.append(f"tune: {method.value} failed on the data ({err})")
            return None
        return len(idx)

    def _larger(self, chunk: int, largest: int) -> int:
        """Up to :data:`GROWTH` x ``chunk`` splitting the ``largest`` bucket evenly, within the
        route's bytes and :func:`~multiscale_jac._memory.cpu_chunk_cap`; ``chunk`` itself
        where ``chunk_size`` or ``memory_budget`` is given."""
        chunk_size, budget, dtype = self._sizing
        if chunk_size is not None or budget is not None:
            return chunk
        cap = JACNORM_VMAP_BYTES // max(1, self._row_grads_bytes(dtype))
        most = min(GROWTH * chunk, largest, cap)
        most = min(most, self._cpu_cap(JacNormMethod.VMAP, dtype) or most)
        return chunk if most <= chunk else max(chunk, even_chunk(most, largest))

    def _cpu_cap(self, method: JacNormMethod, dtype: torch.dtype) -> int | None:
        """Samples per ``vmap`` / ``hvp`` chunk under :data:`CPU_TENSOR_BYTES` for the
        largest per-sample tensor of a chunk, ``(n, rows, *shape)``: the gradients of the
        largest subset tensor (``vmap``) or parameter (``hvp``: every parameter's). ``None``
        off CPU."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        names = self.mask if method is JacNormMethod.VMAP else self.fn.params
        largest = max(self.fn.params[n].numel() for n in names)
        return cpu_chunk_cap(self.fn.device, max(self.outputs.values()) * largest, itemsize)

    def _row_grads_bytes(self, dtype: torch.dtype) -> int:
        """One sample's per-sample gradients of every output row (``vmap``'s chunk unit)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return tensor_bytes(max(self.outputs.values()) * self.subset.numel, itemsize)

    def chunk_for(self, method: JacNormMethod) -> int:
        """Samples per chunk of ``method`` (worked out once per method)."""
        if method not in self._chunk_of:
            self._chunk_of[method] = self._chunk(method, *self._sizing)
        return self._chunk_of[method]

    def _chunk(
        self, method: JacNormMethod, chunk_size: int | None, budget: int | None, dtype: torch.dtype
    ) -> int:
        """Samples per chunk: ``chunk_size``, else what ``memory_budget`` allows (checked
        against one sample's measured working set), else the route's default."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = sum(p.numel() for p in self.trainable.values())
        rows = max(self.outputs.values())
        if method is JacNormMethod.LAYERWISE:
            default = max(1, JACNORM_LAYERWISE_BYTES // (4 * max(1, self.subset.numel)))
        else:  # per-sample gradients of every row under JACNORM_VMAP_BYTES, at most the default
            per_sample = self._row_grads_bytes(dtype)
            most = _VMAP_CHUNK if method is JacNormMethod.VMAP else _HVP_CHUNK
            default = min(most, max(1, JACNORM_VMAP_BYTES // max(1, per_sample)))
            default = min(default, self._cpu_cap(method, dtype) or default)
        if budget is None:
            return chunk_size or default
        kept = jacnorm_kept(numel, itemsize)
        levels = tuple(self.packed.sample(self.packed.largest_sample))
        activations = measure(self.fn, self.fn.values(), levels, count=False).activations
        layerwise = method is JacNormMethod.LAYERWISE
        one = jacnorm_sample(layerwise, activations, self.subset.numel, numel, rows, itemsize)
        fit = fit_budget(
            budget,
            kept,
            one,
            f"the gradient of {numel} parameters takes {kept} bytes and one sample's "
            f"{method.value} pass about {one}",
        )
        return chunk_size or fit.units

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

    def _progress(self, chunks: list[tuple[int, list[int]]]) -> Any:
        """The chunks with a progress bar where one was asked for."""
        return with_progress(chunks, self.progress, "jacobian_sq_norm", len(chunks))

    def _rows(self, first: int, idx: list[int], like: Tensor) -> Tensor:
        """The output-space vectors of a chunk ``(n, K, O)``: the rows of the identity
        (``exact``) or the probes (``hutchinson``)."""
        if self.probes is not None:
            return torch.stack([self.probes[i] for i in idx])
        o = self.outputs[first]
        return torch.eye(o, dtype=like.dtype, device=like.device).expand(len(idx), o, o)

    def _chunks(self) -> list[tuple[int, list[int]]]:
        """``(first sample of the bucket, chunk's samples)`` for every chunk of the batch."""
        chunk = self.chunk_for(self.method)
        found = []
        for b in self.packed.buckets():
            idx = list(b.indices)
            found += [(idx[0], idx[s : s + chunk]) for s in range(0, len(idx), chunk)]
        return found

    def run(self, *, with_grad: bool) -> tuple[Tensor, dict[str, Tensor]]:
        """``S`` and (optionally) ``grad S`` w.r.t. every parameter, summed over chunks."""
        with (
            twice_differentiable(),
            torch.random.fork_rng(devices=self.devices, enabled=self.rng_state is not None),
        ):
            if self.rng_state is not None:
                torch.set_rng_state(self.rng_state[0])
                if self.rng_state[1] is not None:
                    torch.cuda.set_rng_state(self.rng_state[1], self.fn.device)
            total = self._zero(with_grad)
            if self.trial and with_grad:
                self._try_routes()
            chunks = self._progress(self._chunks())
            if self.method is JacNormMethod.LAYERWISE:
                try:
                    return _add_into(total, self._run_layerwise(with_grad, chunks))
                except NotLayerwiseError as err:
                    if self.strict:
                        raise ValueError(f"jacobian_sq_norm(method='layerwise'): {err}") from err
                    msg = f"layer-wise closed forms failed ({err}); ran vmap"
                    warn_fallback([msg])
                    self.notes.append(msg)
                    self.method = JacNormMethod.VMAP
                    chunks = self._progress(self._chunks())
            return _add_into(total, self._route(self.method)(with_grad, chunks))

    def _zero(self, with_grad: bool) -> tuple[Tensor, dict[str, Tensor]]:
        value = next(iter(self.fn.params.values())).new_zeros(())
        grads = {n: torch.zeros_like(p) for n, p in self.trainable.items()} if with_grad else {}
        return value, grads

    def _route(self, method: JacNormMethod) -> Any:
        return {
            JacNormMethod.LAYERWISE: self._run_layerwise,
            JacNormMethod.VMAP: self._run_vmap,
            JacNormMethod.HVP: self._run_hvp,
        }[method]

    def _run_layerwise(self, with_grad: bool, chunks: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """Per chunk: batched forward, one backward per output row / probe with the layer-wise
        hooks (``create_graph`` for the gradient), ``S_chunk``, then its backward."""
        if self.plan is None:  # not reachable: method is layerwise only with a plan
            raise NotLayerwiseError("no layer-wise plan")
        params = list(self.trainable.values())
        value = params[0].new_zeros(()) if params else torch.zeros(())
        grads = {n: torch.zeros_like(p) for n, p in self.trainable.items()} if with_grad else {}
        for _, idx in chunks:
            lv, out, run = batched_run(
                self.fn,
                self.packed.stack(idx),
                self.plan,
                create_graph=with_grad,
                check=not self.checked,
                random=self.rng_state is not None,
                tune=self.tuning,
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

    def _run_hvp(self, with_grad: bool, chunks: Any) -> tuple[Tensor, dict[str, Tensor]]:
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

        for first, idx in chunks:
            levels = self.packed.stack(idx)
            us = self._rows(first, idx, value)
            with torch.no_grad():
                vals, hvs = vmap(per_sample)(us, *levels)
            value = value + vals.sum()
            for n, h in hvs.items():
                grads[n] += h.sum(0)
        return value, grads

    def _run_vmap(self, with_grad: bool, chunks: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """Per chunk: the per-sample gradients ``g`` of every output row (or probe) w.r.t. the
        subset's tensors by ``vmap(grad)``, then the gradient of the chunk's ``S = sum g^2``
        w.r.t. every parameter by one more reverse pass (``vjp``) with ``g`` itself as the
        cotangent, doubled on the parameter-sized result: differentiating ``(g ** 2).sum()``
        instead wrote the squares and two products of chunk-by-parameter size (a third of
        the time on an 8-conv CNN)."""
        fn, base = self.fn, self.fn.params
        # entries outside the subset are masked; a wholly selected tensor needs no mask
        mask = {n: None if bool(m.all()) else m for n, m in self.mask.items()}
        value = next(iter(base.values())).new_zeros(())
        grads = {n: torch.zeros_like(p) for n, p in self.trainable.items()} if with_grad else {}

        def out_dot(sub: dict[str, Tensor], rest: dict[str, Tensor], u: Tensor, lv: Any) -> Tensor:
            return (fn.call({**rest, **sub}, lv) * u).sum()

        rows_rng = "error" if self.randomness is Randomness.ERROR else "same"

        def chunk_grads(p: dict[str, Tensor], us: Tensor, levels: list[Tensor]) -> list[Tensor]:
            """The masked per-sample gradients, ``(n, [rows,] *shape)`` per subset tensor."""
            sub = {n: p[n] for n in mask}
            rest = {n: t for n, t in p.items() if n not in mask}

            def per_sample(rows: Tensor, *lv: Tensor) -> dict[str, Tensor]:
                if rows.shape[0] == 1:  # one output row: no vmap over rows
                    return grad(out_dot)(sub, rest, rows[0], lv)
                # the rows of one sample share its dropout masks
                return vmap(lambda u: grad(out_dot)(sub, rest, u, lv), randomness=rows_rng)(rows)

            g = vmap(per_sample, randomness=self.randomness.value)(us, *levels)
            return [g[n] if m is None else g[n] * m for n, m in mask.items()]

        for first, idx in chunks:
            levels = self.packed.stack(idx)
            us = self._rows(first, idx, value)
            scale = 1.0 if self.probes is None else 1.0 / us.shape[1]
            with torch.no_grad():
                if with_grad:
                    gs, pull = vjp(lambda p: chunk_grads(p, us, levels), base)  # noqa: B023
                    (g,) = pull(gs)
                    for n in grads:
                        grads[n].add_(g[n], alpha=2 * scale)
                else:
                    gs = chunk_grads(base, us, levels)
                s = sum(torch.dot(t.reshape(-1), t.reshape(-1)) for t in gs)
            value = value + s * scale
        return value, grads


def _add_into(
    total: tuple[Tensor, dict[str, Tensor]], part: tuple[Tensor, dict[str, Tensor]]
) -> tuple[Tensor, dict[str, Tensor]]:
    """``total += part`` (the gradient of the trainable parameters only), in place."""
    total[0].add_(part[0])
    for n, g in total[1].items():
        g += part[1][n]
    return total
