"""Streaming reductions across processes with ``torch.distributed`` (private helpers).

When ``torch.distributed`` is initialised (or a ``process_group`` is passed), each rank
processes its shard of the data and the accumulators are all-reduced once at the end (sum, then
normalised by the global sample count), so every rank ends with the single-process result.

Sharding: a DataLoader whose sampler is a ``DistributedSampler`` is already sharded by the user
and is iterated as is. Any other iterable is sharded by the library: rank ``r`` of ``W`` takes
batches ``r, r + W, r + 2W, ...``; ranks may get unequal numbers of batches and samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["Reducer"]


class Reducer:
    """The process group a streaming reduction runs over (``None``: one process).

    Args:
        process_group: A ``torch.distributed`` group, or ``None`` for the default group when
            ``torch.distributed`` is initialised (else a single process).

    Raises:
        ValueError: ``process_group`` given while ``torch.distributed`` is not initialised.
    """

    def __init__(self, process_group: Any = None) -> None:
        dist = torch.distributed
        ready = dist.is_available() and dist.is_initialized()
        if process_group is not None and not ready:
            raise ValueError(
                "process_group was given but torch.distributed is not initialised "
                "(call torch.distributed.init_process_group first)"
            )
        self.active = ready
        self.group = process_group
        self.rank = dist.get_rank(process_group) if ready else 0
        self.world = dist.get_world_size(process_group) if ready else 1

    def shard(self, data: Iterable[Any]) -> Iterator[Any]:
        """This rank's batches of ``data``."""
        if self.world == 1 or _sharded_by_user(data):
            yield from data
            return
        for k, batch in enumerate(data):
            if k % self.world == self.rank:
                yield batch

    def sum_(self, tensors: list[Tensor]) -> None:
        """All-reduce (sum) ``tensors`` in place across the group (no-op for one process)."""
        if not self.active:
            return
        for t in tensors:
            torch.distributed.all_reduce(t, group=self.group)

    def sum_numbers(self, values: list[float], like: Tensor) -> list[float]:
        """Sum Python numbers across the group (float64 on ``like``'s device)."""
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=like.device)
        torch.distributed.all_reduce(t, group=self.group)
        return [float(v) for v in t.tolist()]


def _sharded_by_user(data: Any) -> bool:
    from torch.utils.data.distributed import DistributedSampler

    sampler = getattr(data, "sampler", None)
    batch_sampler = getattr(data, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    return isinstance(sampler, DistributedSampler) or isinstance(inner, DistributedSampler)
