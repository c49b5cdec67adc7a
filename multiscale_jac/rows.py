"""Which sample each row of a batched run belongs to: the premise of every closed form that
reads a layer's rows.

A batched run (the samples stacked, as in a training step) hands each layer-wise closed form
(:mod:`~multiscale_jac.layerwise`, :mod:`~multiscale_jac._kfac`) a layer's input and output
gradient. They give per-sample quantities only where every *unit* of the layer's output belongs
to one sample, and the closed form has to know which: a Linear's units are the positions of all
its dims but the last, a convolution's or a BatchNorm/GroupNorm's the entries of dim 0. A model
may fold a dimension into the batch (pairs ``(B, 2, d) -> (2B, d)``, video frames, same-size
levels stacked with ``torch.cat(levels, 0)``, the same fold taken sample-minor with
``x.transpose(0, 1).reshape(-1, d)``), permute rows (``x[perm]``), keep the batch size while
doing so, or mix rows (``h - h.mean(0)``); the size of a layer's input says none of this.

:class:`RowTracker` (a ``TorchDispatchMode`` around the batched forward pass) follows an *owner*
for every tensor: for each element, the sample whose data it was computed from (``-1``: none, a
constant), through every aten op by the rules of :mod:`~multiscale_jac._row_rules`. An op
without a rule, the output of a custom ``autograd.Function`` (its backward is not seen), a tensor
made by something the tracker did not see, or one written in place after it was read, is
:class:`~multiscale_jac._row_rules.Unknown`, and so is everything computed from it.

Why the owners of a layer's output are the samples its gradient rows belong to: every rule lets
an element depend only on elements of its own owner (and constants), so where the model's output
row ``i`` is owned by sample ``i`` (:func:`output_rows`), an output element of sample ``j``
depends on no element of another sample's, and a unit owned by sample ``i`` receives the gradient
of sample ``i``'s objective only. A unit that is computed from no sample's data (a learned token
expanded over the batch) may feed every sample: no closed form runs on it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from ._row_rules import (
    OWNER_DTYPE,
    VALUE_FREE,
    Mixed,
    Unknown,
    agree,
    compress,
    fit,
    rule_for,
    tensor_outputs,
)

__all__ = ["RowGroups", "RowTracker", "Unknown", "clear_row_cache", "groups_of", "output_rows"]

Owner = Tensor | None


@functools.cache
def _signature(func: Any) -> tuple[tuple[str, bool, Any, bool], ...]:
    """``(name, has default, default, written in place)`` per argument of an aten op."""
    return tuple(
        (
            a.name,
            a.has_default_value(),
            a.default_value,
            a.alias_info is not None and a.alias_info.is_write,
        )
        for a in func._schema.arguments
    )


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    sig = _signature(func)
    bound = {name: value for (name, *_), value in zip(sig, args)}
    for name, has, default, _ in sig[len(args) :]:
        if name in kwargs:
            bound[name] = kwargs[name]
        elif has:
            bound[name] = default
    return bound


def _written(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors ``func`` writes in place (``self`` of ``add_``, ``out=``)."""
    found = []
    for k, (name, _, _, write) in enumerate(_signature(func)):
        if write:
            t = args[k] if k < len(args) else kwargs.get(name)
            if isinstance(t, Tensor):
                found.append(t)
    return found


def _tensor_args(args: tuple, kwargs: dict) -> list[Tensor]:
    found = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(t for t in v if isinstance(t, Tensor))
    return found


def _storage(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


#: the owners a value-free rule gave, by what they are a function of (the op, its arguments'
#: shapes, strides, non-tensor values and owners, its outputs' shapes): a batched run of the
#: same model on the same shapes asks the same questions. Plain data (no tensor of the user's),
#: at most ``_MEMO_SIZE`` entries, emptied when full and by :func:`clear_row_cache`
#: (:func:`multiscale_jac.clear_plan_cache` calls it).
_MEMO: dict[tuple, tuple] = {}
_MEMO_SIZE = 8192


def clear_row_cache() -> None:
    """Forget the row rules' kept results."""
    _MEMO.clear()


def _token(o: Owner | Unknown, seen: dict[int, tuple[Tensor, Any]]) -> Any:
    """What an owner is, as a hashable value (``None`` for an unknown one: nothing is kept);
    ``seen`` keeps the tokens of the owners met so far (and the owners, so that an id stays
    theirs)."""
    if o is None:
        return ()
    if isinstance(o, Unknown):
        return None
    hit = seen.get(id(o))
    if hit is None:
        hit = seen[id(o)] = (o, (tuple(o.shape), o.numpy().tobytes()))
    return hit[1]


def _describe(v: Any, tokens: dict[int, Any]) -> Any:
    if isinstance(v, Tensor):
        return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, tokens[id(v)])
    if isinstance(v, (list, tuple)):
        return tuple(_describe(x, tokens) for x in v)
    return v


def _memo_key(
    func: Any, args: tuple, kwargs: dict, out: Any, before: _Before, seen: dict
) -> tuple | None:
    """The key of ``func``'s outputs' owners, or ``None`` where they are not kept: a rule that
    reads values, an in-place write other than to an output, an unknown input."""
    if rule_for(func) not in VALUE_FREE or before.bases:
        return None
    tokens = {k: _token(o, seen) for k, o in before.owners.items()}
    if None in tokens.values():
        return None
    outs = tensor_outputs(out)
    if any(not any(w is t for t in outs) for w in before.written):
        return None
    try:
        key = (
            func,
            _describe(args, tokens),
            tuple((k, _describe(v, tokens)) for k, v in kwargs.items()),
            tuple(None if t is None else (tuple(t.shape), t.stride()) for t in outs),
        )
        hash(key)
    except (TypeError, KeyError):  # an unhashable argument, a tensor in an odd place
        return None
    return key


class _Ctx:
    """What a rule sees: the op's name and the owners its tensor arguments had before it ran."""

    def __init__(self, func: Any, owners: dict[int, Owner]) -> None:
        self.op, self._owners = str(func), owners

    def own(self, t: Any) -> Owner:
        if not isinstance(t, Tensor):
            return None
        return fit(self._owners.get(id(t)), t)


@dataclass
class _Before:
    """An op's inputs as they were before it ran (an in-place op bumps their versions)."""

    owners: dict[int, Owner | Unknown]
    written: list[Tensor]
    bases: dict[int, Owner | Unknown]


class RowTracker(TorchDispatchMode):
    """Follows the owner of every tensor through the aten ops of one batched forward pass of
    ``n`` samples (the module docstring). Enter it around the forward pass after
    :meth:`mark_inputs`; read owners with :meth:`owner`.

    Attributes:
        n: The samples of the batch.
        errors: Rules that raised (a rule's own failure never stops the model; its outputs
            are unknown, and the reason says so).
    """

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.errors: list[str] = []
        self._records: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        # writes seen per storage: a record is stale once its storage was written after it
        # (a view's version counter is not yet shared with its base where the mode sees it)
        self._writes: dict[int, int] = {}
        self._paused = 0
        self._tokens: dict[int, tuple[Tensor, Any]] = {}
        #: every owner known and no rule read a tensor's values: the outcome is a function of
        #: the ops and their shapes (:mod:`~multiscale_jac._row_replay` may take it over)
        self.pure = True

    def mark_inputs(self, inputs: Sequence[Tensor]) -> None:
        """The model's inputs ``(n, ...)``: row ``i`` is sample ``i``."""
        for t in inputs:
            owner = torch.arange(self.n, dtype=OWNER_DTYPE).view(self.n, *[1] * (t.dim() - 1))
            self._set(t, owner)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The library's own bookkeeping inside the forward pass (not the model's)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def owner(self, t: Tensor) -> Owner | Unknown:
        """``t``'s owner (compressed: dims it does not vary along have size 1), ``None`` for a
        tensor no sample's data reached, or :class:`Unknown` with the reason."""
        gf = t.grad_fn
        if isinstance(gf, BackwardCFunction):
            return Unknown(
                f"the output of the custom autograd function {type(gf).__name__} (its "
                "backward is not seen)"
            )
        rec = self._records.get(t)
        writes = self._writes.get(_storage(t), 0) if self._writes else 0
        if rec is None:
            if gf is not None:
                return Unknown(
                    "a tensor made by something the tracker did not see (torch.func or a "
                    "compiled region inside the model?)"
                )
            if writes:
                return Unknown("a tensor whose memory was written in place during the run")
            return None
        owner, seen = rec
        if not isinstance(owner, Unknown) and writes != seen:
            return Unknown("a tensor written in place (through another view) after it was read")
        return owner

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        before = self._before(func, args, kwargs)
        out = func(*args, **kwargs)
        try:
            if not before.written and all(o is None for o in before.owners.values()):
                self._store(out, before, None)  # weights, constants: no sample's data
                return out
            key = _memo_key(func, args, kwargs, out, before, self._tokens)
            kept = _MEMO.get(key) if key is not None else None
            if kept is not None:
                self._store(out, before, kept, settled=True)
                return out
            owners = self._store(out, before, self._result(func, args, kwargs, out, before))
            if key is not None:
                if len(_MEMO) >= _MEMO_SIZE:
                    _MEMO.clear()
                _MEMO[key] = owners
        except Exception as err:  # a rule's own failure: the outputs are unknown
            self.errors.append(f"{func}: {type(err).__name__}: {err}")
            self._store(out, before, Unknown(f"{func} (its row rule failed: {err})"))
        return out

    def _before(self, func: Any, args: tuple, kwargs: dict) -> _Before:
        written = _written(func, args, kwargs)
        owners = {id(t): self.owner(t) for t in _tensor_args(args, kwargs)}
        bases = {id(w): self.owner(w._base) for w in written if w._base is not None}
        return _Before(owners, written, bases)

    def _result(self, func: Any, args: tuple, kwargs: dict, out: Any, before: _Before) -> Any:
        """The owner of every output (one for all, or one per output), or Unknown."""
        known = [o for o in before.owners.values() if o is not None]
        if not known:
            return None
        rule = rule_for(func)
        if rule is not None and rule.__name__ == "_shared":  # zeros_like(x): no data of x
            return None
        unknown = next((o for o in known if isinstance(o, Unknown)), None)
        if unknown is not None:
            return unknown
        values = {int(o.reshape(-1)[0]) if o.numel() == 1 else None for o in known}
        if len(values) == 1 and None not in values:  # every input one sample's throughout
            return torch.full((), values.pop(), dtype=OWNER_DTYPE)
        if rule is None:
            return Unknown(f"{func} (no row rule; it reads several samples)")
        if rule not in VALUE_FREE:
            self.pure = False
        try:
            return rule(_Ctx(func, before.owners), _bind(func, args, kwargs), out)  # type: ignore[arg-type]
        except Unknown as why:
            return why

    def _store(self, out: Any, before: _Before, result: Any, settled: bool = False) -> tuple:
        """Record the owners of ``out`` (``result``: one owner or Unknown for every output, or
        one per output; ``settled``: one per output as recorded before) and of the tensors
        written in place, their bases included; the owners recorded for the outputs."""
        outs = tensor_outputs(out)
        per = list(result) if isinstance(result, (list, tuple)) else [result] * len(outs)
        for w in before.written:
            key = _storage(w)
            self._writes[key] = self._writes.get(key, 0) + 1
        for t, o in zip(outs, per):
            if t is not None:
                self._set(t, o, settled)
        if settled:
            return tuple(per)
        for w in before.written:
            if not any(w is t for t in outs):
                self._set(w, per[0] if per else result)
            base = w._base
            if base is not None:
                self._set(base, self._place(base, before.bases.get(id(w)), w))
        return tuple(None if t is None else self._records[t][0] for t in outs)

    def _set(self, t: Tensor, o: Any, settled: bool = False) -> None:
        if isinstance(o, Unknown):
            self.pure = False
        if not settled and not isinstance(o, Unknown) and o is not None:
            o = compress(fit(o.to(OWNER_DTYPE), t))
        self._records[t] = (o, self._writes.get(_storage(t), 0) if self._writes else 0)

    def _place(self, base: Tensor, bo: Owner | Unknown, view: Tensor) -> Owner | Unknown:
        """``base``'s owner (``bo`` before the write) after ``view``, a view of it, was
        written."""
        vo = self._records[view][0]
        if isinstance(bo, Unknown) or isinstance(vo, Unknown):
            return bo if isinstance(bo, Unknown) else vo
        full = torch.empty_strided(base.shape, base.stride(), dtype=OWNER_DTYPE)
        full.copy_(-1 if bo is None else fit(bo, base).expand(base.shape))
        region = full.as_strided(
            view.shape, view.stride(), view.storage_offset() - base.storage_offset()
        )
        region.copy_(-1 if vo is None else fit(vo, view).expand(view.shape))
        return full


def output_rows(tracker: RowTracker, out: Tensor) -> str | None:
    """Why ``out``'s row ``i`` is not sample ``i``'s (``None``: it is, for every ``i``)."""
    o = tracker.owner(out)
    if isinstance(o, Unknown):
        return o.reason
    n = tracker.n
    if out.dim() == 0 or out.shape[0] != n:
        return f"the output has shape {tuple(out.shape)} for {n} samples"
    if o is None:
        return None
    try:
        rows = agree(fit(o, out), list(range(1, out.dim())), "the output", keepdim=False)
    except Mixed as err:
        return f"an output row mixes samples ({err.reason})"
    rows = rows.reshape(-1).expand(n) if rows is not None else None
    if rows is None:
        return None
    bad = (rows >= 0) & (rows != torch.arange(n, dtype=OWNER_DTYPE))
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        return f"output row {j} is computed from sample {int(rows[j])}'s data"
    return None


@dataclass(frozen=True)
class RowGroups:
    """Which sample each unit of a layer call belongs to.

    Attributes:
        n: The samples.
        owners: ``(M,)`` the sample of each unit (units in row-major order of the unit dims).
        per: Units per sample where they come sample by sample in order (``owners`` is
            ``arange(n).repeat_interleave(per)``), else 0.
    """

    n: int
    owners: Tensor
    per: int

    @property
    def plain(self) -> bool:
        """One unit per sample, in order (the layout the closed forms assumed before)."""
        return self.per == 1

    @functools.cached_property
    def table(self) -> Tensor:
        """``(n, k)`` the units of each sample (``k``: the most any sample has), in order;
        ``M`` (one past the last unit) where a sample has fewer."""
        m = self.owners.numel()
        if self.per:
            return torch.arange(m).view(self.n, self.per)
        counts = torch.bincount(self.owners.long(), minlength=self.n)
        order = torch.argsort(self.owners, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        owner_sorted = self.owners[order].long()
        rank = torch.arange(m) - starts[owner_sorted]
        table = torch.full((self.n, int(counts.max())), m, dtype=torch.long)
        table[owner_sorted, rank] = order
        return table

    def by_sample(self, t: Tensor, unit_dims: int, samples: slice | None = None) -> Tensor:
        """``t`` (its units over the first ``unit_dims`` dims, in :attr:`owners`' order) as
        ``(n, k, *rest)``: each sample's units in order, zeros where a sample has fewer than
        ``k``; ``samples`` picks a slice of the samples."""
        return _by_sample(self, t, unit_dims, samples)

    def sum_rows(self, per: Tensor) -> Tensor:
        """Per-unit values ``(M, *rest)`` summed into their samples ``(n, *rest)``."""
        owners = self.owners.to(per.device, torch.long)
        return per.new_zeros((self.n, *per.shape[1:])).index_add(0, owners, per)


def groups_of(
    owner: Owner | Unknown, shape: Sequence[int], unit_dims: int, n: int
) -> RowGroups | str:
    """The units of a layer output of ``shape`` owned by ``owner`` (the first ``unit_dims``
    dims index the units), or why they cannot be given to samples."""
    if isinstance(owner, Unknown):
        return owner.reason
    if owner is None:
        return "its rows are computed from no sample's data (a constant or learned input)"
    if 0 in shape:
        return "it has no rows"
    o = owner.reshape((1,) * (len(shape) - owner.dim()) + tuple(owner.shape))
    try:
        o = agree(o, list(range(unit_dims, len(shape))), "a layer's unit", keepdim=False)
    except Mixed as err:
        return f"one of its rows holds several samples ({err.reason})"
    units = o.expand(tuple(shape[:unit_dims])).reshape(-1)
    if bool((units < 0).any()):
        k = int((units < 0).nonzero()[0, 0])
        return (
            f"its row {k} is computed from no sample's data (a constant or learned row, such "
            "as a token expanded over the batch, which every sample may read)"
        )
    m = units.numel()
    per = m // n if m % n == 0 else 0
    expected = torch.arange(n, dtype=OWNER_DTYPE).repeat_interleave(per) if per else None
    regular = expected is not None and bool((units == expected).all())
    return RowGroups(n, units, per if regular else 0)


def _by_sample(groups: RowGroups, t: Tensor, unit_dims: int, samples: slice | None) -> Tensor:
    rest = tuple(t.shape[unit_dims:])
    flat = t.reshape(-1, *rest)
    rows = slice(None) if samples is None else samples
    if groups.per:
        return flat.view(groups.n, groups.per, *rest)[rows]
    table = groups.table[rows].to(t.device)
    return torch.cat([flat, flat.new_zeros((1, *rest))])[table]
