"""NCCL for CUDA ranks: a thin ctypes layer over `libnccl.so.2` from the `nvidia-nccl-cu13` wheel.

Why ctypes and not NVIDIA's `nccl4py`: nccl4py 0.6 requires `cuda-core` and,
for CUDA 13, `nvidia-cutlass-dsl` (its device-side API), far more than the
handful of host calls data parallelism makes; the library itself, from the
wheel the `cuda` extra installs, loads without a GPU, so the layer is built
and unit-tested on any machine (symbols, argument marshalling, the unique id
shared through MPI). llm.c calls the same few functions from C
(`llmc/zero.cuh`): rank 0 makes the unique id, MPI broadcasts it, every rank
joins the communicator with `ncclCommInitRank`, and a step reduce-scatters
the gradients (`ncclReduceScatter` with `ncclAvg`) and all-gathers the
parameters on a stream of their own.

Device buffers and streams are passed as integers (a `CUdeviceptr`, a
`CUstream` handle), as the CUDA executor's runtime holds them.

Not yet wired into the CUDA executor: GPU ranks reduce through MPI by host
staging (docs/distributed.md, "Not yet").
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path
from typing import Any

from ...diagnostics import SxError
from ..distributed import Communicator
from .errors import CudaToolchainMissing

#: ncclDataType_t, by IR dtype.
DATA_TYPES = {"i8": 0, "u8": 1, "i32": 2, "u32": 3, "i64": 4, "u64": 5, "f16": 6, "f32": 7, "f64": 8, "bf16": 9}
#: ncclRedOp_t.
REDUCTIONS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
#: NCCL_UNIQUE_ID_BYTES.
UNIQUE_ID_BYTES = 128


class UniqueId(ctypes.Structure):
    """ncclUniqueId: the bytes rank 0 makes and every rank joins the communicator with."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class NcclError(SxError):
    """A call NCCL refused: the call, NCCL's error string and its last words."""


_VOID_P = ctypes.c_void_p
_COMM = ctypes.c_void_p
_STREAM = ctypes.c_void_p
#: name → (argument types) of every function the layer calls; each returns ncclResult_t (an int).
SIGNATURES: dict[str, list[Any]] = {
    "ncclGetVersion": [ctypes.POINTER(ctypes.c_int)],
    "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
    "ncclCommInitRank": [ctypes.POINTER(_COMM), ctypes.c_int, UniqueId, ctypes.c_int],
    "ncclCommDestroy": [_COMM],
    "ncclCommAbort": [_COMM],
    "ncclCommGetAsyncError": [_COMM, ctypes.POINTER(ctypes.c_int)],
    "ncclAllReduce": [_VOID_P, _VOID_P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM, _STREAM],
    "ncclReduceScatter": [_VOID_P, _VOID_P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM, _STREAM],
    "ncclAllGather": [_VOID_P, _VOID_P, ctypes.c_size_t, ctypes.c_int, _COMM, _STREAM],
    "ncclBroadcast": [_VOID_P, _VOID_P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM, _STREAM],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
}


def library_path() -> str:
    """libnccl.so.2 of the nvidia-nccl-cu13 wheel; the system's where the wheel is absent."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:  # no nvidia-* wheel at all
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / "lib" / "libnccl.so.2"
        if candidate.exists():
            return str(candidate)
    return "libnccl.so.2"


class Nccl:
    """The NCCL library: its functions with their argument types set, and its results checked."""

    def __init__(self, library: Any, path: str) -> None:
        self.path = path
        self._lib = library
        for name, argtypes in SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
        library.ncclGetErrorString.argtypes = [ctypes.c_int]
        library.ncclGetErrorString.restype = ctypes.c_char_p
        library.ncclGetLastError.argtypes = [_COMM]
        library.ncclGetLastError.restype = ctypes.c_char_p

    def call(self, name: str, *args: Any, comm: Any = None) -> None:
        """Call NCCL's `name`; an `NcclError` naming it and NCCL's words unless it succeeds."""
        result = getattr(self._lib, name)(*args)
        if result != 0:
            words = self._lib.ncclGetErrorString(result).decode(errors="replace")
            last = (self._lib.ncclGetLastError(comm) or b"").decode(errors="replace")
            raise NcclError(f"{name} failed: {words}" + (f" ({last})" if last else ""))

    def version(self) -> tuple[int, int, int]:
        code = ctypes.c_int()
        self.call("ncclGetVersion", ctypes.byref(code))
        major, rest = divmod(code.value, 10000)
        return major, rest // 100, rest % 100

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.call("ncclGetUniqueId", ctypes.byref(uid))
        return bytes(bytearray(uid))


@functools.cache
def load_nccl() -> Nccl:
    """The NCCL library, loaded once; `CudaToolchainMissing` naming the extra where it is absent."""
    path = library_path()
    try:
        library = ctypes.CDLL(path)
    except OSError as err:
        raise CudaToolchainMissing(f"the NCCL library (libnccl.so.2, wheel nvidia-nccl-cu13) is not installed ({err})",
                                   "training on several GPU ranks") from None
    return Nccl(library, path)


def shared_unique_id(nccl: Nccl, world: Communicator) -> bytes:
    """Rank 0's new NCCL unique id, on every rank of `world` (an MPI broadcast)."""
    uid = world.broadcast(nccl.unique_id() if world.is_root else None)
    if not isinstance(uid, bytes) or len(uid) != UNIQUE_ID_BYTES:
        raise NcclError(f"rank 0 sent no NCCL unique id ({type(uid).__name__})")
    return uid


class NcclComm:
    """One rank's NCCL communicator over the ranks of `world`: rank 0 makes the unique id, `world`
    (MPI) gives it to every rank, and each joins with its rank (llm.c's `multi_gpu_config_init`)."""

    def __init__(self, nccl: Nccl, world: Communicator) -> None:
        self.nccl = nccl
        self.rank, self.size = world.rank, world.size
        self.handle = _COMM()
        uid = UniqueId.from_buffer_copy(shared_unique_id(nccl, world))
        nccl.call("ncclCommInitRank", ctypes.byref(self.handle), self.size, uid, self.rank)

    def all_reduce(self, send: int, receive: int, count: int, dtype: str, op: str, stream: int) -> None:
        """`count` elements of `dtype` at device address `send` reduced by `op` over the ranks, into `receive`."""
        self.nccl.call("ncclAllReduce", send, receive, count, DATA_TYPES[dtype], REDUCTIONS[op], self.handle, stream,
                       comm=self.handle)

    def reduce_scatter(self, send: int, receive: int, count: int, dtype: str, op: str, stream: int) -> None:
        """Rank r receives the r-th `count` elements of the reduction of `size · count` elements at `send`."""
        self.nccl.call("ncclReduceScatter", send, receive, count, DATA_TYPES[dtype], REDUCTIONS[op], self.handle,
                       stream, comm=self.handle)

    def all_gather(self, send: int, receive: int, count: int, dtype: str, stream: int) -> None:
        """Every rank's `count` elements at `send`, in rank order, into `size · count` elements at `receive`."""
        self.nccl.call("ncclAllGather", send, receive, count, DATA_TYPES[dtype], self.handle, stream, comm=self.handle)

    def abort(self) -> None:
        """End the communicator at once (a rank failed): pending collectives return."""
        if self.handle.value:
            self.nccl.call("ncclCommAbort", self.handle)
            self.handle = _COMM()

    def close(self) -> None:
        if self.handle.value:
            self.nccl.call("ncclCommDestroy", self.handle)
            self.handle = _COMM()
