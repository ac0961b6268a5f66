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

`NcclCollectives` is what GPU ranks reduce through (`CudaExecutor.collectives`
on `cuda`; cuda-sim and `SEXPGPU_NCCL=off` keep MPI's host staging): the
gradients are summed on a side stream of their own, after everything the
compute stream has enqueued (the last microbatch's backward) and before
whatever it enqueues next (the update), ordered by events, the host waiting
for neither. They sum (`ncclSum`) where llm.c averages: the driver scales
the step's summed gradient by 1/M once, as on one rank (docs/distributed.md).

`NcclWorld` is the communicator of GPU ranks a `torchrun`-style launcher
started without MPI: the unique id comes through backends/rendezvous.py,
and the host values a step shares go through NCCL too.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...diagnostics import SxError
from ..distributed import CollectivesPlan, Communicator, DeviceCollectives
from ..rendezvous import share_bytes
from .errors import CudaToolchainMissing
from .memory import CudaArray
from .runtime import DeviceRuntime
from .selection import open_runtime, rank_device_ids, switch_setting

#: ncclDataType_t, by IR dtype.
DATA_TYPES = {"i8": 0, "u8": 1, "i32": 2, "u32": 3, "i64": 4, "u64": 5, "f16": 6, "f32": 7, "f64": 8, "bf16": 9}
#: Bytes of an element of each data type.
DATA_TYPE_BYTES = {"i8": 1, "u8": 1, "i32": 4, "u32": 4, "i64": 8, "u64": 8, "f16": 2, "f32": 4, "f64": 8, "bf16": 2}
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
    """One rank's NCCL communicator: rank `rank` of `size` joined with the unique id rank 0 made."""

    def __init__(self, nccl: Nccl, rank: int, size: int, unique_id: bytes) -> None:
        self.nccl = nccl
        self.rank, self.size = rank, size
        self.handle = _COMM()
        uid = UniqueId.from_buffer_copy(unique_id)
        nccl.call("ncclCommInitRank", ctypes.byref(self.handle), self.size, uid, self.rank)

    @classmethod
    def over(cls, nccl: Nccl, world: Communicator) -> NcclComm:
        """The communicator of the ranks of `world`: rank 0 makes the unique id, `world` (MPI) gives it
        to every rank, and each joins with its rank (llm.c's `multi_gpu_config_init`)."""
        return cls(nccl, world.rank, world.size, shared_unique_id(nccl, world))

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

    def broadcast(self, send: int, receive: int, count: int, dtype: str, root: int, stream: int) -> None:
        """Rank `root`'s `count` elements of `dtype` at `send` into `receive` on every rank."""
        self.nccl.call("ncclBroadcast", send, receive, count, DATA_TYPES[dtype], root, self.handle, stream,
                       comm=self.handle)

    @contextlib.contextmanager
    def grouped(self) -> Iterator[None]:
        """The collectives called within are launched together (`ncclGroupStart` … `ncclGroupEnd`)."""
        self.nccl.call("ncclGroupStart")
        try:
            yield
        finally:
            self.nccl.call("ncclGroupEnd", comm=self.handle)

    def abort(self) -> None:
        """End the communicator at once (a rank failed): pending collectives return."""
        if self.handle.value:
            self.nccl.call("ncclCommAbort", self.handle)
            self.handle = _COMM()

    def close(self) -> None:
        if self.handle.value:
            self.nccl.call("ncclCommDestroy", self.handle)
            self.handle = _COMM()


def nccl_setting() -> bool:
    """`SEXPGPU_NCCL`: `off` makes GPU ranks reduce through MPI by host staging (default on)."""
    return switch_setting("SEXPGPU_NCCL")


def nccl_refused(device: str) -> str | None:
    """Why ranks of `device` reduce by host staging whatever their GPUs (cuda-sim, `SEXPGPU_NCCL=off`); None
    where NCCL may serve them."""
    if device != "cuda":
        return f"{device} has no NCCL"
    if not nccl_setting():
        return "SEXPGPU_NCCL=off"
    return None


def planned_collectives(device: str, ranks: int) -> CollectivesPlan:
    """What `CudaExecutor.collectives` will choose for `ranks` ranks of `device` started on this machine
    (`sexpgpu run`: each opens its id of `SEXPGPU_DEVICES`), said before they start: NCCL, or MPI by host
    staging and why (the device, the setting, ranks sharing a GPU, the library missing here)."""
    why = nccl_refused(device)
    if why is None:
        ids = rank_device_ids(ranks)
        shared = next((i for i in ids if ids.count(i) > 1), None)
        if shared is not None:
            why = f"ranks share GPU {shared}, which NCCL refuses"
    if why is None:
        try:
            load_nccl()
        except CudaToolchainMissing as error:
            why = error.message
    return CollectivesPlan("MPI", why) if why is not None else CollectivesPlan("NCCL")


class NcclCollectives(DeviceCollectives):
    """A step's collectives on the device through NCCL (llm.c's `llmc/zero.cuh`): the gradients summed
    with `ncclAllReduce`, a ZeRO-1 group's reduce-scattered and its parameters all-gathered in place
    (NCCL's in-place forms: this rank's shard of a group is the rank-th part of it). Each call runs
    on a side stream after the compute stream's work so far (an event it waits for), its collectives
    grouped, and the compute stream's later work waits for it (an event after it)."""

    transport = "NCCL"

    def __init__(self, runtime: DeviceRuntime, comm: NcclComm) -> None:
        self.runtime = runtime
        self.comm = comm
        self.side = runtime.stream()
        self._computed = runtime.event()
        self._reduced = runtime.event()

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[int]:
        compute = self.runtime.default_stream
        self._computed.record(compute)
        self.side.wait(self._computed)
        with self.comm.grouped():
            yield self.side.handle
        self._reduced.record(self.side)
        compute.wait(self._reduced)

    def sum_arrays(self, arrays: Sequence[CudaArray]) -> None:
        with self._on_side_stream() as stream:
            for array in arrays:
                self.comm.all_reduce(array.address, array.address, _count(array), array.dtype, "sum", stream)

    def share_arrays(self, arrays: Sequence[CudaArray], root: int) -> None:
        with self._on_side_stream() as stream:
            for array in arrays:
                self.comm.broadcast(array.address, array.address, _count(array), array.dtype, root, stream)

    def reduce_scatter(self, group: CudaArray, shard: CudaArray) -> None:
        self._check_in_place(group, shard)
        with self._on_side_stream() as stream:
            self.comm.reduce_scatter(group.address, shard.address, _count(shard), shard.dtype, "sum", stream)

    def all_gather(self, shard: CudaArray, group: CudaArray) -> None:
        self._check_in_place(group, shard)
        with self._on_side_stream() as stream:
            self.comm.all_gather(shard.address, group.address, _count(shard), shard.dtype, stream)

    def _check_in_place(self, group: CudaArray, shard: CudaArray) -> None:
        if (group.dtype != shard.dtype or group.nbytes != self.comm.size * shard.nbytes
                or shard.address != group.address + self.comm.rank * shard.nbytes):
            raise ValueError(f"{shard!r} is not rank {self.comm.rank}'s part of {group!r} in {self.comm.size}")


def _count(array: CudaArray) -> int:
    return array.nbytes // DATA_TYPE_BYTES[array.dtype]


def open_nccl_collectives(runtime: DeviceRuntime, world: Communicator) -> NcclCollectives | None:
    """NCCL's collectives over the ranks of `world` (which shares the unique id); None where the NCCL
    library is missing on any rank (rank 0 notes why): the ranks then reduce through host staging."""
    try:
        nccl, missing = load_nccl(), ""
    except CudaToolchainMissing as error:
        nccl, missing = None, error.message
    # Every rank takes the same road, or the ones joining NCCL would wait for the others forever.
    if world.sum_values([0.0 if nccl is not None else 1.0])[0] > 0:
        if world.is_root:
            print(f"note: {missing or 'the NCCL library is missing on some rank'}; GPU ranks reduce through MPI by "
                  "host staging", file=sys.stderr)
        return None
    return NcclCollectives(runtime, NcclComm.over(nccl, world))


#: The NCCL data type of each numpy type the host collectives move.
_HOST_TYPES = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.int64): "i64",
               np.dtype(np.uint8): "u8"}


class NcclWorld(Communicator):
    """The ranks of a `torchrun`-style launch on GPUs (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`; no MPI): rank 0's
    NCCL unique id reaches the others through MASTER_ADDR:MASTER_PORT (backends/rendezvous.py), and the
    few collectives of host values (metrics, flags, the record directory, a checkpoint's shards) are
    NCCL's too, on device copies of them (as PyTorch's object collectives over NCCL are). The gradients
    meet through the same communicator (`CudaExecutor.collectives`)."""

    transport = "NCCL"

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.runtime = open_runtime("cuda")  # the device of this rank's local rank
        nccl = load_nccl()
        self.comm = NcclComm(nccl, rank, size, share_bytes(rank, size, nccl.unique_id, UNIQUE_ID_BYTES))

    def _on_device(self, host: np.ndarray, count: int,
                   collective: Callable[[NcclComm, int, int, str, int], None]) -> np.ndarray:
        """`collective(comm, send, receive, dtype, stream)` over a device copy of `host` into `count`
        elements of its type, which are returned on the host."""
        host = np.ascontiguousarray(host).reshape(-1)
        itemsize = host.dtype.itemsize
        send = self.runtime.allocate(max(host.nbytes, itemsize), "a host collective's buffer")
        receive = self.runtime.allocate(max(count * itemsize, itemsize), "a host collective's buffer")
        try:
            if host.nbytes:
                self.runtime.upload(send, host)
            collective(self.comm, int(send), int(receive), _HOST_TYPES[host.dtype], self.runtime.default_stream.handle)
            return self.runtime.download(receive, host.dtype, (count,)).copy()
        finally:
            self.runtime.free(send)
            self.runtime.free(receive)

    def _equal_shard(self, count: int) -> int:
        if count % self.size:
            raise ValueError(f"NCCL splits {count} elements into {self.size} equal shards only where they divide")
        return count // self.size

    def sum_into(self, buffer: np.ndarray) -> None:
        n = buffer.size
        buffer[...] = self._on_device(buffer, n, lambda c, s, r, t, st: c.all_reduce(s, r, n, t, "sum", st))

    def reduce_scatter(self, buffer: np.ndarray, shard: np.ndarray) -> None:
        n = self._equal_shard(buffer.size)
        shard[...] = self._on_device(buffer, n, lambda c, s, r, t, st: c.reduce_scatter(s, r, n, t, "sum", st))

    def all_gather(self, shard: np.ndarray, buffer: np.ndarray) -> None:
        n = self._equal_shard(buffer.size)
        buffer[...] = self._on_device(shard, buffer.size, lambda c, s, r, t, st: c.all_gather(s, r, n, t, st))

    def share(self, buffer: np.ndarray, root: int) -> None:
        n = buffer.size
        buffer[...] = self._on_device(buffer, n, lambda c, s, r, t, st: c.broadcast(s, r, n, t, root, st)).reshape(
            buffer.shape)

    def sum_values(self, values: Sequence[float]) -> list[float]:
        summed = np.asarray(values, dtype=np.float64)
        self.sum_into(summed)
        return summed.tolist()

    def broadcast(self, value: Any, root: int = 0) -> Any:
        payload = np.frombuffer(bytearray(pickle.dumps(value)), dtype=np.uint8) if self.rank == root else None
        length = np.array([payload.size if payload is not None else 0], dtype=np.int64)
        self.share(length, root)
        if payload is None:
            payload = np.zeros(int(length[0]), dtype=np.uint8)
        self.share(payload, root)
        return pickle.loads(payload.tobytes())

    def gather(self, value: Any) -> list[Any] | None:
        payload = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
        lengths = np.zeros(self.size, dtype=np.int64)
        self.all_gather(np.array([payload.size], dtype=np.int64), lengths)
        longest = int(lengths.max())
        padded = np.zeros(longest, dtype=np.uint8)
        padded[:payload.size] = payload
        every = np.zeros(longest * self.size, dtype=np.uint8)
        self.all_gather(padded, every)
        if not self.is_root:
            return None
        return [pickle.loads(every[rank * longest:rank * longest + int(lengths[rank])].tobytes())
                for rank in range(self.size)]

    def abort(self, code: int) -> None:
        # The launcher (torchrun's agent) stops the other ranks when one ends badly; NCCL's pending
        # collectives must not hold this one.
        with contextlib.suppress(NcclError):
            self.comm.abort()
        sys.stderr.flush()
        os._exit(code)
