"""laplace-torch's dict batches (Hugging Face style: ``{dict_key_x: ..., dict_key_y: ...}``) as
``(inputs, targets)`` pairs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

__all__ = ["DictKeyError", "DictPairs"]


class DictKeyError(KeyError, ValueError):
    """A dict batch without the key laplace-torch's ``dict_key_x`` / ``dict_key_y`` names (a
    ``KeyError``, as laplace-torch raises, and a ``ValueError`` for bad input)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DictPairs:
    """A data iterable whose dict batches become ``(inputs, targets)`` pairs (see
    :meth:`LaplaceBase._data`); its length is the data's."""

    def __init__(
        self,
        data: Iterable[Any],
        key_x: str,
        key_y: str,
        first: Callable[[Any], None] | None = None,
    ) -> None:
        self.data, self.key_x, self.key_y, self.first = data, key_x, key_y, first

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        first = self.first
        for batch in self.data:
            if isinstance(batch, Mapping):
                missing = [k for k in (self.key_x, self.key_y) if k not in batch]
                if missing:
                    raise DictKeyError(
                        f"a dict batch lacks {missing} (dict_key_x={self.key_x!r}, "
                        f"dict_key_y={self.key_y!r}); its keys are {list(batch)}"
                    )
                batch = {k: v for k, v in batch.items() if k != self.key_y}, batch[self.key_y]
            if first is not None:  # called with the first batch's inputs, once per pass
                first(batch[0])
                first = None
            yield batch
