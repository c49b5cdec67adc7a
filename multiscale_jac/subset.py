"""Which parameters to differentiate: whole tensors or single scalar entries.

A :class:`ParamSubset` selects, for some of a model's parameter tensors, either the whole tensor
or a set of flat element indices into it. Its flat order (the columns ``P`` of every Jacobian)
is the order the user gave, as ``J_full[..., idx]`` would have it: tensors in the order they were
named (a glob expands in ``named_parameters()`` order), entries in the order their indices were
passed, and for :meth:`ParamSubset.from_flat_indices` exactly the order of the flat indices, even
when it interleaves tensors. :meth:`ParamSubset.all` follows ``named_parameters()``.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["ParamSubset", "resolve_subset"]

_GLOB_CHARS = "*?["


class ParamSubset:
    """A selection of parameter entries of one model.

    Build it with :meth:`all`, :meth:`from_names`, :meth:`from_indices`,
    :meth:`from_flat_indices` or :meth:`from_mask`. Shapes: a *flat vector* has length
    :attr:`numel`; per-tensor values have the tensor's full shape for whole-tensor selections and
    ``(k,)`` for ``k`` selected entries (:meth:`selected_shape`).
    """

    def __init__(
        self,
        layout: Sequence[tuple[str, torch.Size]],
        selection: Mapping[str, Tensor | None],
        columns: Tensor | None = None,
    ) -> None:
        """Low-level constructor; prefer the ``from_*`` class methods.

        Args:
            layout: ``(name, shape)`` of every parameter of the model, in
                ``named_parameters()`` order.
            selection: name -> ``None`` (whole tensor) or unique int64 flat indices, tensors and
                indices in the order of the columns.
            columns: Only for orders that interleave tensors: ``(P,)``, column ``k`` is entry
                ``columns[k]`` of the selection laid out tensor by tensor (``None``: that
                layout is the order).
        """
        self._layout = tuple((n, torch.Size(s)) for n, s in layout)
        known = dict(self._layout)
        self._selection: dict[str, Tensor | None] = {}
        for name, idx in selection.items():
            if name not in known:
                raise ValueError(f"unknown parameter name {name!r}")
            if idx is not None:
                idx = _check_indices(idx, math.prod(known[name]), f"indices for {name!r}")
            self._selection[name] = idx
        if not self._selection:
            raise ValueError("a ParamSubset must select at least one parameter entry")
        self._shapes = {n: known[n] for n in self._selection}
        self._offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for n in self._selection:
            k = math.prod(self.selected_shape(n))
            self._offsets[n] = (start, start + k)
            start += k
        self._numel = start
        if columns is not None and torch.equal(columns, torch.arange(start)):
            columns = None
        self._columns = columns
        self._grouped = None if columns is None else torch.argsort(columns)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def all(
        cls, model: nn.Module | Mapping[str, Tensor], *, trainable_only: bool = False
    ) -> ParamSubset:
        """Every parameter tensor of ``model`` (only those with ``requires_grad`` if asked)."""
        params = _named_params(model)[0]
        if not isinstance(trainable_only, bool):
            raise TypeError(f"trainable_only must be True or False; got {trainable_only!r}")
        if trainable_only:
            names = [n for n, p in params.items() if p.requires_grad]
        else:
            names = list(params)
        if not names:
            raise ValueError(
                "the model has no parameters to select"
                + (" that require grad" if trainable_only else "")
            )
        return cls(_layout_of(params), dict.fromkeys(names))

    @classmethod
    def from_names(
        cls, model: nn.Module | Mapping[str, Tensor], patterns: str | Iterable[str]
    ) -> ParamSubset:
        """Whole tensors by exact name or ``fnmatch`` glob (``*`` also matches dots), in the
        order given (a glob's matches in ``named_parameters()`` order; a tensor named twice
        counts once, where it is first named).

        ``"head.*"`` matches ``head.0.weight``; ``"*.bias"`` matches every bias.

        Raises:
            ValueError: an unknown exact name, or a pattern that matches nothing.
        """
        params, aliases = _named_params(model)
        if isinstance(patterns, str):
            patterns = [patterns]
        else:
            patterns = list(patterns)
        if not patterns:
            raise ValueError("from_names got an empty list of names/patterns")
        chosen: dict[str, None] = {}  # in the order given; a glob in named_parameters() order
        for pat in patterns:
            if not isinstance(pat, str):
                raise TypeError(f"parameter names/patterns must be strings; got {pat!r}")
            if pat in params or pat in aliases:
                chosen.setdefault(aliases.get(pat, pat))
                continue
            if any(c in pat for c in _GLOB_CHARS):
                hits = [n for n in [*params, *aliases] if fnmatch.fnmatchcase(n, pat)]
                if not hits:
                    raise ValueError(f"pattern {pat!r} matches no parameter; {_available(params)}")
                order = {n: k for k, n in enumerate(params)}
                for n in sorted({aliases.get(h, h) for h in hits}, key=order.__getitem__):
                    chosen.setdefault(n)
                continue
            raise ValueError(_unknown_name(pat, params))
        return cls(_layout_of(params), chosen)

    @classmethod
    def from_indices(
        cls, model: nn.Module | Mapping[str, Tensor], indices: Mapping[str, Any]
    ) -> ParamSubset:
        """Single scalar entries: ``{name: flat indices into that tensor}``; the columns follow
        the dict's order and, within a tensor, the order of its indices.

        Indices may be a LongTensor, a NumPy integer array or a list of ints.

        Raises:
            ValueError: unknown names, empty, duplicate or out-of-range indices.
            TypeError: non-integer indices.
        """
        params, entries = _per_tensor(model, indices, "from_indices", "indices")
        sel = {
            canon: _check_indices(idx, params[canon].numel(), f"indices for {name!r}")
            for name, canon, idx in entries
        }
        return cls(_layout_of(params), sel)

    @classmethod
    def from_flat_indices(
        cls, model: nn.Module | Mapping[str, Tensor], indices: Any
    ) -> ParamSubset:
        """Entries by index into ``parameters_to_vector(model.parameters())``; column ``k`` is
        ``indices[k]``, as in ``J_full[..., indices]`` (also when the order interleaves
        tensors).

        Raises:
            ValueError: empty, duplicate or out-of-range indices.
        """
        params = _named_params(model)[0]
        sizes = torch.tensor([p.numel() for p in params.values()])
        idx = _check_indices(indices, int(sizes.sum()), "flat indices")
        starts = torch.cumsum(sizes, 0) - sizes
        owner = torch.searchsorted(torch.cumsum(sizes, 0), idx, right=True)  # tensor per index
        first = {int(t): None for t in owner.tolist()}  # tensors by first appearance
        names = list(params)
        grouped = torch.cat([(owner == t).nonzero().squeeze(1) for t in first])
        sel = {names[t]: idx[owner == t] - starts[t] for t in first}
        return cls(_layout_of(params), sel, columns=torch.argsort(grouped))

    @classmethod
    def from_mask(
        cls, model: nn.Module | Mapping[str, Tensor], masks: Mapping[str, Tensor]
    ) -> ParamSubset:
        """Entries where a boolean mask shaped like the parameter is True.

        Raises:
            ValueError: unknown names, wrong mask shapes, masks selecting nothing.
            TypeError: non-boolean masks.
        """
        params, entries = _per_tensor(model, masks, "from_mask", "bool tensor")
        sel: dict[str, Tensor | None] = {}
        for name, canon, mask in entries:
            p = params[canon]
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
                what = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
                raise TypeError(f"mask for {name!r} must be a bool tensor; got {what}")
            if mask.shape != p.shape:
                raise ValueError(
                    f"mask for {name!r} has shape {tuple(mask.shape)} but the parameter has "
                    f"shape {tuple(p.shape)}"
                )
            idx = mask.detach().reshape(-1).nonzero().reshape(-1).cpu()
            if idx.numel() == 0:
                raise ValueError(f"mask for {name!r} selects no entries")
            sel[canon] = idx
        return cls(_layout_of(params), sel)

    # ------------------------------------------------------------------ structural selections
    @classmethod
    def largest_magnitude(
        cls,
        model: nn.Module,
        k: int,
        *,
        params: ParamSubset | str | Sequence[str] | None = None,
    ) -> ParamSubset:
        """The ``k`` entries of largest absolute value (among ``params``, default all)."""
        candidates = resolve_subset(params, model)
        scores = candidates.flatten(candidates.check_model(model)).detach().abs()
        return cls.top(model, candidates, scores, k, "largest_magnitude")

    @classmethod
    def random(
        cls,
        model: nn.Module,
        k: int,
        *,
        generator: torch.Generator | None = None,
        params: ParamSubset | str | Sequence[str] | None = None,
    ) -> ParamSubset:
        """``k`` entries drawn uniformly without replacement (seeded by ``generator``)."""
        candidates = resolve_subset(params, model)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator; got {generator!r}")
        _check_k(k, candidates.numel, "random")
        pick = torch.randperm(candidates.numel, generator=generator)[:k]
        return cls.from_flat_indices(model, candidates.flat_indices()[pick])

    @classmethod
    def last_layer(cls, model: nn.Module) -> ParamSubset:
        """Every parameter of the last module (registration order) that owns parameters.

        Raises:
            ValueError: the model has no parameters.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"last_layer expects an nn.Module; got {type(model).__name__}")
        last = None
        for name, m in model.named_modules():
            if any(True for _ in m.parameters(recurse=False)):
                last = name
        if last is None:
            raise ValueError("the model has no parameters")
        owned = [n for n, _ in model.get_submodule(last).named_parameters(recurse=False)]
        return cls.from_names(model, [f"{last}.{n}" if last else n for n in owned])

    @classmethod
    def top(
        cls, model: nn.Module, candidates: ParamSubset, scores: Tensor, k: int, what: str = "top"
    ) -> ParamSubset:
        """The ``k`` entries of ``candidates`` with the largest ``scores`` (``(P,)`` in the
        candidates' flat order), largest first; ``what`` names the caller in errors."""
        _check_k(k, candidates.numel, what)
        top = torch.topk(scores.detach().cpu(), k).indices
        return cls.from_flat_indices(model, candidates.flat_indices()[top])

    # ------------------------------------------------------------------ facts
    @property
    def names(self) -> tuple[str, ...]:
        """Selected tensor names, in the order of their first columns."""
        return tuple(self._selection)

    @property
    def numel(self) -> int:
        """P, the number of selected scalar entries (the Jacobian's last dim)."""
        return self._numel

    @property
    def shapes(self) -> dict[str, torch.Size]:
        """Full shape of every selected tensor."""
        return dict(self._shapes)

    @property
    def indices(self) -> dict[str, Tensor | None]:
        """Flat element indices per selected tensor, in column order (``None``: the whole
        tensor)."""
        return dict(self._selection)

    @property
    def offsets(self) -> dict[str, tuple[int, int]]:
        """``[start, stop)`` of every selected tensor's entries in the flat vector laid out
        tensor by tensor (the flat order itself unless :attr:`columns` is set)."""
        return dict(self._offsets)

    @property
    def layout(self) -> tuple[tuple[str, torch.Size], ...]:
        """``(name, shape)`` of every parameter of the model the subset was built for."""
        return self._layout

    def is_whole(self, name: str) -> bool:
        """True when tensor ``name`` is selected whole."""
        return self._selection[name] is None

    @property
    def all_whole(self) -> bool:
        """True when every selected tensor is selected whole."""
        return all(v is None for v in self._selection.values())

    def selected_shape(self, name: str) -> torch.Size:
        """The tensor's shape if whole, else ``(k,)`` for ``k`` selected entries."""
        idx = self._selection[name]
        return self._shapes[name] if idx is None else torch.Size([idx.numel()])

    @property
    def columns(self) -> Tensor | None:
        """For flat orders that interleave tensors: ``(P,)``, flat entry ``k`` is entry
        ``columns[k]`` of the tensor-by-tensor layout (:attr:`offsets`); else ``None``."""
        return self._columns

    def to_flat_order(self, grouped: Tensor) -> Tensor:
        """``(*batch, P)`` laid out tensor by tensor -> the flat (column) order."""
        if self._columns is None:
            return grouped
        return grouped.index_select(-1, self._columns.to(grouped.device))

    def to_grouped(self, vec: Tensor) -> Tensor:
        """``(*batch, P)`` in the flat order -> laid out tensor by tensor."""
        if self._grouped is None:
            return vec
        return vec.index_select(-1, self._grouped.to(vec.device))

    def flat_indices(self) -> Tensor:
        """The selected entries as indices into ``parameters_to_vector(model.parameters())``,
        in the flat order."""
        starts, start = {}, 0
        for name, shape in self._layout:
            starts[name] = start
            start += math.prod(shape)
        out = [
            starts[n] + (torch.arange(math.prod(self._shapes[n])) if idx is None else idx)
            for n, idx in self._selection.items()
        ]
        return self.to_flat_order(torch.cat(out))

    # ------------------------------------------------------------------ mapping values
    def gather(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Selected entries of full-shaped tensors ``(*batch, *shape)`` -> ``(*batch, *selected)``."""
        out = {}
        for name in self._selection:
            if name not in tensors:
                raise ValueError(f"gather: no tensor for selected parameter {name!r}")
            t = tensors[name]
            shape = self._shapes[name]
            batch = _batch_shape(t, shape, name)
            idx = self._selection[name]
            if idx is None:
                out[name] = t
            else:
                out[name] = t.reshape(*batch, -1).index_select(-1, idx.to(t.device))
        return out

    def flatten(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """Full-shaped tensors ``(*batch, *shape)`` -> flat selected vector ``(*batch, P)``."""
        parts = self.gather(tensors)
        flat = []
        for name, t in parts.items():
            sel = self.selected_shape(name)
            flat.append(t.reshape(*t.shape[: t.dim() - len(sel)], -1))
        return self.to_flat_order(torch.cat(flat, dim=-1))

    def split(self, vec: Tensor) -> dict[str, Tensor]:
        """Flat ``(*batch, P)`` -> per tensor ``(*batch, *selected_shape)`` (views unless the
        flat order interleaves tensors)."""
        if vec.dim() < 1 or vec.shape[-1] != self._numel:
            raise ValueError(
                f"split expects a tensor with last dim P={self._numel}; got shape {tuple(vec.shape)}"
            )
        batch, vec = vec.shape[:-1], self.to_grouped(vec)
        return {
            n: vec[..., a:b].reshape(*batch, *self.selected_shape(n))
            for n, (a, b) in self._offsets.items()
        }

    def embed(self, vec: Tensor, fill: float = 0.0) -> dict[str, Tensor]:
        """Flat ``(*batch, P)`` -> full-shaped tensors ``(*batch, *shape)``, ``fill`` elsewhere."""
        out = {}
        for name, part in self.split(vec).items():
            idx = self._selection[name]
            shape = self._shapes[name]
            if idx is None:
                out[name] = part.clone()
                continue
            batch = part.shape[:-1]
            full = part.new_full((*batch, math.prod(shape)), fill)
            full[..., idx.to(part.device)] = part
            out[name] = full.reshape(*batch, *shape)
        return out

    def values(self, model: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Current (detached) values of the selected entries of ``model``."""
        params = self.check_model(model)
        return self.gather({n: params[n].detach() for n in self._selection})

    def check_model(self, model: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Check that ``model`` has the selected tensors with the recorded shapes.

        Returns:
            The model's parameters by name (deduplicated, ``named_parameters()`` order).
        """
        params = _named_params(model)[0]
        for name, shape in self._shapes.items():
            if name not in params:
                raise ValueError(
                    f"this ParamSubset selects {name!r}, which the model does not have; "
                    f"{_available(params)}"
                )
            if params[name].shape != shape:
                raise ValueError(
                    f"this ParamSubset was built for {name!r} of shape {tuple(shape)}; the "
                    f"model's has shape {tuple(params[name].shape)}"
                )
        return params

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParamSubset):
            return NotImplemented
        if self._layout != other._layout or list(self._selection) != list(other._selection):
            return False
        for n, a in self._selection.items():
            b = other._selection[n]
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                return False
        a, b = self._columns, other._columns
        return (a is None) == (b is None) and (a is None or torch.equal(a, b))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        parts = []
        for n in self._selection:
            full = math.prod(self._shapes[n])
            k = math.prod(self.selected_shape(n))
            parts.append(f"{n}: all {full}" if self.is_whole(n) else f"{n}: {k} of {full}")
        shown = ", ".join(parts[:6]) + (f", ... ({len(parts)} tensors)" if len(parts) > 6 else "")
        return f"ParamSubset(numel={self._numel}, {{{shown}}})"


def resolve_subset(params: Any, model: nn.Module, argname: str = "params") -> ParamSubset:
    """``None`` -> all parameters; a :class:`ParamSubset` -> checked against ``model``;
    a string or list of strings -> :meth:`ParamSubset.from_names` (errors name ``argname``)."""
    if params is None:
        return ParamSubset.all(model)
    if isinstance(params, ParamSubset):
        params.check_model(model)
        return params
    if isinstance(params, str) or (
        isinstance(params, (list, tuple)) and all(isinstance(p, str) for p in params)
    ):
        return ParamSubset.from_names(model, params)
    raise TypeError(
        f"{argname} must be None, a ParamSubset, a parameter name/glob or a list of them; got "
        f"{type(params).__name__}"
    )


# ---------------------------------------------------------------------- helpers
def _named_params(
    model: nn.Module | Mapping[str, Tensor],
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Parameters by canonical name, and a map alias -> canonical name for tied weights."""
    if isinstance(model, nn.Module):
        params = dict(model.named_parameters())
        aliases: dict[str, str] = {}
        canon_of = {id(p): n for n, p in params.items()}
        for n, p in model.named_parameters(remove_duplicate=False):
            if n not in params:
                aliases[n] = canon_of[id(p)]
        return params, aliases
    if isinstance(model, Mapping):
        for n, t in model.items():
            if not isinstance(n, str) or not isinstance(t, Tensor):
                raise TypeError("a parameter mapping must map names (str) to tensors")
        return dict(model), {}
    raise TypeError(f"expected an nn.Module or a dict of named tensors; got {type(model).__name__}")


def _per_tensor(
    model: nn.Module | Mapping[str, Tensor], mapping: Any, method: str, what: str
) -> tuple[dict[str, Tensor], list[tuple[str, str, Any]]]:
    """Validate a ``{name: value}`` argument: ``(params, [(name, canonical name, value)])``."""
    params, aliases = _named_params(model)
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{method} expects a dict {{name: {what}}}; got {type(mapping).__name__}")
    if not mapping:
        raise ValueError(f"{method} got an empty dict")
    entries, seen = [], {}
    for name, value in mapping.items():
        if name not in params and name not in aliases:
            raise ValueError(_unknown_name(name, params))
        canon = aliases.get(name, name)
        if canon in seen:
            raise ValueError(f"parameters {seen[canon]!r} and {name!r} are the same (tied) tensor")
        seen[canon] = name
        entries.append((name, canon, value))
    return params, entries


def _check_k(k: Any, available: int, what: str) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"{what}: k must be an int; got {k!r}")
    if not 1 <= k <= available:
        raise ValueError(f"{what}: k must be in 1..{available} (the candidate entries); got {k}")


def _layout_of(params: Mapping[str, Tensor]) -> list[tuple[str, torch.Size]]:
    return [(n, p.shape) for n, p in params.items()]


def _check_indices(idx: Any, numel: int, what: str) -> Tensor:
    """Validate integer indices in ``[0, numel)``, unique; return them as int64 on the CPU, in
    the order given."""
    if isinstance(idx, Tensor):
        t = idx.detach().cpu()
    elif isinstance(idx, (np.ndarray, list, tuple, range)):
        arr = np.asarray(idx)
        if arr.size == 0:
            raise ValueError(f"{what} is empty")
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{what} must be integers; got dtype {arr.dtype}")
        t = torch.from_numpy(arr.astype(np.int64))
    else:
        raise TypeError(
            f"{what} must be a LongTensor, an integer array or a list of ints; got {type(idx).__name__}"
        )
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(
            f"{what} must be integers; got dtype {t.dtype}"
            + (" (use from_mask for boolean masks)" if t.dtype == torch.bool else "")
        )
    t = t.reshape(-1).to(torch.int64)
    if t.numel() == 0:
        raise ValueError(f"{what} is empty")
    bad = t[(t < 0) | (t >= numel)]
    if bad.numel():
        raise ValueError(
            f"{what}: index {int(bad[0])} is out of range for {numel} entries (valid: 0..{numel - 1})"
        )
    s = t.sort().values
    dup = s[1:][s[1:] == s[:-1]]
    if dup.numel():
        raise ValueError(f"{what}: index {int(dup[0])} is given more than once")
    return t


def _batch_shape(t: Tensor, shape: torch.Size, name: str) -> torch.Size:
    k = len(shape)
    if t.dim() < k or t.shape[t.dim() - k :] != shape:
        raise ValueError(
            f"tensor for {name!r} has shape {tuple(t.shape)}; expected (*batch, {', '.join(map(str, shape))})"
        )
    return t.shape[: t.dim() - k]


def _unknown_name(name: str, params: Mapping[str, Tensor]) -> str:
    close = difflib.get_close_matches(name, list(params), n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return f"unknown parameter name {name!r}{hint} ({_available(params)})"


def _available(params: Mapping[str, Tensor]) -> str:
    names = list(params)
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    return f"the model's parameters are: {shown}"
