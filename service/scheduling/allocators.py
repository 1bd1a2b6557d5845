"""Which request rows and KV slots are free: decided once, by the coordinator, for every rank.

Pure Python. The ranks hold the tensors (service.ranks.kv_pool); the coordinator holds these
free lists and sends the chosen rows and slots in every command, so all ranks write the same
places in the same order.
"""

from __future__ import annotations

from service.padding import PADDING_SLOT


class RowAllocator:
    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if row in self._free or not 0 <= row < self.num_rows:
            raise ValueError(f"request row {row} freed twice or out of range")
        self._free.append(row)


class SlotAllocator:
    """KV token slots 1..num_slots (slot 0 is the padding slot).

    Freeing a slot that is free already (or out of range) raises: one such bug would otherwise
    hand the same KV slots to two requests, which then overwrite each other silently.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots, PADDING_SLOT, -1))
        self._is_free = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        self._is_free.difference_update(out)
        return out

    def free(self, slots: list[int]) -> None:
        bad = [s for s in slots if s in self._is_free or not PADDING_SLOT < s <= self.num_slots]
        if bad or len(set(slots)) != len(slots):
            raise ValueError(f"KV slots {sorted(set(bad))[:5] or slots[:5]} freed twice or out of "
                             "range")  # fmt: skip
        self._free.extend(reversed(slots))
        self._is_free.update(slots)
