"""The simulated device's memory: numpy-backed buffers with canaries, and the fibers' stacks.

A device pointer is the host address of a buffer's bytes, so kernels compiled
for the host read and write them directly. Every buffer is 256-byte aligned
(as cudaMalloc's) and sits between two 256-byte canaries; a kernel that
writes past either end of a buffer changes a canary, which the device checks
after every launch (or when asked) and reports with the buffer's name.

Canaries and fresh allocations hold a poison pattern that reads as a quiet
NaN both as f32 and as bf16, so a kernel that reads memory it never wrote,
or past a buffer's end, tends to produce NaN.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import operator
import weakref
from collections.abc import Iterable

import numpy as np

from .errors import KernelFault, LaunchError

ALIGNMENT = 256
#: The header's kBufferCanaryBytes.
CANARY_BYTES = 256
#: The header's kPoisonWord: 0x7fc5 as bf16 and 0x7fc57fc5 as f32 are both quiet NaNs.
POISON_WORD = 0x7FC57FC5


def poison_bytes(address: int, count: int) -> np.ndarray:
    """The poison pattern for `count` bytes at `address` (phased so each aligned word is POISON_WORD)."""
    phase = address & 3
    return np.full(count // 4 + 2, POISON_WORD, dtype="<u4").view(np.uint8)[phase : phase + count]


class DeviceBuffer:
    """An allocation on the simulated device. It converts to its address (`int(buf)`, or as a kernel argument)."""

    __slots__ = ("name", "ptr", "nbytes", "_storage", "_start", "__weakref__")

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = nbytes
        self._storage = np.empty(nbytes + 2 * CANARY_BYTES + ALIGNMENT, dtype=np.uint8)
        base = self._storage.ctypes.data
        self._start = -(base + CANARY_BYTES) % ALIGNMENT + CANARY_BYTES
        self.ptr = base + self._start
        self._storage[:] = poison_bytes(base, self._storage.size)

    def __index__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"DeviceBuffer({self.name!r}, {self.nbytes} bytes at {self.ptr:#x})"

    def bytes_at(self, offset: int, count: int) -> np.ndarray:
        """A writable view of `count` bytes at `offset` in the buffer."""
        return self._storage[self._start + offset : self._start + offset + count]

    def _canaries(self) -> tuple[np.ndarray, np.ndarray]:
        return (self._storage[self._start - CANARY_BYTES : self._start],
                self._storage[self._start + self.nbytes : self._start + self.nbytes + CANARY_BYTES])

    def canary_damage(self) -> str | None:
        """Where a canary changed, in words, or None; either way the canaries are whole again afterwards."""
        found = []
        for side, canary, offset in zip(("before its start", "after its end"), self._canaries(),
                                         (-CANARY_BYTES, self.nbytes)):
            expected = poison_bytes(self.ptr + offset, CANARY_BYTES)
            changed = np.flatnonzero(canary != expected)
            if changed.size:
                found.append(f"{changed.size} byte(s) {side} (offsets {offset + int(changed[0])} "
                             f"to {offset + int(changed[-1])})")
                canary[:] = expected
        return "; ".join(found) or None


class DeviceMemory:
    """Allocation, host transfers and the canary check of a simulated device."""

    def __init__(self) -> None:
        self._buffers: dict[int, DeviceBuffer] = {}
        self._starts: list[int] = []
        self._count = 0
        self._table: ctypes.Array | None = None

    def alloc(self, nbytes: int, name: str | None = None) -> DeviceBuffer:
        """A new buffer of `nbytes`, filled with the poison pattern (device memory starts as garbage)."""
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise LaunchError(f"cannot allocate {nbytes} bytes")
        self._count += 1
        buf = DeviceBuffer(name or f"buffer{self._count}", nbytes)
        self._buffers[buf.ptr] = buf
        bisect.insort(self._starts, buf.ptr)
        self._table = None
        return buf

    def free(self, buf: DeviceBuffer) -> None:
        """Release `buf` (its canaries are checked first)."""
        if damage := self.canary_report(buffers=[buf]):
            raise KernelFault(damage)
        del self._buffers[buf.ptr]
        self._starts.remove(buf.ptr)
        self._table = None

    @property
    def buffers(self) -> list[DeviceBuffer]:
        return [self._buffers[p] for p in self._starts]

    def buffer_table(self) -> ctypes.Array:
        """(address, size) of every buffer, flat, for the runtime's canary check after a launch."""
        if self._table is None:
            flat = [n for buf in self.buffers for n in (buf.ptr, buf.nbytes)]
            self._table = (ctypes.c_uint64 * max(1, len(flat)))(*flat)
        return self._table

    def upload(self, array: np.ndarray, name: str | None = None) -> DeviceBuffer:
        """A new buffer holding a copy of `array`'s bytes (C order)."""
        data = np.ascontiguousarray(array)
        buf = self.alloc(data.nbytes, name)
        buf.bytes_at(0, data.nbytes)[:] = data.reshape(-1).view(np.uint8)
        return buf

    def write(self, dst: DeviceBuffer | int, array: np.ndarray) -> None:
        """Copy `array`'s bytes (C order) to device address `dst`."""
        data = np.ascontiguousarray(array)
        self._range(dst, data.nbytes, "write to")[:] = data.reshape(-1).view(np.uint8)

    def download(self, src: DeviceBuffer | int, dtype: np.dtype | type = np.uint8,
                 shape: int | tuple[int, ...] | None = None) -> np.ndarray:
        """A host copy of the device data at `src` as an array of `dtype` (the whole buffer without `shape`)."""
        dtype = np.dtype(dtype)
        if shape is None:
            if not isinstance(src, DeviceBuffer):
                raise LaunchError("download from a raw address needs a shape")
            shape = (src.nbytes // dtype.itemsize,)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self._range(src, count, "read").copy().view(dtype).reshape(shape)

    def copy(self, dst: DeviceBuffer | int, src: DeviceBuffer | int, nbytes: int) -> None:
        """Device-to-device copy of `nbytes` (the ranges may overlap)."""
        data = self._range(src, nbytes, "copy from").copy()
        self._range(dst, nbytes, "copy to")[:] = data

    def memset(self, dst: DeviceBuffer | int, value: int, nbytes: int) -> None:
        """Set `nbytes` bytes at `dst` to the byte `value`."""
        self._range(dst, nbytes, "memset")[:] = value & 0xFF

    def find(self, address: int) -> tuple[DeviceBuffer, int] | None:
        """The buffer holding `address` (its end included) and the offset into it."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0:
            buf = self._buffers[self._starts[i]]
            if address <= buf.ptr + buf.nbytes:
                return buf, address - buf.ptr
        return None

    def check_canaries(self, kernel: str | None = None) -> None:
        """Raise KernelFault naming every buffer whose canaries changed (and mend them)."""
        if damage := self.canary_report(kernel):
            raise KernelFault(damage)

    def canary_report(self, kernel: str | None = None, buffers: Iterable[DeviceBuffer] | None = None) -> str | None:
        """Which buffers' canaries changed, in words, or None; the canaries are mended either way."""
        damage = [f"buffer {buf.name} ({buf.nbytes} bytes at {buf.ptr:#x}): {what}"
                  for buf in (self.buffers if buffers is None else buffers) if (what := buf.canary_damage())]
        if not damage:
            return None
        who = f"kernel {kernel} wrote" if kernel else "something wrote"
        return f"{who} outside its buffers: " + "; ".join(damage)

    def _range(self, address: DeviceBuffer | int, nbytes: int, verb: str) -> np.ndarray:
        address, nbytes = operator.index(address), operator.index(nbytes)
        found = self.find(address)
        if found is None or nbytes < 0 or found[1] + nbytes > found[0].nbytes:
            where = f"buffer {found[0].name} of {found[0].nbytes} bytes" if found else "no buffer"
            raise LaunchError(f"cannot {verb} {nbytes} bytes at {address:#x}: that is outside {where}")
        buf, offset = found
        return buf.bytes_at(offset, nbytes)


class FiberStacks:
    """Stacks for the fibers of one block (1024 at most), each above a PROT_NONE guard page.

    They are mapped once, by this process's first launch, and reused by every
    block of every module; the pages a fiber touched stay committed.
    """

    MAX_THREADS = 1024

    def __init__(self, stack_bytes: int) -> None:
        self.guard_bytes = mmap.PAGESIZE
        self.stride = -(-stack_bytes // mmap.PAGESIZE) * mmap.PAGESIZE + self.guard_bytes
        self.count = self.MAX_THREADS
        self._base = 0

    @property
    def base(self) -> int:
        if not self._base:
            self._base = _map_stacks(self.count, self.stride, self.guard_bytes)
            weakref.finalize(self, _libc().munmap, ctypes.c_void_p(self._base), self.count * self.stride)
        return self._base


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def _map_stacks(count: int, stride: int, guard: int) -> int:
    libc = _libc()
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    base = libc.mmap(None, count * stride, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        raise MemoryError(f"cannot map {count} fiber stacks of {stride} bytes: errno {ctypes.get_errno()}")
    prot_none = 0
    for i in range(count):
        if libc.mprotect(base + i * stride, guard, prot_none) != 0:
            raise MemoryError(f"cannot protect a fiber stack's guard page: errno {ctypes.get_errno()}")
    return base
