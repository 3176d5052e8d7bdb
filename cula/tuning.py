"""Per-GPU tuning tables.

Every number that steers what runs (a kernel variant's CTA shape, from how many states a box layout pays, where a
call is split in time) lives in one frozen dataclass per op, one entry per compute capability, read by the op's
planner (``cula/<op>/plan.py``). A GPU without an entry gets the op's ``fallback`` entry: the kernels run there
with the defaults that are never wrong, only possibly slower.

Tests and sweeps change an entry with ``TuningTable.override``, which also drops every cached plan on the way in
and out, so no launch bound under other numbers outlives the change.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Generic, Iterator, TypeVar

import torch

import cula.arch  # read as cula.arch.device_arch at each call: tests stand in for it

T = TypeVar("T")


class TuningTable(Generic[T]):
    """The tuning entries of one op by compute capability, and the entry for GPUs the table does not list."""

    def __init__(self, op: str, entries: dict[tuple[int, int], T], fallback: T):
        self.op = op
        self._entries = dict(entries)
        self.fallback = fallback

    def get(self, arch: tuple[int, int] | None) -> T:
        return self._entries.get(arch, self.fallback) if arch is not None else self.fallback

    def for_device(self, device: torch.device) -> T:
        return self.get(cula.arch.device_arch(device))

    @contextlib.contextmanager
    def override(self, arch: tuple[int, int] = (9, 0), **changes) -> Iterator[T]:
        """The entry of ``arch`` with ``changes`` (field names of the entry) for the duration of the block."""
        from cula.backends import clear_plan_caches

        before = self._entries.get(arch)
        entry = dataclasses.replace(self.get(arch), **changes)
        self._entries[arch] = entry
        clear_plan_caches()
        try:
            yield entry
        finally:
            if before is None:
                self._entries.pop(arch, None)
            else:
                self._entries[arch] = before
            clear_plan_caches()
