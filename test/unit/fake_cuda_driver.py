"""A recording fake of cuda-python's driver module and of libcublasLt, so the real `CudaRuntime` runs in CI.

`FakeDriver` stands in for `cuda.bindings.driver` (`driver_cuda.load_driver`): its enums, handle types
and constants ARE cuda-python's (anything that is not a `cu*` function is read from the real module),
its functions are the driver calls the runtime makes, each

- checked against cuda-python's own signature, read from the function's docstring (the first line
  gives the C type of each scalar, the Parameters section the class of each handle and enum): a
  wrong type is a `TypeError` at once, as cuda-python raises one. Where no CUDA driver library is
  loadable (CI), the real function is called too, and must get as far as loading libcuda, which
  is how far it goes only when cuda-python has converted every argument;
- recorded (`calls`: name, arguments, result) and answered as the driver would: fake device
  addresses in a fake memory (256-byte aligned allocations whose bytes are kept, so copies, memsets
  and downloads move real data), real page-locked host memory for `cuMemHostAlloc` (the runtime
  writes into it), kernels and their parameter layout read from the CUBIN NVRTC compiled
  (`.nv.info` sections), launches recorded with their decoded arguments but never run;
- or failed with an injected `CUresult` (`fail`), or with a kernel's fault (`fault`): like the real
  driver after a fault, every later call returns the same error.

It enforces the rules a GPU enforces and cuda-sim does not, and records each breach in `violations`
(the tests assert there is none), returning the error the driver would:

- capture: between `cuStreamBeginCapture` and `cuStreamEndCapture` no synchronization, no device
  or page-locked allocation or free, no copy from or to pageable host memory, no module load
  (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, and the capture is invalidated); work on the capturing
  stream becomes nodes of the graph, run again at every `cuGraphLaunch`;
- host buffers of asynchronous copies: a page-locked buffer a copy reads must be alive and
  unchanged until the stream is synchronized or an event recorded after the copy is waited for,
  and one a copy writes must be alive until then (its bytes arrive only then, as on a GPU);
- kernel arguments: every pointer argument inside a live allocation and aligned as the kernel's
  vector accesses assume (`kernel_alignment`: kernel name -> bytes), launch shapes within the
  device's limits, dynamic shared memory within what the function was allowed.

`FakeCublasLt` stands in for libcublasLt (`cublaslt.cublaslt_library`, whose functions the
`cublaslt` module calls through ctypes): each call's arguments are converted by ctypes against the
prototype the module declares (`_PROTOTYPES`), descriptors keep their attributes (read back as
cuBLASLt reads them), the heuristic answers one algorithm that remembers the alignments it was asked
for, and `cublasLtMatmul` checks each matrix lies inside a live allocation at the extent its layout
says, aligned as promised, with the workspace and stream the runtime owns; on a capturing stream it
is a node of the graph.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import inspect
import re
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
from attrs import define
from cuda.bindings import driver as REAL
from sexpgpu.backends.cuda import cublaslt
from sexpgpu.backends.cuda.nvrtc import cubin_arch

R = REAL.CUresult
SUCCESS = R.CUDA_SUCCESS
#: Fake device addresses start here (far above any host address the tests see, and any size).
DEVICE_BASE = 0x7F00_0000_0000
#: What cuGetErrorString answers for the results the tests inject (the CUDA 13 driver's strings).
ERROR_STRINGS = {
    R.CUDA_ERROR_ILLEGAL_ADDRESS: b"an illegal memory access was encountered",
    R.CUDA_ERROR_OUT_OF_MEMORY: b"out of memory",
    R.CUDA_ERROR_MISALIGNED_ADDRESS: b"misaligned address",
    R.CUDA_ERROR_LAUNCH_FAILED: b"unspecified launch failure",
    R.CUDA_ERROR_INVALID_VALUE: b"invalid argument",
    R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: b"operation not permitted when stream is capturing",
    R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: b"operation failed due to a previous error during capture",
}
_C_INTEGERS = {"int": (-(1 << 31), (1 << 31) - 1), "unsigned int": (0, (1 << 32) - 1),
               "unsigned char": (0, 255), "size_t": (0, (1 << 64) - 1), "unsigned long long": (0, (1 << 64) - 1),
               "long long": (-(1 << 63), (1 << 63) - 1), "void_ptr": (0, (1 << 64) - 1)}
#: Calls a capturing stream forbids (CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: this thread's unsafe calls).
_UNSAFE_IN_CAPTURE = frozenset({"cuMemAlloc", "cuMemFree", "cuMemHostAlloc", "cuMemFreeHost", "cuStreamSynchronize",
                                "cuEventSynchronize", "cuCtxSynchronize", "cuModuleLoadData", "cuGraphInstantiate"})


# --- cuda-python's signatures ----------------------------------------------------------------------


@functools.cache
def signature(name: str) -> list[tuple[str, str | None, tuple[type, ...] | None]]:
    """Each parameter of `cuda.bindings.driver.<name>`: its name, its C scalar type (first docstring line) and
    the classes its Parameters section names (handles, enums), from cuda-python's own docstring."""
    doc = inspect.cleandoc(getattr(REAL, name).__doc__)
    head = doc.splitlines()[0]
    listed = head[head.index("(") + 1 : head.rindex(")")]
    documented = dict(_section_entries(doc, "Parameters"))
    params = []
    for text in filter(None, (p.strip() for p in listed.split(","))):
        if ":" in text:
            param, kind = (part.strip() for part in text.split(":"))
            ctype = None
        else:
            *words, param = text.replace("*", " * ").split()
            ctype = " ".join(words) or None
        classes = tuple(getattr(REAL, c) for c in re.findall(r":py:obj:`~\.(\w+)`", documented.get(param, ""))
                        if hasattr(REAL, c))
        params.append((param, ctype, classes or None))
    return params


def check_signature(name: str, args: tuple) -> None:
    """`args` as cuda-python's `name` takes them, else `TypeError` saying which parameter is wrong."""
    params = signature(name)
    if len(args) != len(params):
        raise TypeError(f"{name} takes {len(params)} arguments, not {len(args)}")
    for (param, ctype, classes), value in zip(params, args):
        if ctype in _C_INTEGERS:
            low, high = _C_INTEGERS[ctype]
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise TypeError(f"{name}: {param} must be a {ctype}, not {value!r}")
        elif ctype == "char *":
            if not isinstance(value, bytes):
                raise TypeError(f"{name}: {param} must be bytes, not {value!r}")
        elif classes is not None:
            pointer = REAL.CUdeviceptr in classes and isinstance(value, int) and not isinstance(value, bool)
            if not isinstance(value, classes) and not pointer:
                raise TypeError(f"{name}: {param} must be {' or '.join(c.__name__ for c in classes)}, not {value!r}")


@functools.cache
def returned_values(name: str) -> int:
    """How many values cuda-python's `name` returns after its CUresult (its docstring's Returns section)."""
    return len(_section_entries(inspect.cleandoc(getattr(REAL, name).__doc__), "Returns")) - 1


def _section_entries(doc: str, section: str) -> list[tuple[str, str]]:
    """The (name, type) entries of a numpydoc section (an entry without a name, `CUresult`, has it as its name):
    the lines indented as the section's first entry, up to the blank line that ends it."""
    found = re.search(rf"^( *){section}\n *-+\n(( *)\S.*\n(?:.*\S.*\n)*)", doc + "\n", re.M)
    if found is None:
        return []
    indent = found.group(3)
    entries = []
    for line in found.group(2).splitlines():
        if line.startswith(indent) and not line[len(indent):].startswith(" "):
            name, _, kind = line.strip().partition(" : ")
            entries.append((name, kind))
    return entries


@functools.cache
def real_driver_absent() -> bool:
    """Whether libcuda cannot load here, so calling cuda-python's real functions runs nothing."""
    try:
        REAL.cuDriverGetVersion()
    except RuntimeError:
        return True
    return False


def check_with_cuda_python(name: str, args: tuple) -> None:
    """Where no driver library loads: cuda-python's own function converts `args` and then fails to load libcuda;
    any other error is its verdict on an argument."""
    if not real_driver_absent():
        return
    try:
        getattr(REAL, name)(*args)
    except RuntimeError as err:
        if "libcuda" not in str(err):
            raise TypeError(f"cuda-python refused the arguments of {name}: {err}") from None
    except (TypeError, OverflowError, AttributeError, ValueError) as err:
        raise TypeError(f"cuda-python refused the arguments of {name}: {err}") from None


# --- CUBINs -----------------------------------------------------------------------------------------


def cubin_parameters(image: bytes) -> dict[str, list[tuple[int, int]]]:
    """Each kernel's (offset, size) per parameter, read from a CUBIN's `.nv.info.<kernel>` sections
    (EIATTR_KPARAM_INFO records: ordinal, offset, and the size in bits 18-31 of their flags)."""
    section_offset, = struct.unpack_from("<Q", image, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", image, 0x3A)
    sections = [struct.unpack_from("<I4xQ8xQQ", image, section_offset + i * entry_size) for i in range(count)]
    names_at = sections[names_index][2]
    kernels = {}
    for name_at, _, at, size in sections:
        name = image[names_at + name_at : image.index(b"\0", names_at + name_at)].decode()
        if not name.startswith(".nv.info."):
            continue
        params, end = {}, at + size
        while at < end:
            form, attribute = image[at], image[at + 1]
            if form == 4:  # EIFMT_SVAL: a 16-bit length, then the value
                length, = struct.unpack_from("<H", image, at + 2)
                if attribute == 0x17:  # EIATTR_KPARAM_INFO
                    _, ordinal, offset, flags = struct.unpack_from("<IHHI", image, at + 4)
                    params[ordinal] = (offset, (flags >> 18) & 0x3FFF)
                at += 4 + length
            else:  # EIFMT_NVAL, _BVAL, _HVAL: the value (if any) in the record's last 2 bytes
                at += 4
        kernels[name.removeprefix(".nv.info.")] = [params[i] for i in sorted(params)]
    return kernels


# --- the fake driver ---------------------------------------------------------------------------------


class Call:
    """One driver or cuBLASLt call: its name, arguments and result (a CUresult or cublasStatus_t)."""

    def __init__(self, name: str, args: tuple) -> None:
        self.name = name
        self.args = args
        self.result: Any = SUCCESS
        #: For a launch: the kernel's name and its decoded arguments (ints; pointers are device addresses).
        self.kernel: str | None = None
        self.values: tuple[int, ...] = ()
        #: Whether it was recorded into a graph (enqueued on a capturing stream).
        self.captured = False

    def __repr__(self) -> str:
        return f"{self.name}{'[' + self.kernel + ']' if self.kernel else ''} -> {getattr(self.result, 'name', self.result)}"


class Injected(Exception):
    """Carries the result an injected failure makes a call return."""

    def __init__(self, result: Any) -> None:
        self.result = result


@define
class Pending:
    """An asynchronous copy touching page-locked host memory, not yet known to have run."""

    call: str
    host: int
    nbytes: int
    reads: bool
    snapshot: bytes | None
    #: For a copy into host memory: what moves the bytes, when a synchronization shows the copy ran.
    deliver: Callable[[], None] | None
    #: Set once a synchronization showed the copy has run.
    done: bool = False


def driver_call(function: Callable) -> Callable:
    """A fake driver function: signature checked, call recorded, injected failures and sticky faults
    answered, the result returned as cuda-python returns it (a tuple whose first item is the CUresult)."""
    name = function.__name__
    outputs = returned_values(name)

    @functools.wraps(function)
    def call(self: FakeDriver, *args: Any) -> tuple:
        check_signature(name, args)
        check_with_cuda_python(name, args)
        record = Call(name, args)
        self.calls.append(record)
        try:
            if self.sticky is not None and name not in ("cuGetErrorString",):
                raise Injected(self.sticky)
            self._injected(name)
            if self.capturing and name in _UNSAFE_IN_CAPTURE:
                self.violation(f"{name} while a stream is capturing")
                self._invalidate_captures()
                raise Injected(R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
            values = function(self, record, *args)
        except Injected as failure:
            record.result = failure.result
            return (failure.result, *([None] * outputs))
        values = () if values is None else values if isinstance(values, tuple) else (values,)
        return (SUCCESS, *values)

    return call


class FakeDriver:
    """`cuda.bindings.driver` for one fake GPU (see the module docstring)."""

    def __init__(self, *, name: bytes = b"NVIDIA H200", capability: tuple[int, int] = (9, 0),
                 total_memory: int = 141 << 30, kernel_alignment: Callable[[str], int] | None = None,
                 devices: int = 1) -> None:
        self.name = name
        self.devices = devices
        self.capability = capability
        self.total_memory = total_memory
        self.kernel_alignment = kernel_alignment
        self.calls: list[Call] = []
        self.violations: list[str] = []
        #: A kernel's fault, once one happened: every later call returns it.
        self.sticky: Any = None
        self._failures: dict[str, list[tuple[int, Any]]] = {}
        self._faults: dict[str, Any] = {}
        self._counts: dict[str, int] = {}
        self._next_address = DEVICE_BASE
        self._handles = 0x1000
        self.allocations: dict[int, np.ndarray] = {}
        self._starts: list[int] = []
        self.pinned: dict[int, ctypes.Array] = {}
        self.modules: dict[int, dict[str, list[tuple[int, int]]]] = {}
        self.functions: dict[int, tuple[str, list[tuple[int, int]]]] = {}
        self.shared_allowed: dict[int, int] = {}
        self.streams: set[int] = set()
        self.pending: dict[int, list[Pending]] = {}
        self.events: dict[int, list[Pending]] = {}
        #: stream handle -> the nodes captured so far (None once invalidated)
        self.capturing: dict[int, list[Callable[[], None]] | None] = {}
        self.graphs: dict[int, list[Callable[[], None]]] = {}
        self.executables: dict[int, list[Callable[[], None]]] = {}
        self.primary_retained = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("cu") and callable(getattr(REAL, name, None)):
            raise AttributeError(f"the fake driver does not implement {name}")
        return getattr(REAL, name)

    # -- what tests ask for -----------------------------------------------------------------------

    def fail(self, call: str, result: Any, nth: int = 1) -> None:
        """The `nth` call of `call` from now returns `result` (a kernel's fault becomes sticky)."""
        self._failures.setdefault(call, []).append((self._counts.get(call, 0) + nth, result))

    def fault(self, kernel: str, result: Any = R.CUDA_ERROR_ILLEGAL_ADDRESS) -> None:
        """The next launch of `kernel` succeeds, and the kernel faults: every call after it returns `result`."""
        self._faults[kernel] = result

    def violation(self, what: str) -> None:
        self.violations.append(what)

    def names(self) -> list[str]:
        return [call.name for call in self.calls]

    def launches(self) -> list[Call]:
        return [call for call in self.calls if call.name == "cuLaunchKernel" and call.result == SUCCESS]

    # -- machinery --------------------------------------------------------------------------------

    def _injected(self, name: str) -> None:
        self._counts[name] = self._counts.get(name, 0) + 1
        for entry in self._failures.get(name, []):
            if entry[0] == self._counts[name]:
                self._failures[name].remove(entry)
                if driver_result_name(entry[1]) in STICKY:
                    self.sticky = entry[1]
                raise Injected(entry[1])

    def _handle(self, kind: type) -> Any:
        self._handles += 0x10
        return kind(self._handles)

    def _invalidate_captures(self) -> None:
        for stream in self.capturing:
            self.capturing[stream] = None

    def _span(self, address: int, nbytes: int, what: str) -> np.ndarray:
        """The fake device bytes at `address`; a violation and CUDA_ERROR_INVALID_VALUE outside every allocation."""
        index = bisect.bisect_right(self._starts, address) - 1
        if index >= 0:
            start = self._starts[index]
            block = self.allocations[start]
            if address + nbytes <= start + block.size:
                return block[address - start : address - start + nbytes]
        self.violation(f"{what}: {nbytes} bytes at {address:#x} are outside every live allocation")
        raise Injected(R.CUDA_ERROR_INVALID_VALUE)

    def _pinned_block(self, address: int, nbytes: int) -> bool:
        return any(start <= address and address + nbytes <= start + ctypes.sizeof(block)
                   for start, block in self.pinned.items())

    def _enqueue(self, record: Call, stream: Any, work: Callable[[], None]) -> None:
        """Run `work` now, or record it into the graph of the capturing `stream`."""
        handle = int(stream)
        if handle not in self.streams:
            self.violation(f"{record.name} on stream {handle:#x}, which is not a live stream")
            raise Injected(R.CUDA_ERROR_INVALID_HANDLE)
        if handle in self.capturing:
            nodes = self.capturing[handle]
            if nodes is not None:
                nodes.append(work)
            record.captured = True
        else:
            work()

    def _complete(self, pending: list[Pending], where: str) -> None:
        for copy in pending:
            if copy.done:
                continue
            copy.done = True
            if not self._pinned_block(copy.host, copy.nbytes):
                self.violation(f"the host buffer of {copy.call} ({copy.host:#x}) was freed before {where}")
                continue
            if copy.reads and ctypes.string_at(copy.host, copy.nbytes) != copy.snapshot:
                self.violation(f"the host buffer of {copy.call} ({copy.host:#x}) changed before {where}")
            if copy.deliver is not None:
                copy.deliver()

    # -- device and context -----------------------------------------------------------------------

    @driver_call
    def cuInit(self, record, flags):  # noqa: N802 - the driver's names
        return None

    @driver_call
    def cuDriverGetVersion(self, record):  # noqa: N802
        return 13000

    @driver_call
    def cuDeviceGetCount(self, record):  # noqa: N802
        return self.devices

    @driver_call
    def cuDeviceGet(self, record, ordinal):  # noqa: N802
        if not 0 <= ordinal < self.devices:
            raise Injected(R.CUDA_ERROR_INVALID_DEVICE)
        return REAL.CUdevice(ordinal)

    @driver_call
    def cuDevicePrimaryCtxRetain(self, record, dev):  # noqa: N802
        self.primary_retained += 1
        return REAL.CUcontext(0xC0)

    @driver_call
    def cuDevicePrimaryCtxRelease(self, record, dev):  # noqa: N802
        self.primary_retained -= 1

    @driver_call
    def cuCtxSetCurrent(self, record, ctx):  # noqa: N802
        return None

    @driver_call
    def cuDeviceGetName(self, record, length, dev):  # noqa: N802
        return self.name.ljust(length, b"\0")

    @driver_call
    def cuDeviceGetAttribute(self, record, attrib, dev):  # noqa: N802
        values = {REAL.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: self.capability[0],
                  REAL.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: self.capability[1]}
        return values[attrib]

    @driver_call
    def cuMemGetInfo(self, record):  # noqa: N802
        used = sum(block.size for block in self.allocations.values())
        return self.total_memory - used, self.total_memory

    @driver_call
    def cuGetErrorString(self, record, error):  # noqa: N802
        return ERROR_STRINGS.get(error, error.name.encode())

    # -- memory -----------------------------------------------------------------------------------

    @driver_call
    def cuMemAlloc(self, record, bytesize):  # noqa: N802
        if sum(block.size for block in self.allocations.values()) + bytesize > self.total_memory:
            raise Injected(R.CUDA_ERROR_OUT_OF_MEMORY)
        address = self._next_address
        self._next_address += -(-bytesize // 512) * 512 + 512  # cudaMalloc's 256 bytes, and a gap
        self.allocations[address] = np.zeros(bytesize, np.uint8)  # calloc: untouched pages cost nothing
        bisect.insort(self._starts, address)
        return REAL.CUdeviceptr(address)

    @driver_call
    def cuMemFree(self, record, dptr):  # noqa: N802
        address = int(dptr)
        if address not in self.allocations:
            self.violation(f"cuMemFree of {address:#x}, which is not an allocation")
            raise Injected(R.CUDA_ERROR_INVALID_VALUE)
        del self.allocations[address]
        self._starts.remove(address)

    @driver_call
    def cuMemHostAlloc(self, record, bytesize, flags):  # noqa: N802
        block = (ctypes.c_uint8 * (bytesize + 4096))()
        address = -(-ctypes.addressof(block) // 4096) * 4096  # page-aligned, as the driver's
        self.pinned[address] = block
        return address

    @driver_call
    def cuMemFreeHost(self, record, p):  # noqa: N802
        if p not in self.pinned:
            self.violation(f"cuMemFreeHost of {p:#x}, which cuMemHostAlloc did not return")
            raise Injected(R.CUDA_ERROR_INVALID_VALUE)
        for copies in [*self.pending.values(), *self.events.values()]:
            if any(p <= c.host < p + ctypes.sizeof(self.pinned[p]) and not c.done for c in copies):
                self.violation(f"page-locked memory at {p:#x} freed while an asynchronous copy of it may not have run")
        del self.pinned[p]

    # -- copies -----------------------------------------------------------------------------------

    def _host_copy(self, record: Call, stream: Any, host: int, nbytes: int, reads: bool,
                   move: Callable[[], None]) -> None:
        pinned = self._pinned_block(host, nbytes)
        if not pinned:
            if int(stream) in self.capturing:
                self.violation(f"{record.name} with pageable host memory while the stream is capturing")
                self._invalidate_captures()
                raise Injected(R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
            move()  # pageable: the driver stages (or completes) the copy before returning
            return

        def run() -> None:
            snapshot = ctypes.string_at(host, nbytes) if reads else None
            if reads:
                move()
            self.pending.setdefault(int(stream), []).append(
                Pending(record.name, host, nbytes, reads, snapshot, None if reads else move))

        self._enqueue(record, stream, run)

    @driver_call
    def cuMemcpyHtoDAsync(self, record, dstDevice, srcHost, ByteCount, hStream):  # noqa: N802, N803
        target = self._span(int(dstDevice), ByteCount, "cuMemcpyHtoDAsync")

        def move() -> None:
            target[:] = np.frombuffer(ctypes.string_at(srcHost, ByteCount), np.uint8)

        self._host_copy(record, hStream, srcHost, ByteCount, True, move)

    @driver_call
    def cuMemcpyDtoHAsync(self, record, dstHost, srcDevice, ByteCount, hStream):  # noqa: N802, N803
        source = self._span(int(srcDevice), ByteCount, "cuMemcpyDtoHAsync")

        def move() -> None:
            ctypes.memmove(dstHost, source.ctypes.data, ByteCount)

        self._host_copy(record, hStream, dstHost, ByteCount, False, move)

    @driver_call
    def cuMemcpyDtoDAsync(self, record, dstDevice, srcDevice, ByteCount, hStream):  # noqa: N802, N803
        target = self._span(int(dstDevice), ByteCount, "cuMemcpyDtoDAsync")
        source = self._span(int(srcDevice), ByteCount, "cuMemcpyDtoDAsync")
        self._enqueue(record, hStream, lambda: target.__setitem__(slice(None), source.copy()))

    @driver_call
    def cuMemsetD8Async(self, record, dstDevice, uc, N, hStream):  # noqa: N802, N803
        target = self._span(int(dstDevice), N, "cuMemsetD8Async")
        self._enqueue(record, hStream, lambda: target.fill(uc))

    # -- streams and events -----------------------------------------------------------------------

    @driver_call
    def cuStreamCreate(self, record, flags):  # noqa: N802
        stream = self._handle(REAL.CUstream)
        self.streams.add(int(stream))
        return stream

    @driver_call
    def cuStreamDestroy(self, record, hStream):  # noqa: N802, N803
        self.streams.discard(int(hStream))

    @driver_call
    def cuStreamSynchronize(self, record, hStream):  # noqa: N802, N803
        self._complete(self.pending.pop(int(hStream), []), "cuStreamSynchronize")

    @driver_call
    def cuEventCreate(self, record, flags):  # noqa: N802
        return self._handle(REAL.CUevent)

    @driver_call
    def cuEventDestroy(self, record, hEvent):  # noqa: N802, N803
        self.events.pop(int(hEvent), None)

    @driver_call
    def cuEventRecord(self, record, hEvent, hStream):  # noqa: N802, N803
        self._enqueue(record, hStream, lambda: self.events.__setitem__(
            int(hEvent), list(self.pending.get(int(hStream), []))))

    @driver_call
    def cuStreamWaitEvent(self, record, hStream, hEvent, Flags):  # noqa: N802, N803
        # Work runs as it is enqueued, so what the event marks has run; the call is recorded for its order.
        if int(hStream) not in self.streams:
            self.violation(f"cuStreamWaitEvent on stream {int(hStream):#x}, which is not a live stream")
            raise Injected(R.CUDA_ERROR_INVALID_HANDLE)

    @driver_call
    def cuEventSynchronize(self, record, hEvent):  # noqa: N802, N803
        self._complete(self.events.pop(int(hEvent), []), "cuEventSynchronize")
        for copies in self.pending.values():
            copies[:] = [c for c in copies if not c.done]

    @driver_call
    def cuEventElapsedTime(self, record, hStart, hEnd):  # noqa: N802, N803
        return 0.5

    # -- modules and launches ---------------------------------------------------------------------

    @driver_call
    def cuModuleLoadData(self, record, image):  # noqa: N802
        arch = f"sm_{self.capability[0]}{self.capability[1]}"
        if not isinstance(image, bytes) or image[:4] != b"\x7fELF":
            self.violation("cuModuleLoadData of something that is not a CUBIN")
            raise Injected(R.CUDA_ERROR_INVALID_IMAGE)
        if cubin_arch(image) != arch:
            raise Injected(R.CUDA_ERROR_NO_BINARY_FOR_GPU)
        module = self._handle(REAL.CUmodule)
        self.modules[int(module)] = cubin_parameters(image)
        return module

    @driver_call
    def cuModuleGetFunction(self, record, hmod, name):  # noqa: N802
        kernels = self.modules[int(hmod)]
        if name.decode() not in kernels:
            raise Injected(R.CUDA_ERROR_NOT_FOUND)
        function = self._handle(REAL.CUfunction)
        self.functions[int(function)] = (name.decode(), kernels[name.decode()])
        self.shared_allowed[int(function)] = 48 * 1024
        return function

    @driver_call
    def cuFuncGetParamInfo(self, record, func, paramIndex):  # noqa: N802, N803
        params = self.functions[int(func)][1]
        if paramIndex >= len(params):
            raise Injected(R.CUDA_ERROR_INVALID_VALUE)
        return params[paramIndex]

    @driver_call
    def cuFuncGetAttribute(self, record, attrib, hfunc):  # noqa: N802
        assert attrib == REAL.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        return self.shared_allowed[int(hfunc)]

    @driver_call
    def cuFuncSetAttribute(self, record, hfunc, attrib, value):  # noqa: N802
        if value > 227 * 1024:  # an H100's or H200's opt-in maximum
            raise Injected(R.CUDA_ERROR_INVALID_VALUE)
        self.shared_allowed[int(hfunc)] = value

    @driver_call
    def cuLaunchKernel(self, record, f, gx, gy, gz, bx, by, bz, shared, hStream, kernelParams, extra):  # noqa: N802, N803
        name, params = self.functions[int(f)]
        record.kernel = name
        if bx * by * bz > 1024 or gy > 65535 or gz > 65535 or min(gx, gy, gz, bx, by, bz) < 1:
            self.violation(f"launch of {name} with grid {(gx, gy, gz)} and block {(bx, by, bz)}")
            raise Injected(R.CUDA_ERROR_INVALID_VALUE)
        if shared > self.shared_allowed[int(f)]:
            self.violation(f"launch of {name} with {shared} bytes of dynamic shared memory, above its limit")
            raise Injected(R.CUDA_ERROR_INVALID_VALUE)
        if extra != 0 or not isinstance(kernelParams, int):
            self.violation(f"launch of {name}: kernelParams must be the address of the pointer array, extra 0")
            raise Injected(R.CUDA_ERROR_INVALID_VALUE)
        pointers = (ctypes.c_void_p * max(1, len(params))).from_address(kernelParams)
        values = []
        for index, (_, size) in enumerate(params):
            raw = ctypes.string_at(pointers[index], size)
            values.append(int.from_bytes(raw, "little"))
        record.values = tuple(values)
        alignment = self.kernel_alignment(name) if self.kernel_alignment is not None else 1
        for index, ((_, size), value) in enumerate(zip(params, values)):
            if size == 8 and value >= DEVICE_BASE:  # a device address: a GPU would fault later, not refuse
                with contextlib.suppress(Injected):
                    self._span(value, 0, f"argument {index + 1} of {name}")
                if value % alignment:
                    self.violation(f"argument {index + 1} of {name} is {value:#x}, not {alignment}-byte aligned")
        self._enqueue(record, hStream, lambda: None)
        if name in self._faults:
            self.sticky = self._faults.pop(name)

    # -- capture ----------------------------------------------------------------------------------

    @driver_call
    def cuStreamBeginCapture(self, record, hStream, mode):  # noqa: N802, N803
        if int(hStream) in self.capturing:
            raise Injected(R.CUDA_ERROR_ILLEGAL_STATE)
        self.capturing[int(hStream)] = []

    @driver_call
    def cuStreamEndCapture(self, record, hStream):  # noqa: N802, N803
        if int(hStream) not in self.capturing:
            raise Injected(R.CUDA_ERROR_ILLEGAL_STATE)
        nodes = self.capturing.pop(int(hStream))
        if nodes is None:
            raise Injected(R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        graph = self._handle(REAL.CUgraph)
        self.graphs[int(graph)] = nodes
        return graph

    @driver_call
    def cuGraphInstantiate(self, record, hGraph, flags):  # noqa: N802, N803
        instance = self._handle(REAL.CUgraphExec)
        self.executables[int(instance)] = list(self.graphs[int(hGraph)])
        return instance

    @driver_call
    def cuGraphLaunch(self, record, hGraphExec, hStream):  # noqa: N802, N803
        nodes = self.executables[int(hGraphExec)]
        self._enqueue(record, hStream, lambda: [node() for node in nodes])

    @driver_call
    def cuGraphExecDestroy(self, record, hGraphExec):  # noqa: N802, N803
        del self.executables[int(hGraphExec)]

    @driver_call
    def cuGraphDestroy(self, record, hGraph):  # noqa: N802, N803
        del self.graphs[int(hGraph)]


def driver_result_name(result: Any) -> str:
    return getattr(result, "name", str(result))


#: Results the driver keeps returning once a kernel faulted (driver_cuda's list).
STICKY = frozenset({"CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_TIMEOUT", "CUDA_ERROR_ASSERT",
                    "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS",
                    "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC", "CUDA_ERROR_LAUNCH_FAILED",
                    "CUDA_ERROR_TENSOR_MEMORY_LEAK"})


# --- the fake cuBLASLt ------------------------------------------------------------------------------


def _target(argument: Any) -> Any:
    """The ctypes object behind `ctypes.byref(obj)` (where cuBLASLt writes its outputs)."""
    return argument._obj


class FakeCublasLt:
    """libcublasLt as the `cublaslt` module calls it (see the module docstring)."""

    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver
        self._handles = 0xB000
        self.live: dict[int, str] = {}
        self.attributes: dict[int, dict[int, int]] = {}
        self.layouts: dict[int, tuple[int, int, int, int]] = {}  # (dtype, rows, cols, ld)
        for name, (_, argtypes) in cublaslt._PROTOTYPES.items():
            setattr(self, name, self._function(name, argtypes))

    def _function(self, name: str, argtypes: list[type]) -> Callable[..., int]:
        body = getattr(self, "_" + name, None)

        def call(*args: Any) -> int:
            if len(args) != len(argtypes):
                raise TypeError(f"{name} takes {len(argtypes)} arguments, not {len(args)}")
            for argtype, value in zip(argtypes, args):
                argtype.from_param(value)  # ctypes' own conversion: a TypeError for a wrong argument
            record = Call(name, args)
            self.driver.calls.append(record)
            if self.driver.sticky is not None and name == "cublasLtMatmul":
                record.result = cublaslt.Status.CUBLAS_STATUS_EXECUTION_FAILED
                return int(record.result)
            try:
                self.driver._injected(name)
            except Injected as failure:
                record.result = failure.result
                return int(failure.result)
            result = body(*args) if body is not None else None
            return 0 if result is None else int(result)

        call.__name__ = name
        return call

    def _new(self, kind: str, out: Any) -> None:
        self._handles += 0x10
        self.live[self._handles] = kind
        self.attributes[self._handles] = {}
        _target(out).value = self._handles

    def _destroy(self, handle: int) -> None:
        if self.live.pop(handle, None) is None:
            self.driver.violation(f"cuBLASLt destroy of {handle:#x}, which is not live")

    def _cublasLtGetVersion(self) -> int:  # noqa: N802
        return 130002

    def _cublasLtCreate(self, out) -> None:  # noqa: N802
        self._new("handle", out)

    def _cublasLtDestroy(self, handle) -> None:  # noqa: N802
        self._destroy(handle)

    def _cublasLtMatmulDescCreate(self, out, compute, scale) -> None:  # noqa: N802
        self._new("matmul", out)

    def _cublasLtMatmulDescDestroy(self, handle) -> None:  # noqa: N802
        self._destroy(handle)

    def _set(self, handle: int, attribute: int, buffer: Any, size: int, enum: type) -> int | None:
        ctype = cublaslt.ATTRIBUTE_CTYPES[enum][enum(attribute)]
        if size != ctypes.sizeof(ctype):
            return cublaslt.Status.CUBLAS_STATUS_INVALID_VALUE
        self.attributes[handle][attribute] = _target(buffer).value or 0
        return None

    def _get(self, handle: int, attribute: int, buffer: Any, size: int, written: Any) -> None:
        target = _target(buffer)
        target.value = self.attributes[handle].get(attribute, 0)
        _target(written).value = size

    def _cublasLtMatmulDescSetAttribute(self, handle, attribute, buffer, size):  # noqa: N802
        return self._set(handle, attribute, buffer, size, cublaslt.MatmulDescAttribute)

    def _cublasLtMatmulDescGetAttribute(self, handle, attribute, buffer, size, written) -> None:  # noqa: N802
        self._get(handle, attribute, buffer, size, written)

    def _cublasLtMatrixLayoutCreate(self, out, dtype, rows, cols, ld) -> None:  # noqa: N802
        self._new("layout", out)
        handle = _target(out).value
        self.attributes[handle].update({0: dtype, 2: rows, 3: cols, 4: ld, 5: 1, 6: 0})

    def _cublasLtMatrixLayoutDestroy(self, handle) -> None:  # noqa: N802
        self._destroy(handle)

    def _cublasLtMatrixLayoutSetAttribute(self, handle, attribute, buffer, size):  # noqa: N802
        return self._set(handle, attribute, buffer, size, cublaslt.MatrixLayoutAttribute)

    def _cublasLtMatrixLayoutGetAttribute(self, handle, attribute, buffer, size, written) -> None:  # noqa: N802
        self._get(handle, attribute, buffer, size, written)

    def _cublasLtMatmulPreferenceCreate(self, out) -> None:  # noqa: N802
        self._new("preference", out)

    def _cublasLtMatmulPreferenceDestroy(self, handle) -> None:  # noqa: N802
        self._destroy(handle)

    def _cublasLtMatmulPreferenceSetAttribute(self, handle, attribute, buffer, size):  # noqa: N802
        return self._set(handle, attribute, buffer, size, cublaslt.PreferenceAttribute)

    def _cublasLtMatmulAlgoGetHeuristic(self, handle, matmul, a, b, c, d, preference, requested, result,  # noqa: N802
                                        returned) -> None:
        found = _target(result)
        wanted = self.attributes[preference]
        # The algorithm remembers the alignments it was chosen for; cublasLtMatmul checks the pointers keep them.
        for slot, attribute in enumerate(range(5, 9)):
            found.algo[slot] = wanted.get(attribute, 256)
        found.workspaceSize = 0
        _target(returned).value = 1

    def _cublasLtMatmul(self, handle, matmul, alpha, a, a_layout, b, b_layout, beta, c, c_layout, d, d_layout,  # noqa: N802
                        algo, workspace, workspace_bytes, stream) -> int | None:
        record = self.driver.calls[-1]
        for live, kind in ((handle, "handle"), (matmul, "matmul"), (a_layout, "layout"), (b_layout, "layout"),
                           (c_layout, "layout"), (d_layout, "layout")):
            if self.live.get(live) != kind:
                self.driver.violation(f"cublasLtMatmul with a {kind} {live:#x} that is not live")
        alignments = list(_target(algo))[:4]
        try:
            self.driver._span(workspace, workspace_bytes, "cuBLASLt's workspace")
            for name, pointer, layout, alignment in (("A", a, a_layout, alignments[0]), ("B", b, b_layout, alignments[1]),
                                                     ("C", c, c_layout, alignments[2]), ("D", d, d_layout, alignments[3])):
                self._check_matrix(name, pointer, self.attributes[layout], alignment)
            bias_epilogue = self.attributes[matmul].get(cublaslt.MatmulDescAttribute.CUBLASLT_MATMUL_DESC_EPILOGUE, 1) != 1
            if bias_epilogue and self.attributes[matmul].get(cublaslt.MatmulDescAttribute.CUBLASLT_MATMUL_DESC_BIAS_POINTER):
                self.driver._span(self.attributes[matmul][cublaslt.MatmulDescAttribute.CUBLASLT_MATMUL_DESC_BIAS_POINTER],
                                  1, "the GEMM's bias")
            self.driver._enqueue(record, REAL.CUstream(stream or 0), lambda: None)
        except Injected:
            return cublaslt.Status.CUBLAS_STATUS_INVALID_VALUE
        return None

    def _check_matrix(self, name: str, pointer: int, layout: dict[int, int], alignment: int) -> None:
        element = {0: 4, 2: 2, 14: 2}[layout[0]]
        rows, cols, ld, batch, stride = layout[2], layout[3], layout[4], layout[5], layout[6]
        extent = ((batch - 1) * stride + (cols - 1) * ld + rows) * element
        self.driver._span(pointer, extent, f"cublasLtMatmul's {name}")
        if pointer % alignment:
            self.driver.violation(f"cublasLtMatmul's {name} at {pointer:#x} is not {alignment}-byte aligned, as its "
                                  "algorithm was chosen for")


def install(monkeypatch: Any, **options: Any) -> FakeDriver:
    """Make `driver_cuda` and `cublaslt` use a new fake driver and fake cuBLASLt for the test."""
    from sexpgpu.backends.cuda import driver_cuda

    fake = FakeDriver(**options)
    library = FakeCublasLt(fake)
    monkeypatch.setattr(driver_cuda, "load_driver", lambda: fake)
    monkeypatch.setattr(cublaslt, "cublaslt_library", lambda: library)
    cublaslt.descriptors_for.cache_clear()
    monkeypatch.setattr(cublaslt, "descriptors_for", functools.cache(cublaslt.GemmDescriptors))
    fake.cublaslt = library
    return fake


__all__ = ["FakeCublasLt", "FakeDriver", "check_signature", "cubin_parameters", "install"]
