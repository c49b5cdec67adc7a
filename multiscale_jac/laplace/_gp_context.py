"""The GP Laplace's context: ``M`` samples drawn from the training data (laplace-torch's
subset of data) and their Jacobians ``(M, O, P)``, a chunk of samples at a time. The first
group of chunks is kept between calls (half of ``GP_CONTEXT_BYTES``, or of a
``memory_budget``); later chunks are recomputed where a kernel block or a predictive needs
them, one group held while the rest stream past it (laplace-torch recomputes every batch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import default_collate

from .._memory import DEFAULT_JACOBIAN_BYTES, GP_CONTEXT_BYTES, tensor_bytes
from .._stream import pair, with_progress
from ._batches import DictPairs
from ._gp_kernel import kernel

__all__ = ["GPContext"]

Bounds = tuple[int, int]


class GPContext:
    """The context samples of a GP Laplace and their Jacobians.

    Args:
        jacobians: ``x -> (J (n, O, P), f (n, O))`` at the MAP, without a graph.
        chunk_size: Samples per Jacobian call (``None``: as many as the Jacobian bytes allow).
        memory_budget: Bytes of Jacobians computed at once and held between calls (``None``:
            the defaults).
        keys: ``(dict_key_x, dict_key_y)`` of dict batches.
    """

    def __init__(
        self,
        jacobians: Callable[[Any], tuple[Tensor, Tensor]],
        chunk_size: int | None,
        memory_budget: int | None,
        keys: tuple[str, str],
    ) -> None:
        self._jacobians_of = jacobians
        self._step, self._budget, self._keys = chunk_size, memory_budget, keys
        self.x: Any = None
        self.y: Tensor | None = None
        self.bounds: list[Bounds] = []
        self._bytes: list[int] = []
        self._kept: dict[Bounds, tuple[Tensor, Tensor]] = {}

    def draw(self, data: Iterable[Any], n_subset: int, seed: int) -> int:
        """Draw the context from ``data`` (a DataLoader's dataset is indexed; another iterable
        is read once); returns ``N``, the training samples."""
        dataset = getattr(data, "dataset", None)
        if dataset is not None and hasattr(dataset, "__len__"):
            n = len(dataset)
            batch = default_collate([dataset[i] for i in _indices(n, n_subset, seed)])
            self.x, self.y = pair(next(iter(DictPairs([batch], *self._keys))))
            return n
        xs, ys = zip(*[pair(b) for b in DictPairs(data, *self._keys)], strict=True)
        x, y = _cat(list(xs)), torch.cat(list(ys))
        n = int(y.shape[0])
        idx = torch.as_tensor(_indices(n, n_subset, seed))
        self.x, self.y = _take(x, idx), y[idx]
        return n

    def first(self) -> Any:
        """The first context sample's inputs, a batch of one."""
        return _take(self.x, torch.arange(1))

    def first_pass(self) -> Iterator[tuple[int, int, Tensor, Tensor]]:
        """``(a, b, J, f)`` of every chunk ``[a, b)`` of the context, in order (the first chunk
        is one sample: its bytes size the others); the first group's Jacobians are kept."""
        if self.y is None:
            raise RuntimeError("call fit() before using the GP posterior")
        self.bounds, self._bytes, self._kept = [], [], {}
        a, m, step, total = 0, int(self.y.shape[0]), self._step, 0
        while a < m:
            b = min(m, a + (step or 1))
            js, f = self._jacobians_of(_take(self.x, torch.arange(a, b)))
            if step is None:
                step = max(1, self._cap() // tensor_bytes(js[0].numel(), js.element_size()))
            self._bytes.append(tensor_bytes(js.numel(), js.element_size()))
            total += self._bytes[-1]
            if total <= self._hold() // 2:
                self._kept[(a, b)] = (js, f)
            self.bounds.append((a, b))
            yield a, b, js, f
            a = b

    def chunk(self, a: int, b: int) -> tuple[Tensor, Tensor]:
        """Jacobians ``(b - a, O, P)`` and outputs of context samples ``[a, b)``."""
        if (a, b) in self._kept:
            return self._kept[(a, b)]
        if self.y is None:
            raise RuntimeError("call fit() before using the GP posterior")
        return self._jacobians_of(_take(self.x, torch.arange(a, b)))

    def k_m_star(self, j_star: Tensor, independent: bool) -> Tensor:
        """``J_M J_*^T`` (unscaled) for query Jacobians ``j_star`` ``(n, O, P)``."""
        parts = [kernel(self.chunk(a, b)[0], j_star, independent) for a, b in self.bounds]
        return torch.cat(parts, dim=1 if independent else 0)

    def kernel_mm(self, independent: bool, show: bool) -> Tensor:
        """``J_M J_M^T`` by groups of chunks (each group's Jacobians held while the later
        chunks stream past it, one at a time; the first group's were kept by the fit)."""
        groups, blocks = self._groups(), {}
        ind = independent
        for g, group in enumerate(with_progress(groups, show, "kernel", len(groups))):
            held = [(b, self.chunk(*b)[0]) for b in group]
            for i, (br, jr) in enumerate(held):
                for bc, jc in held[i:]:
                    blocks[br, bc] = kernel(jr, jc, ind)
            for bc in (b for later in groups[g + 1 :] for b in later):
                jc = self.chunk(*bc)[0]
                for br, jr in held:
                    blocks[br, bc] = kernel(jr, jc, ind)
        rows = [
            [
                blocks[r, c] if (r, c) in blocks else blocks[c, r].transpose(-2, -1)
                for c in self.bounds
            ]
            for r in self.bounds
        ]
        dim = -1 if ind else 1
        return torch.cat([torch.cat(row, dim=dim) for row in rows], dim=dim - 1)

    def _groups(self) -> list[list[tuple[int, int]]]:
        """Consecutive chunks whose Jacobians fit half the held bytes together (one chunk at
        least): the first is the fit's kept one."""
        groups: list[list[tuple[int, int]]] = [[]]
        size = 0
        for b, nbytes in zip(self.bounds, self._bytes, strict=True):
            if groups[-1] and size + nbytes > self._hold() // 2:
                groups.append([])
                size = 0
            groups[-1].append(b)
            size += nbytes
        return groups

    def _hold(self) -> int:
        """Bytes of context Jacobians held: the kept group and a streaming group, half each."""
        return GP_CONTEXT_BYTES if self._budget is None else self._budget

    def _cap(self) -> int:
        return DEFAULT_JACOBIAN_BYTES if self._budget is None else self._budget

    def state(self) -> dict[str, Any]:
        """The context as plain data (a dict batch as ``[key, tensor]`` pairs)."""
        x = [[k, v] for k, v in self.x.items()] if isinstance(self.x, Mapping) else self.x
        return {"context_x": x, "context_y": self.y, "bounds": [list(b) for b in self.bounds]}

    def load(self, state: Mapping[str, Any]) -> None:
        x = state["context_x"]
        self.x, self.y = (dict(x) if isinstance(x, list) else x), state["context_y"]
        self.bounds, self._bytes, self._kept = [tuple(b) for b in state["bounds"]], [], {}


def _indices(n: int, m: int, seed: int) -> list[int]:
    """laplace-torch's draw: ``numpy.random.default_rng(seed).choice(N, M, replace=False)``."""
    if m > n:
        raise ValueError(f"n_subset={m} exceeds the {n} training samples")
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(list(range(n)), m, replace=False)]


def _take(x: Any, idx: Tensor) -> Any:
    """Samples ``idx`` of a tensor batch or of every entry of a dict batch."""
    if isinstance(x, Tensor):
        return x[idx.to(x.device)]
    if isinstance(x, Mapping):
        return {k: (v[idx.to(v.device)] if isinstance(v, Tensor) else v) for k, v in x.items()}
    raise TypeError(f"hessian_structure='gp' takes tensor or dict batches; got {type(x).__name__}")


def _cat(xs: list[Any]) -> Any:
    if isinstance(xs[0], Mapping):
        return {k: torch.cat([x[k] for x in xs]) for k in xs[0]}
    if isinstance(xs[0], Tensor):
        return torch.cat(xs)
    raise TypeError(
        f"hessian_structure='gp' takes tensor or dict batches; got {type(xs[0]).__name__}"
    )
