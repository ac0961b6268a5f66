"""The device runtime: one small interface over a CUDA device, with three drivers behind it.

The CUDA executor sees a device only through `DeviceRuntime`:

    runtime = open_runtime("cuda")                         # selection.py: cuda-python, pycuda or cuda-sim
    params = runtime.arena(1 << 30, "the persistent arena")  # one allocation, carved by offset
    w = params.allocate(host_w.nbytes, "model.w")          # a DeviceSpan, 256-byte aligned
    runtime.upload(w, host_w)                              # async on the runtime's stream
    module = runtime.load_module(KernelSource("train", cuda_c, runtime.compiler.compile(cuda_c, "train")))
    runtime.launch(module.function("fused_3"), grid=64, block=256, shared_bytes=0, args=(out, w, 4096))
    runtime.gemm(spec, a, b, d)                            # cuBLASLt on a GPU, numpy on cuda-sim
    with runtime.capture() as captured:                    # stream capture -> a replayable graph
        ...
    captured.graph.launch()

The drivers: `driver_cuda.CudaRuntime` (cuda-python's driver API, the primary context),
`driver_pycuda.PycudaRuntime` (PyCUDA's primary context; no capture) and `driver_sim.SimRuntime`
(the simulated device of `sim/`: the same CUDA C compiled by g++, numpy GEMMs, capture recorded and
replayed). Each carries its `KernelCompiler` (`compiler`): NVRTC to CUBIN for the two GPU drivers
(`lowering.NvrtcCompiler`), the host C++ compiler to a shared object for cuda-sim
(`driver_sim.HostCompiler`); the CUDA C they compile is the same (`render/`). What the drivers
share lives here: the arena's arithmetic, kernel-argument typing and packing, pinned staging of
batches, device scalars updated inside a captured graph, and the errors.

Every operation that touches device memory is ordered on a stream (`stream=None` is the runtime's
own, `default_stream`); `download` and `synchronize` wait for it. Errors: a user's (`SxError`, exit
1) when the device cannot open or memory runs out; an internal one otherwise (`DeviceError`,
`KernelLaunchError` naming the kernel, to which the executor adds the model path).
"""

from __future__ import annotations

import ctypes
import functools
import operator
import struct
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

import numpy as np
from attrs import define, field, frozen

from ...byte_text import show_bytes
from ...diagnostics import SxError
from ..executor import OutOfDeviceMemory
from .bf16 import bf16_bits
from .compiler import KernelCompiler
from .source import find_kernels

if TYPE_CHECKING:
    from .cublaslt import GemmSpec

#: Every allocation and every arena offset is a multiple of this (cudaMalloc's guarantee, and what
#: 128-bit loads and cuBLASLt's best algorithms want).
ALIGNMENT = 256


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """`nbytes` rounded up to a multiple of `alignment`."""
    return -(-operator.index(nbytes) // alignment) * alignment


# --- errors -------------------------------------------------------------------------------------


class DeviceUnavailable(SxError):
    """The device cannot open here (no driver, no GPU, no such device id, a driver not installed):
    a user error in one line. `reason` is the line without the device's name, for executor probes."""

    def __init__(self, device: str, reason: str) -> None:
        super().__init__(f"the {device} device cannot open: {reason}")
        self.device = device
        self.reason = reason


class DeviceOutOfMemory(OutOfDeviceMemory):
    """An allocation the device (or an arena) cannot hold: a user error naming what asked for how
    many bytes and how many were free (the model is too large for the device, or the batch)."""

    def __init__(self, what: str, requested: int, available: int, where: str) -> None:
        super().__init__(f"out of device memory: {what} needs {show_bytes(requested)} ({requested} bytes), but only "
                         f"{show_bytes(available)} ({available} bytes) {'are' if available != 1 else 'is'} free {where}")
        self.what = what
        self.requested = requested
        self.available = available


class DeviceError(RuntimeError):
    """A driver call that failed: a bug in sexpgpu or in a kernel (internal error, exit 3)."""


class KernelLaunchError(DeviceError):
    """A kernel the device refused to launch or that failed while running (internal error, exit 3).

    It names the kernel; the executor, which knows the region a launch came from, adds its model
    path with `at` (as `KernelCompileError.at` does for the compiler's errors).
    """

    def __init__(self, kernel: str, message: str, model_path: str | None = None) -> None:
        super().__init__(kernel, message, model_path)
        self.kernel = kernel
        self.message = message
        self.model_path = model_path

    def at(self, model_path: str) -> KernelLaunchError:
        """This error, naming the model path of the region the kernel was generated from."""
        self.model_path = model_path
        return self

    def __str__(self) -> str:
        where = f" (model path {self.model_path})" if self.model_path else ""
        return f"kernel {self.kernel}{where}: {self.message}"


class CaptureError(DeviceError):
    """Stream capture misused (an allocation or a synchronization inside it), invalidated, or
    unavailable with this driver."""


# --- what the runtime hands out --------------------------------------------------------------------


@frozen
class DeviceInfo:
    """The opened device."""

    index: int
    name: str
    total_memory: int
    #: Free bytes when the device was opened (`DeviceRuntime.memory_info` tells the current figure).
    free_memory: int
    compute_capability: tuple[int, int]
    #: "cuda-python", "pycuda" or "cuda-sim".
    driver: str

    @property
    def arch(self) -> str:
        """The architecture NVRTC compiles CUBIN for: `sm_90` for compute capability 9.0."""
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    def describe(self) -> str:
        return (f"{self.name} (device {self.index}, {self.arch}, {show_bytes(self.total_memory)}, "
                f"driver {self.driver})")


@frozen
class DeviceSpan:
    """`nbytes` of device memory at `address`; usable wherever an address is (`int(span)`, kernel arguments)."""

    address: int
    nbytes: int

    def __index__(self) -> int:
        return self.address

    def __int__(self) -> int:
        return self.address

    def at(self, offset: int, nbytes: int) -> DeviceSpan:
        """The `nbytes` at `offset` inside this span."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes at offset {offset} are outside a span of {self.nbytes} bytes")
        return DeviceSpan(self.address + offset, nbytes)


def check_fits(address: DeviceSpan | int, nbytes: int, what: str) -> None:
    """A transfer of `nbytes` must fit the span it reads or writes (a bare address is not checked)."""
    if isinstance(address, DeviceSpan) and nbytes > address.nbytes:
        raise ValueError(f"{what} of {nbytes} bytes into a span of {address.nbytes}")


class Arena:
    """One device allocation carved by offset, every piece 256-byte aligned.

    The executor keeps two kinds: a persistent arena for the parameters, gradients and optimizer
    states of the whole run, carved with `allocate`; and one activation arena per graph, whose
    offsets `plan-buffers` already chose, read with `at`. `reset` forgets what `allocate` carved,
    `release` gives the memory back to the device.
    """

    def __init__(self, runtime: DeviceRuntime, name: str, block: DeviceSpan) -> None:
        self.runtime = runtime
        self.name = name
        self.block = block
        self.used = 0

    @property
    def base(self) -> int:
        return self.block.address

    @property
    def capacity(self) -> int:
        return self.block.nbytes

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def allocate(self, nbytes: int, what: str) -> DeviceSpan:
        """The next `nbytes` (aligned); `DeviceOutOfMemory` naming `what` when the arena is full."""
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"{what}: cannot allocate {nbytes} bytes")
        if self.used + nbytes > self.capacity:
            raise DeviceOutOfMemory(what, nbytes, self.free, f"in {self.name} of {show_bytes(self.capacity)}")
        span = DeviceSpan(self.base + self.used, nbytes)
        self.used = min(self.capacity, align_up(self.used + nbytes))
        return span

    def at(self, offset: int, nbytes: int) -> DeviceSpan:
        """The `nbytes` at a planned `offset` (bounds-checked)."""
        return self.block.at(offset, nbytes)

    def offset_of(self, address: int) -> int:
        offset = operator.index(address) - self.base
        if not 0 <= offset <= self.capacity:
            raise ValueError(f"{address:#x} is not in {self.name}")
        return offset

    def reset(self) -> None:
        self.used = 0

    def release(self) -> None:
        self.runtime.free(self.block)
        self.used = 0


@frozen
class KernelSource:
    """A CUDA C translation unit to load, and what the runtime's compiler made of it.

    `binary` is the output of the loading runtime's `compiler` for `source` (an `nvrtc.Cubin` for the
    GPU drivers, a host-compiled `sim.SimModule` for cuda-sim); None: the runtime has its compiler
    make it when loading. `name` names the module in messages.
    """

    name: str
    source: str
    binary: Any = None


# --- kernel parameters and their packing --------------------------------------------------------------

_QUALIFIERS = frozenset({"const", "volatile", "__restrict__", "__restrict", "restrict"})
#: Declared scalar types (qualifiers removed, words joined by one space) -> (kind, size), LP64.
_SCALAR_TYPES = {
    **{t: ("signed", 1) for t in ("char", "signed char", "int8_t")},
    **{t: ("unsigned", 1) for t in ("unsigned char", "uint8_t", "bool")},
    **{t: ("signed", 2) for t in ("short", "short int", "signed short", "int16_t")},
    **{t: ("unsigned", 2) for t in ("unsigned short", "unsigned short int", "uint16_t")},
    **{t: ("signed", 4) for t in ("int", "signed", "signed int", "int32_t")},
    **{t: ("unsigned", 4) for t in ("unsigned", "unsigned int", "uint32_t")},
    **{t: ("signed", 8) for t in ("long", "long int", "long long", "long long int", "signed long",
                                   "signed long long", "int64_t", "ptrdiff_t", "intptr_t")},
    **{t: ("unsigned", 8) for t in ("unsigned long", "unsigned long int", "unsigned long long",
                                     "unsigned long long int", "uint64_t", "size_t", "uintptr_t")},
    "float": ("float", 4),
    "double": ("float", 8),
    "__nv_bfloat16": ("bfloat16", 2),
}


@frozen
class ParamType:
    """One kernel parameter: its kind ("pointer", "signed", "unsigned", "float" or "bfloat16"), its size
    in bytes, and its declared name and type."""

    kind: str
    size: int
    name: str
    declared: str

    @property
    def struct_code(self) -> str:
        """The `struct` format character of the value (bf16 travels as its 16 bits)."""
        if self.kind == "pointer":
            return "Q"
        if self.kind == "float":
            return "f" if self.size == 4 else "d"
        code = {1: "b", 2: "h", 4: "i", 8: "q"}[self.size]
        return code if self.kind == "signed" else code.upper()


def param_type(declared: str, name: str) -> ParamType:
    """The `ParamType` of a parameter declared as `declared`; ValueError for what the runtime cannot pass
    (structs and vectors by value)."""
    if "*" in declared:
        return ParamType("pointer", 8, name, declared)
    words = [w for w in declared.replace("&", " & ").split() if w not in _QUALIFIERS]
    found = _SCALAR_TYPES.get(" ".join(words))
    if found is None:
        raise ValueError(f"parameter {name} has type {declared}; the runtime passes pointers and "
                         "arithmetic scalars (int, unsigned, int64_t, size_t, float, double, __nv_bfloat16)")
    return ParamType(found[0], found[1], name, declared)


def declared_kernels(source: str) -> dict[str, tuple[ParamType, ...]]:
    """The `extern "C" __global__` kernels of a CUDA source with their parameters, by name."""
    kernels = {}
    for decl in find_kernels(source):
        try:
            kernels[decl.name] = tuple(param_type(p.type, p.name) for p in decl.params)
        except ValueError as err:
            raise DeviceError(f"kernel {decl.name}: {err}") from None
    return kernels


@frozen
class Kernel:
    """A kernel of a loaded module: its name, its typed parameters and the driver's handle."""

    name: str
    params: tuple[ParamType, ...]
    handle: Any = field(eq=False, repr=False)

    def signature(self) -> str:
        return f"{self.name}({', '.join(f'{p.declared} {p.name}' for p in self.params)})"


class LoadedModule:
    """A module loaded on the device: its kernels by name."""

    def __init__(self, name: str, kernels: Mapping[str, Kernel], handle: Any = None) -> None:
        self.name = name
        self.kernels = dict(kernels)
        #: The driver's module (CUmodule, pycuda Module, SimModule).
        self.handle = handle

    def function(self, name: str) -> Kernel:
        try:
            return self.kernels[name]
        except KeyError:
            known = ", ".join(self.kernels) or "none"
            raise DeviceError(f"module {self.name} has no kernel named {name} (its kernels: {known})") from None


#: The values each integer kind and size holds (a pointer is an unsigned 64-bit address).
_INTEGER_RANGES = {(kind, size): ((-(1 << (8 * size - 1)), (1 << (8 * size - 1)) - 1) if kind == "signed"
                                  else (0, (1 << (8 * size)) - 1))
                   for kind in ("signed", "unsigned") for size in (1, 2, 4, 8)}
_INTEGER_RANGES["pointer", 8] = _INTEGER_RANGES["unsigned", 8]
_NUMBERS = (int, float, np.integer, np.floating)
_NOT_INTEGERS = (float, np.floating, bool, np.bool_)


def argument_value(kernel: str, index: int, param: ParamType, value: object) -> int | float:
    """`value` checked against the parameter and converted to what `struct` packs for it: an address
    for a pointer (ints, `DeviceSpan`s, None for null), an int in range, a float, or bf16's bits."""
    if param.kind in ("float", "bfloat16"):
        if isinstance(value, _NUMBERS) and not isinstance(value, (bool, np.bool_)):
            return bf16_bits(float(value)) if param.kind == "bfloat16" else float(value)
        raise _refused(kernel, index, param, f"expected a number, got {type(value).__name__}")
    if value is None and param.kind == "pointer":
        return 0
    expected = "an address" if param.kind == "pointer" else "an integer"
    if isinstance(value, _NOT_INTEGERS):
        raise _refused(kernel, index, param, f"expected {expected}, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise _refused(kernel, index, param, f"expected {expected}, got {type(value).__name__}") from None
    low, high = _INTEGER_RANGES[param.kind, param.size]
    if not low <= number <= high:
        raise _refused(kernel, index, param, f"{number} does not fit")
    return number


def _refused(kernel: str, index: int, param: ParamType, why: str) -> KernelLaunchError:
    return KernelLaunchError(kernel, f"argument {index + 1} ({param.declared} {param.name}): {why}")


@frozen
class ParameterLayout:
    """Where each parameter's value sits in a packed argument buffer: at its natural alignment, as in
    the C struct of the same members (and as NVRTC lays out the kernel's parameter space)."""

    offsets: tuple[int, ...]
    #: Packs every value at its offset, little-endian, padding zeroed.
    packer: struct.Struct
    #: The buffer's size in 8-byte words.
    words: int


@functools.cache
def parameter_layout(params: tuple[ParamType, ...]) -> ParameterLayout:
    offsets, codes, end = [], ["<"], 0
    for param in params:
        start = align_up(end, param.size)
        codes += [f"{start - end}x" if start > end else "", param.struct_code]
        offsets.append(start)
        end = start + param.size
    return ParameterLayout(tuple(offsets), struct.Struct("".join(codes)), max(1, -(-end // 8)))


class PackedArguments:
    """Kernel arguments as cuLaunchKernel takes them: `storage` holds each value at its natural
    alignment, `pointers` is the array of N pointers into it (`kernelParams`), `address` its address.

    Both must stay alive until the launch is enqueued (the driver copies the values then; a captured
    launch copies them into the graph), which holding this object guarantees.
    """

    def __init__(self, params: tuple[ParamType, ...], values: Sequence[int | float]) -> None:
        layout = parameter_layout(params)
        self.offsets = layout.offsets
        # c_uint64 storage: 8-byte aligned, so every offset aligned to its size is aligned in memory too.
        self.storage = (ctypes.c_uint64 * layout.words)()
        layout.packer.pack_into(self.storage, 0, *values)
        base = ctypes.addressof(self.storage)
        self.pointers = (ctypes.c_void_p * max(1, len(params)))(*[base + at for at in layout.offsets])
        self.address = ctypes.addressof(self.pointers)

    def __len__(self) -> int:
        return len(self.offsets)


def typed_arguments(kernel: Kernel, args: Sequence) -> list[int | float]:
    """`args` checked against the kernel's parameters and converted (`argument_value`);
    `KernelLaunchError` for a wrong count or a value that does not fit its parameter."""
    if len(args) != len(kernel.params):
        raise KernelLaunchError(kernel.name, f"{kernel.signature()} takes {len(kernel.params)} arguments, "
                                f"not {len(args)}")
    return [argument_value(kernel.name, i, p, a) for i, (p, a) in enumerate(zip(kernel.params, args))]


def check_alignment(kernel: Kernel, args: Sequence, alignment: int, model_path: str | None = None) -> None:
    """Every pointer argument must be `alignment`-byte aligned, as the kernel's vector accesses assume;
    else `KernelLaunchError` naming the argument, before the device meets a misaligned access."""
    for index, (param, value) in enumerate(zip(kernel.params, args)):
        if param.kind == "pointer" and value is not None and operator.index(value) % alignment:
            raise KernelLaunchError(kernel.name, f"argument {index + 1} ({param.declared} {param.name}) is "
                                    f"{operator.index(value):#x}, not {alignment}-byte aligned as the kernel's "
                                    "vector accesses assume", model_path)


def pack_arguments(kernel: Kernel, args: Sequence) -> PackedArguments:
    """`args` typed by the kernel's parameters and packed for cuLaunchKernel."""
    return PackedArguments(kernel.params, typed_arguments(kernel, args))


Dim3 = int | Sequence[int]


def dim3(value: Dim3, what: str, kernel: str) -> tuple[int, int, int]:
    """A grid or block shape as three positive ints."""
    dims = [value] if isinstance(value, (int, np.integer)) else list(value)
    if not 1 <= len(dims) <= 3 or any(operator.index(d) < 1 for d in dims):
        raise KernelLaunchError(kernel, f"{what} must be 1 to 3 positive sizes, not {value!r}")
    dims = [operator.index(d) for d in dims] + [1] * (3 - len(dims))
    return dims[0], dims[1], dims[2]


# --- streams, events, captured graphs -----------------------------------------------------------------


class Stream(ABC):
    """An ordered queue of device work."""

    #: The driver's handle as an int (CUstream), for libraries such as cuBLASLt; 0 on cuda-sim.
    handle: int

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until everything enqueued so far has run."""

    @abstractmethod
    def wait(self, event: Event) -> None:
        """Work enqueued on this stream from now on runs after `event`'s recorded point (the host does not
        wait): how work on a side stream (NCCL's) is ordered with the compute stream."""


class Event(ABC):
    """A point in a stream's work: recorded, waited for, timed."""

    @abstractmethod
    def record(self, stream: Stream | None = None) -> None:
        """Mark the point after everything enqueued on `stream` so far."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until the recorded point is reached (at once if never recorded)."""

    @abstractmethod
    def elapsed_ms(self, start: Event) -> float:
        """Milliseconds from `start` to this event, both recorded and reached."""


class CapturedGraph(ABC):
    """The work captured on a stream, instantiated once and launched (replayed) any number of times.

    A replay does what the captured calls did, at the same addresses, with the arguments they had; it
    reads device memory (and pinned host memory a captured upload reads) as it is at replay time,
    which is how captured kernels see a new step or learning rate (`DeviceScalars`).
    """

    def __init__(self) -> None:
        #: Recorded after each launch, on the launching stream (see `DeviceScalars`).
        self.after_launch: list[Event] = []

    def launch(self, stream: Stream | None = None) -> None:
        """Enqueue one replay of the captured work on `stream`."""
        self._launch(stream)
        for event in self.after_launch:
            event.record(stream)

    @abstractmethod
    def _launch(self, stream: Stream | None) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Free the graph (the driver's objects); it cannot be launched afterwards."""


@define
class Capture:
    """A capture in progress on `stream`; `graph` is set when it ends."""

    stream: Stream
    after_launch: list[Event] = field(factory=list)
    graph: CapturedGraph | None = None


# --- the interface ------------------------------------------------------------------------------------


class DeviceRuntime(ABC):
    """One opened CUDA device: memory, transfers, modules, launches, GEMMs, streams, events, capture.

    See the module docstring. Subclasses implement the abstract methods; capture bookkeeping, arenas
    and the pinned-memory registry are shared here.
    """

    device: DeviceInfo
    #: The compiler whose binaries this runtime loads.
    compiler: KernelCompiler
    #: The stream `stream=None` means. A non-default stream on a GPU, so it can be captured.
    default_stream: Stream
    #: None where stream capture works; else why not, in words (for the lowering report).
    capture_unavailable: str | None = None
    #: The model path of the launches being enqueued (the executor sets it), which an error about a
    #: kernel's fault reported at a later call names.
    launch_path: str | None = None

    def __init__(self) -> None:
        self._captures: dict[int, Capture] = {}
        self._pinned_ranges: dict[int, int] = {}  # start -> end of each pinned host block

    # memory ---------------------------------------------------------------------------------------

    @abstractmethod
    def allocate(self, nbytes: int, what: str) -> DeviceSpan:
        """One device allocation (256-byte aligned); `DeviceOutOfMemory` naming `what` when the device
        cannot hold it. Not allowed during capture. Prefer arenas: one allocation, carved by offset."""

    @abstractmethod
    def free(self, span: DeviceSpan) -> None:
        """Give back an allocation made by `allocate`."""

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory now."""

    def arena(self, nbytes: int, name: str) -> Arena:
        """An arena of `nbytes` (rounded up to the alignment) named `name` in messages."""
        return Arena(self, name, self.allocate(align_up(max(nbytes, 1)), name))

    @abstractmethod
    def _pinned_block(self, nbytes: int) -> np.ndarray:
        """`nbytes` of page-locked host memory as a uint8 array; the array, or the object that is its
        `base`, owns the memory and frees it when collected."""

    def pinned(self, shape: int | Sequence[int], dtype: Any) -> np.ndarray:
        """A page-locked host array: uploads from it and downloads into it are truly asynchronous, and
        a captured upload may read it (pageable memory cannot be captured)."""
        self._check_not_capturing("allocating pinned host memory")
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        block = self._pinned_block(max(nbytes, 1))
        start = block.ctypes.data
        self._pinned_ranges[start] = start + block.nbytes
        # Views of an array name its owner as their base (numpy collapses chains of views), so the range
        # is forgotten when the owner, and with it the memory, goes.
        weakref.finalize(block if block.base is None else block.base, self._pinned_ranges.pop, start, None)
        return block[:nbytes].view(dtype).reshape(shape)

    def is_pinned(self, host: np.ndarray) -> bool:
        """Whether `host`'s bytes lie inside one pinned block of this runtime."""
        start = host.ctypes.data
        return any(low <= start and start + host.nbytes <= high for low, high in self._pinned_ranges.items())

    # transfers ------------------------------------------------------------------------------------

    @abstractmethod
    def upload(self, dst: DeviceSpan | int, host: np.ndarray, stream: Stream | None = None) -> None:
        """Enqueue the copy of `host`'s bytes (C order) to `dst`. From pageable memory the call returns
        once the driver has staged the bytes, so `host` may change at once; from pinned memory
        (`pinned`) the copy reads `host` when it runs, so keep it unchanged until then (an event, or
        `PinnedStaging`). Inside capture only pinned memory may be uploaded."""

    @abstractmethod
    def download(self, src: DeviceSpan | int, dtype: Any, shape: int | Sequence[int],
                 stream: Stream | None = None) -> np.ndarray:
        """A new host array of `dtype` and `shape` from the bytes at `src`, after the work enqueued on
        `stream` before it (the call waits). Not allowed during capture."""

    @abstractmethod
    def download_async(self, src: DeviceSpan | int, out: np.ndarray, stream: Stream | None = None) -> None:
        """Enqueue the copy of `out.nbytes` bytes at `src` into the pinned array `out`; it holds them once
        the stream reaches the copy (record an event after it)."""

    @abstractmethod
    def copy(self, dst: DeviceSpan | int, src: DeviceSpan | int, nbytes: int, stream: Stream | None = None) -> None:
        """Enqueue a device-to-device copy of `nbytes`."""

    @abstractmethod
    def memset(self, dst: DeviceSpan | int, byte: int, nbytes: int, stream: Stream | None = None) -> None:
        """Enqueue setting `nbytes` bytes at `dst` to `byte`."""

    # code -----------------------------------------------------------------------------------------

    def binary(self, source: KernelSource) -> Any:
        """`source`'s binary: the one it carries, else its compiler's."""
        return source.binary if source.binary is not None else self.compiler.compile(source.source, source.name)

    @abstractmethod
    def load_module(self, source: KernelSource) -> LoadedModule:
        """Load a module (its `binary`, compiled when it carries none); kernels by name."""

    @abstractmethod
    def launch(self, kernel: Kernel, grid: Dim3, block: Dim3, shared_bytes: int = 0, args: Sequence = (),
               stream: Stream | None = None) -> None:
        """Enqueue `kernel` over `grid` blocks of `block` threads with `shared_bytes` of dynamic shared
        memory. `args` follow the kernel's parameters: device addresses (ints, `DeviceSpan`s, None) for
        pointers, ints for integers, numbers for float, double and bf16. `KernelLaunchError` naming the
        kernel when the device refuses it or it fails."""

    @abstractmethod
    def gemm(self, spec: GemmSpec, a: DeviceSpan | int, b: DeviceSpan | int, d: DeviceSpan | int,
             c: DeviceSpan | int | None = None, bias: DeviceSpan | int | None = None, alpha: float = 1.0,
             beta: float = 0.0, stream: Stream | None = None) -> None:
        """Enqueue D = alpha · op(A) @ op(B) + beta · C (+ the spec's epilogue), row-major as `GemmSpec`
        says, f32 accumulation, rounded once to the output dtype. C defaults to D; C is not read when
        beta is 0. `bias` is the vector a bias epilogue reads or a bias-gradient epilogue writes."""

    # ordering -------------------------------------------------------------------------------------

    @abstractmethod
    def stream(self) -> Stream:
        """A new stream."""

    @abstractmethod
    def event(self) -> Event:
        """A new event (with timing)."""

    def synchronize(self) -> None:
        """Wait until all work on the default stream has run."""
        self.default_stream.synchronize()

    def make_current(self) -> None:  # noqa: B027 - a driver without per-thread contexts needs nothing
        """Make the device's context current on the calling thread (a thread other than the opener's)."""

    # capture --------------------------------------------------------------------------------------

    def capturing(self, stream: Stream | None = None) -> Capture | None:
        """The capture in progress on `stream`, or None."""
        return self._captures.get(id(stream or self.default_stream))

    def begin_capture(self, stream: Stream | None = None) -> None:
        """From now on, work enqueued on `stream` is recorded into a graph instead of run."""
        if self.capture_unavailable:
            raise CaptureError(f"stream capture is unavailable: {self.capture_unavailable}")
        stream = stream or self.default_stream
        if id(stream) in self._captures:
            raise CaptureError("the stream is already capturing")
        self._begin_capture(stream)
        self._captures[id(stream)] = Capture(stream)

    def end_capture(self, stream: Stream | None = None) -> CapturedGraph:
        """End the capture on `stream`: the recorded work as an instantiated graph."""
        stream = stream or self.default_stream
        capture = self._captures.pop(id(stream), None)
        if capture is None:
            raise CaptureError("the stream is not capturing")
        graph = self._end_capture(stream)
        graph.after_launch.extend(capture.after_launch)
        capture.graph = graph
        return graph

    @contextmanager
    def capture(self, stream: Stream | None = None) -> Iterator[Capture]:
        """`with runtime.capture() as captured: ...`, then `captured.graph`. An exception inside ends
        the capture and drops what it recorded."""
        self.begin_capture(stream)
        try:
            captured = self._captures[id(stream or self.default_stream)]
            yield captured
        except BaseException:
            if self.capturing(stream) is not None:
                with suppress(DeviceError):  # an invalidated capture: the first error is the one to see
                    self.end_capture(stream).close()
            raise
        self.end_capture(stream)

    def _check_not_capturing(self, what: str) -> None:
        if self._captures:
            raise CaptureError(f"{what} is not allowed while a stream is capturing; do it before the capture")

    def _check_capturable_host(self, host: np.ndarray, stream: Stream | None, what: str) -> None:
        if self.capturing(stream) is not None and not self.is_pinned(host):
            raise CaptureError(f"{what} inside capture must use pinned host memory (runtime.pinned): a replay "
                               "reads the host buffer again, and pageable memory cannot be captured")

    @abstractmethod
    def _begin_capture(self, stream: Stream) -> None: ...

    @abstractmethod
    def _end_capture(self, stream: Stream) -> CapturedGraph: ...

    # lifetime -------------------------------------------------------------------------------------

    @abstractmethod
    def close(self) -> None:
        """Wait for the device, free what the runtime allocated, release the context."""

    def __enter__(self) -> DeviceRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- shared helpers over the interface ------------------------------------------------------------------


class PinnedStaging:
    """Uploads of batches through pinned buffers, so the copy of the next batch overlaps the step running.

    `slots` pinned buffers of `nbytes` are used in turn; before a buffer is refilled, the copy that
    last read it must have run (an event per buffer), so the host waits only when it is `slots`
    uploads ahead of the device.
    """

    def __init__(self, runtime: DeviceRuntime, nbytes: int, slots: int = 2) -> None:
        self.runtime = runtime
        self.nbytes = nbytes
        self._buffers = [runtime.pinned(nbytes, np.uint8) for _ in range(slots)]
        self._copied = [runtime.event() for _ in range(slots)]
        self._next = 0

    def upload(self, dst: DeviceSpan | int, host: np.ndarray, stream: Stream | None = None) -> None:
        """Enqueue the copy of `host` to `dst` through the next pinned buffer; `host` may change at once."""
        data = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        if data.nbytes > self.nbytes:
            raise ValueError(f"{data.nbytes} bytes do not fit the staging buffers of {self.nbytes}")
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        self._copied[slot].synchronize()
        staged = self._buffers[slot][: data.nbytes]
        staged[:] = data
        self.runtime.upload(dst, staged, stream)
        self._copied[slot].record(stream)


class DeviceScalars:
    """Named scalars in device memory that kernels read (the step, the learning rate), updated by a copy
    from a pinned host mirror that may itself be captured.

        scalars = DeviceScalars(runtime, arena, {"step": np.int32, "lr": np.float32})
        scalars.set(step=1, lr=3e-4); scalars.update()     # eager: the copy runs before later work
        with runtime.capture() as captured:
            scalars.update()                               # the graph's first node: mirror -> device
            runtime.launch(adamw, ..., args=(..., scalars.address("lr"), ...))
        scalars.set(step=2, lr=2.9e-4); captured.graph.launch()   # the replay copies the new values

    `set` waits until no enqueued copy (eager, or a launched graph that holds one) still reads the
    mirror, so a value never changes under a copy that has not run.
    """

    def __init__(self, runtime: DeviceRuntime, arena: Arena, fields: Mapping[str, Any], name: str = "scalars") -> None:
        self.runtime = runtime
        self.offsets: dict[str, int] = {}
        self.dtypes = {key: np.dtype(dtype) for key, dtype in fields.items()}
        nbytes = 0
        for key, dtype in self.dtypes.items():
            nbytes = align_up(nbytes, dtype.itemsize)
            self.offsets[key] = nbytes
            nbytes += dtype.itemsize
        self.span = arena.allocate(nbytes, name)
        self._mirror = runtime.pinned(max(nbytes, 1), np.uint8)
        self._mirror[:] = 0
        self._copied = runtime.event()

    def address(self, key: str) -> int:
        """The device address of scalar `key` (a kernel argument)."""
        return self.span.address + self.offsets[key]

    def set(self, **values: float | int) -> None:
        """Write new values into the host mirror (after any enqueued copy that reads it has run)."""
        self._copied.synchronize()
        for key, value in values.items():
            if key not in self.offsets:
                raise KeyError(f"no device scalar {key}; the scalars are {', '.join(self.offsets)}")
            dtype = self.dtypes[key]
            self._mirror[self.offsets[key] : self.offsets[key] + dtype.itemsize] = \
                np.array(value, dtype=dtype).reshape(1).view(np.uint8)

    def value(self, key: str) -> float | int:
        """The host mirror's value of `key` (what the next copy writes)."""
        dtype = self.dtypes[key]
        return self._mirror[self.offsets[key] : self.offsets[key] + dtype.itemsize].view(dtype)[0].item()

    def update(self, stream: Stream | None = None) -> None:
        """Enqueue the copy of the mirror to the device scalars (inside capture: a node of the graph)."""
        self.runtime.upload(self.span, self._mirror[: self.span.nbytes], stream)
        capture = self.runtime.capturing(stream)
        if capture is None:
            self._copied.record(stream)
        elif not any(event is self._copied for event in capture.after_launch):
            capture.after_launch.append(self._copied)
