"""The simulated CUDA device: memory, compilation and launches.

    dev = SimDevice()
    module = dev.compile(source, "softmax.cu")
    x = dev.upload(rows)                               # a DeviceBuffer; int(x) is its device address
    y = dev.alloc(rows.nbytes, "y")
    dev.launch(module.kernel("softmax"), grid=n_rows, block=256, args=(y, x, n_cols))
    out = dev.download(y, np.float32, rows.shape)

A launch runs the blocks one after another on the calling thread, each
thread a fiber; it raises KernelFault when the kernel diverges at a barrier,
reads a warp lane that is not there, overflows a stack, faults, fails an
assert, or writes past a buffer (the canaries are checked after every
launch). `compare_schedules` runs a launch under both schedules from the
same memory and raises ScheduleMismatch when the results differ.
"""

from __future__ import annotations

import ctypes
import operator
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..bf16 import bf16_bits
from .compiler import SimKernel, SimModule, compile_module
from .errors import KernelFault, LaunchError, ScheduleMismatch
from .memory import DeviceBuffer, DeviceMemory, FiberStacks

#: Switch to the next thread in index order at every synchronisation point; blocks in order.
ROUND_ROBIN = "round-robin"
#: Run one warp until all its threads wait at a block barrier, from the last warp to the
#: first and each warp's lanes from the last to the first; blocks from the last to the first.
WARP_AFTER_WARP = "warp-after-warp"
SCHEDULES = (ROUND_ROBIN, WARP_AFTER_WARP)

MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_DIM = (1024, 1024, 64)
MAX_GRID_DIM = (2**31 - 1, 65535, 65535)
#: The header's kMaxDynamicShared (sm_90's opt-in maximum per block).
MAX_DYNAMIC_SHARED = 232448
DEFAULT_STACK_KIB = 64

_INTEGER_TYPES = {
    ("signed", 1): ctypes.c_int8, ("signed", 2): ctypes.c_int16, ("signed", 4): ctypes.c_int32,
    ("signed", 8): ctypes.c_int64, ("unsigned", 1): ctypes.c_uint8, ("unsigned", 2): ctypes.c_uint16,
    ("unsigned", 4): ctypes.c_uint32, ("unsigned", 8): ctypes.c_uint64,
}
_FLOAT_TYPES = {4: ctypes.c_float, 8: ctypes.c_double}
#: sexpgpu_sim_launch's results besides 0.
_FAULT, _CANARY_CHANGED = 1, 2
#: One launch at a time in the process: launches install signal handlers and share the fiber stacks.
_LAUNCH_LOCK = threading.Lock()


class _LaunchRequest(ctypes.Structure):
    """The header's LaunchRequest."""

    _fields_ = [
        ("kernel", ctypes.c_void_p),
        ("args", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint64),
        ("schedule", ctypes.c_int),
        ("stacks", ctypes.c_void_p),
        ("stack_stride", ctypes.c_uint64),
        ("guard_bytes", ctypes.c_uint64),
        ("stack_count", ctypes.c_uint64),
        ("buffers", ctypes.c_void_p),
        ("buffer_count", ctypes.c_uint64),
    ]


Dim3 = int | Sequence[int]


class SimDevice(DeviceMemory):
    """A simulated CUDA device: the memory API of DeviceMemory, plus compile and launch."""

    def __init__(self, *, stack_kib: int = DEFAULT_STACK_KIB, check_canaries: bool = True) -> None:
        super().__init__()
        self._stacks = FiberStacks(stack_kib * 1024)
        self.check_canaries_after_launch = check_canaries

    def compile(self, source: str, filename: str = "kernels.cu", cache_dir: Path | None = None) -> SimModule:
        """Compile `source` (cached on disk) and load it; see compiler.compile_module."""
        return compile_module(source, filename, cache_dir)

    def launch(self, kernel: SimKernel, grid: Dim3, block: Dim3, shared_bytes: int = 0, args: Sequence = (),
               *, schedule: str = ROUND_ROBIN) -> None:
        """Run `kernel` over `grid` blocks of `block` threads with `shared_bytes` of dynamic shared memory.

        `args` follow the kernel's parameters: device addresses (ints or
        DeviceBuffers, None for a null pointer) for pointers, ints for
        integers, floats (or ints) for floating point and bf16, bytes for
        anything else passed by value.
        """
        grid3 = _dim3(grid, "grid", MAX_GRID_DIM)
        block3 = _dim3(block, "block", MAX_BLOCK_DIM)
        threads = block3[0] * block3[1] * block3[2]
        if threads > MAX_THREADS_PER_BLOCK:
            raise LaunchError(f"kernel {kernel.name}: a block of {threads} threads is more than CUDA's "
                              f"{MAX_THREADS_PER_BLOCK}")
        if kernel.max_threads and threads > kernel.max_threads:
            raise LaunchError(f"kernel {kernel.name} is declared with __launch_bounds__({kernel.max_threads}) but "
                              f"launched with {threads} threads per block; CUDA refuses that launch")
        shared_bytes = operator.index(shared_bytes)
        if not 0 <= shared_bytes <= MAX_DYNAMIC_SHARED:
            raise LaunchError(f"kernel {kernel.name}: {shared_bytes} bytes of dynamic shared memory; "
                              f"a block may have 0 to {MAX_DYNAMIC_SHARED}")
        if schedule not in SCHEDULES:
            raise LaunchError(f"unknown schedule {schedule!r}; the schedules are {', '.join(SCHEDULES)}")
        keep, argv = self._pack(kernel, args)
        table = self.buffer_table()
        request = _LaunchRequest(kernel.info, ctypes.addressof(argv), grid3, block3, shared_bytes,
                                 SCHEDULES.index(schedule), self._stacks.base, self._stacks.stride,
                                 self._stacks.guard_bytes, self._stacks.count, ctypes.addressof(table),
                                 len(self._starts) if self.check_canaries_after_launch else 0)
        error = ctypes.create_string_buffer(4096)
        with _LAUNCH_LOCK:
            outcome = kernel.module.launch_entry(ctypes.addressof(request), error, len(error))
        del keep
        if outcome == _FAULT:
            message = error.value.decode(errors="replace")
            if damage := self.canary_report(kernel.name):
                message += f"; also, {damage}"
            raise KernelFault(message)
        if outcome == _CANARY_CHANGED:
            self.check_canaries(kernel.name)

    def compare_schedules(self, kernel: SimKernel, grid: Dim3, block: Dim3, shared_bytes: int = 0,
                          args: Sequence = (), *, buffers: Sequence[DeviceBuffer] | None = None) -> None:
        """Launch under each schedule from the same memory; ScheduleMismatch if `buffers` (default all) end up different.

        A kernel whose threads communicate through memory without the
        barrier that orders them (a missing __syncthreads or __syncwarp)
        reads other values in one order than in the other. Memory is left as
        the last schedule left it. Float atomics add in another order under
        each schedule, so their results may differ in the last bits: leave
        such buffers out of `buffers`.
        """
        everything = self.buffers
        compared = list(buffers) if buffers is not None else everything
        before = [buf.bytes_at(0, buf.nbytes).copy() for buf in everything]
        self.launch(kernel, grid, block, shared_bytes, args, schedule=SCHEDULES[0])
        first = [buf.bytes_at(0, buf.nbytes).copy() for buf in compared]
        for buf, data in zip(everything, before):
            buf.bytes_at(0, buf.nbytes)[:] = data
        self.launch(kernel, grid, block, shared_bytes, args, schedule=SCHEDULES[1])
        differences = []
        for buf, data in zip(compared, first):
            changed = np.flatnonzero(buf.bytes_at(0, buf.nbytes) != data)
            if changed.size:
                differences.append(f"buffer {buf.name} differs in {changed.size} of its {buf.nbytes} bytes "
                                   f"(the first at offset {int(changed[0])})")
        if differences:
            raise ScheduleMismatch(
                f"kernel {kernel.name} gives different results under the {SCHEDULES[0]} and {SCHEDULES[1]} "
                f"schedules, so its threads race (a missing __syncthreads or __syncwarp?): " + "; ".join(differences))

    def _pack(self, kernel: SimKernel, args: Sequence) -> tuple[list, ctypes.Array]:
        """The argument array the kernel's thunk reads (one pointer per parameter) and what keeps it alive."""
        if len(args) != len(kernel.params):
            raise LaunchError(f"kernel {kernel.signature()} takes {len(kernel.params)} arguments, "
                              f"not {len(args)}")
        values = [self._argument(kernel, i, value) for i, value in enumerate(args)]
        argv = (ctypes.c_void_p * max(1, len(values)))(*(_aligned_address(v, p.align)
                                                         for v, p in zip(values, kernel.params)))
        return values, argv

    def _argument(self, kernel: SimKernel, index: int, value: object) -> ctypes._SimpleCData | ctypes.Array:
        param = kernel.params[index]

        def refuse(why: str) -> LaunchError:
            return LaunchError(f"kernel {kernel.name}, argument {index + 1} ({param.type} {param.name}): {why}")

        if param.kind == "pointer":
            address = 0 if value is None else _as_int(value, refuse)
            if address and self.find(address) is None:
                raise refuse(f"{address:#x} is in no buffer of this device")
            return ctypes.c_void_p(address)
        if param.kind in ("signed", "unsigned"):
            number = _as_int(value, refuse)
            ctype = _INTEGER_TYPES[param.kind, param.size]
            if ctype(number).value != number:
                raise refuse(f"{number} does not fit")
            return ctype(number)
        if param.kind in ("float", "bfloat16"):
            if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
                raise refuse(f"expected a number, got {type(value).__name__}")
            if param.kind == "bfloat16":
                return ctypes.c_uint16(bf16_bits(float(value)))
            if param.size not in _FLOAT_TYPES:
                raise refuse(f"a {param.size}-byte floating-point parameter is not supported")
            return _FLOAT_TYPES[param.size](float(value))
        if not isinstance(value, (bytes, bytearray, memoryview)) or len(value) != param.size:
            raise refuse(f"pass the {param.size} bytes of the value")
        storage = ctypes.create_string_buffer(param.size + param.align)
        ctypes.memmove(_aligned_address(storage, param.align), bytes(value), param.size)
        return storage


def _aligned_address(value: ctypes._CData, align: int) -> int:
    address = ctypes.addressof(value)
    return -(-address // max(align, 1)) * max(align, 1)


def _as_int(value: object, refuse) -> int:
    if isinstance(value, (float, np.floating)):
        raise refuse(f"expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise refuse(f"expected an integer, got {type(value).__name__}") from None


def _dim3(value: Dim3, what: str, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    dims = [value] if isinstance(value, (int, np.integer)) else list(value)
    if not 1 <= len(dims) <= 3:
        raise LaunchError(f"{what} has 1 to 3 dimensions, not {len(dims)}")
    dims = [operator.index(d) for d in dims] + [1] * (3 - len(dims))
    for axis, (size, limit) in enumerate(zip(dims, limits)):
        if not 1 <= size <= limit:
            raise LaunchError(f"{what} dimension {'xyz'[axis]} is {size}; it must be 1 to {limit}")
    return dims[0], dims[1], dims[2]
