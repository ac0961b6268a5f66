"""Device memory the CUDA executor hands out: arrays from a caching pool, and the shared activation arena.

- **Arrays** (`CudaArray`): the parameters, gradients and optimizer states
  the driver asks for (`zeros`, `upload`), batch buffers, and the fresh
  outputs a call returns. Each is a piece of one `runtime.allocate` kept
  by a pool: when an array is collected, its block goes back to the pool
  and the next request of the same (256-byte rounded) size takes it, as
  PyTorch's caching allocator does. All device work is ordered on one
  stream, so a block reused on the host is written only after the work
  that last used it has run. The driver holds the long-lived arrays for the
  whole run, so their addresses never change (which capture needs).
- **The activation arena**: every lowered graph's buffers at the offsets
  `plan-buffers` chose, then a pattern kernel's scratch. The executor runs
  one graph at a time on one stream, so one arena, as large as the largest
  graph needs, serves them all; it grows (a new allocation, so captured
  graphs are made again) only when a graph compiled later needs more.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...byte_text import show_bytes
from .graph_plan import aligned, numpy_dtype
from .runtime import Arena, DeviceOutOfMemory, DeviceRuntime, DeviceScalars, DeviceSpan


class Block:
    """One allocation of the pool, handed to arrays; back in the pool when nothing holds it."""

    __slots__ = ("span", "__weakref__")

    def __init__(self, span: DeviceSpan) -> None:
        self.span = span


class DevicePool:
    """Device allocations kept for reuse by size once their arrays are gone."""

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        self._free: dict[int, list[DeviceSpan]] = {}
        #: Bytes allocated from the device and not freed (held by arrays or kept for reuse).
        self.allocated = 0

    def take(self, nbytes: int, what: str) -> Block:
        """A block of at least `nbytes` (256-byte aligned); `DeviceOutOfMemory` naming `what`."""
        size = aligned(max(nbytes, 1))
        spans = self._free.get(size)
        if spans:
            span = spans.pop()
        else:
            try:
                span = self.runtime.allocate(size, what)
            except DeviceOutOfMemory:
                self.trim()
                span = self.runtime.allocate(size, what)
            self.allocated += size
        block = Block(span)
        weakref.finalize(block, self._give_back, span)
        return block

    def _give_back(self, span: DeviceSpan) -> None:
        self._free.setdefault(span.nbytes, []).append(span)

    def trim(self) -> None:
        """Free every block kept for reuse (before a large allocation that would not fit)."""
        self.runtime.synchronize()
        for spans in self._free.values():
            for span in spans:
                self.runtime.free(span)
                self.allocated -= span.nbytes
        self._free.clear()

    @property
    def kept(self) -> int:
        """Bytes kept for reuse (allocated, held by no array)."""
        return sum(size * len(spans) for size, spans in self._free.items())


class CudaArray:
    """An executor array: `nbytes` at a device `address`, read as `shape` of IR `dtype`.

    `owner` keeps the memory alive (a pool `Block`, or the executor's own memory); a view shares its
    flat array's owner. `scalars` is set for a device scalar (`CudaExecutor.scalar`).
    """

    __slots__ = ("address", "nbytes", "shape", "dtype", "owner", "scalars")

    def __init__(self, address: int, shape: Sequence[int], dtype: str, owner: Any,
                 scalars: DeviceScalars | None = None) -> None:
        self.address = address
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.nbytes = math.prod(self.shape) * numpy_dtype(dtype).itemsize
        self.owner = owner
        self.scalars = scalars

    @property
    def span(self) -> DeviceSpan:
        return DeviceSpan(self.address, self.nbytes)

    def __int__(self) -> int:
        return self.address

    def __index__(self) -> int:
        return self.address

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("a CUDA executor array lives on the device; read it with executor.download")

    def __repr__(self) -> str:
        return f"CudaArray({self.dtype}{list(self.shape)} at {self.address:#x})"


class ActivationArena:
    """The one activation arena the executor's graphs share, sized for the largest."""

    def __init__(self, runtime: DeviceRuntime, pool: DevicePool) -> None:
        self.runtime = runtime
        self.pool = pool
        self.arena: Arena | None = None
        #: Incremented whenever the arena is allocated anew (addresses moved).
        self.generation = 0

    @property
    def capacity(self) -> int:
        return self.arena.capacity if self.arena is not None else 0

    def ensure(self, nbytes: int, graph: str) -> Arena:
        """The arena, at least `nbytes` large: allocated (again) when smaller. The message of an
        allocation the device cannot hold names `graph`, the graph that needs that much."""
        if self.arena is not None and self.arena.capacity >= nbytes:
            return self.arena
        if self.arena is not None:
            self.runtime.synchronize()
            self.arena.release()
            self.arena = None
        what = f"the activation arena of graph {graph}"
        try:
            self.arena = self.runtime.arena(nbytes, what)
        except DeviceOutOfMemory:
            self.pool.trim()
            self.arena = self.runtime.arena(nbytes, what)
        self.generation += 1
        return self.arena


def describe_memory(runtime: DeviceRuntime) -> str:
    free, total = runtime.memory_info()
    return f"{show_bytes(free)} free of {show_bytes(total)}"
