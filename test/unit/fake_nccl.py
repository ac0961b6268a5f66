"""A recording fake of libnccl.so.2 over the fake CUDA driver, so the executor's NCCL path runs in CI.

`FakeNccl` stands in for the library `backends/cuda/nccl.py` loads with ctypes (`load_nccl`): each
function takes the argument types `Nccl` declares (`SIGNATURES`) and converts every argument through
them as ctypes would (a wrong one is a `TypeError` at once); each call is recorded among the fake
driver's (`FakeDriver.calls`, so its order with the launches, event records and stream waits can be
asserted) and answered as NCCL would:

- checked: the communicator is the one `ncclCommInitRank` made (with the unique id `ncclGetUniqueId`
  gave), the datatype and reduction are NCCL's enums, the stream is a live stream of the driver and
  not capturing, each buffer lies inside a live device allocation at the extent its count and type
  say and is aligned to its element, and `ncclGroupStart`/`ncclGroupEnd` nest; a breach is recorded
  in the driver's `violations` (the tests assert there is none) and answered `ncclInvalidArgument`;
- performed on the fake device memory for the ranks of a world whose other ranks are this one's
  mirror: every rank sent the same bytes as this one (`size` copies of them), so a sum is `size`
  times the buffer, an all-gather repeats this rank's part, a reduce-scatter sums this rank's part.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from fake_cuda_driver import Call, FakeDriver
from sexpgpu.backends.cuda.nccl import DATA_TYPES, REDUCTIONS, SIGNATURES, UNIQUE_ID_BYTES, Nccl
from sexpgpu.backends.distributed import Communicator

#: ncclResult_t values the fake answers.
SUCCESS, INVALID_ARGUMENT, INVALID_USAGE = 0, 4, 5
#: The numpy type of each ncclDataType_t.
NUMPY_TYPES = {DATA_TYPES[name]: np.dtype(kind) for name, kind in [
    ("i8", np.int8), ("u8", np.uint8), ("i32", np.int32), ("u32", np.uint32), ("i64", np.int64),
    ("u64", np.uint64), ("f16", np.float16), ("f32", np.float32), ("f64", np.float64),
    ("bf16", ml_dtypes.bfloat16)]}


class Refused(Exception):
    """Carries the ncclResult_t a refused call returns."""

    def __init__(self, result: int) -> None:
        self.result = result


class FakeNccl:
    """libnccl.so.2 for rank `rank` of `size` mirrored ranks over `driver`'s fake GPU (see the module docstring)."""

    def __init__(self, driver: FakeDriver, rank: int = 0, size: int = 2) -> None:
        self.driver = driver
        self.rank, self.size = rank, size
        self.uid = bytes(range(UNIQUE_ID_BYTES))
        self.comm: int | None = None
        self.depth = 0
        for name, argtypes in SIGNATURES.items():
            setattr(self, name, _Function(self, name, argtypes))
        self.ncclGetErrorString = lambda result: b"invalid argument" if result == INVALID_ARGUMENT else b"error"
        self.ncclGetLastError = lambda comm: b"the fake refused the call"

    def calls(self) -> list[Call]:
        """The NCCL calls so far, in order."""
        return [call for call in self.driver.calls if call.name.startswith("nccl")]

    def _refuse(self, what: str) -> None:
        self.driver.violation(what)
        raise Refused(INVALID_ARGUMENT)

    # -- the functions (each gets its arguments as ctypes converted them) ---------------------------

    def _ncclGetVersion(self, version) -> None:  # noqa: N802 - NCCL's names
        version._obj.value = 23203

    def _ncclGetUniqueId(self, uid) -> None:  # noqa: N802
        ctypes.memmove(ctypes.addressof(uid._obj), self.uid, UNIQUE_ID_BYTES)

    def _ncclCommInitRank(self, comm, nranks, uid, rank) -> None:  # noqa: N802
        if bytes(bytearray(uid)) != self.uid:
            self._refuse("ncclCommInitRank with a unique id ncclGetUniqueId did not make")
        if (nranks, rank) != (self.size, self.rank):
            self._refuse(f"ncclCommInitRank as rank {rank} of {nranks} in a world where this is {self.rank} of {self.size}")
        self.comm = 0xC0FFEE
        comm._obj.value = self.comm

    def _ncclCommDestroy(self, comm) -> None:  # noqa: N802
        self._check_comm(comm)
        self.comm = None

    _ncclCommAbort = _ncclCommDestroy

    def _ncclCommGetAsyncError(self, comm, result) -> None:  # noqa: N802
        self._check_comm(comm)
        result._obj.value = SUCCESS

    def _ncclGroupStart(self) -> None:  # noqa: N802
        self.depth += 1

    def _ncclGroupEnd(self) -> None:  # noqa: N802
        if self.depth == 0:
            self.driver.violation("ncclGroupEnd without ncclGroupStart")
            raise Refused(INVALID_USAGE)
        self.depth -= 1

    def _ncclAllReduce(self, send, receive, count, dtype, op, comm, stream) -> None:  # noqa: N802
        sent, received = self._buffers("ncclAllReduce", comm, stream, dtype, (send, count), (receive, count))
        received[...] = self._reduced(sent, op)

    def _ncclReduceScatter(self, send, receive, count, dtype, op, comm, stream) -> None:  # noqa: N802
        sent, received = self._buffers("ncclReduceScatter", comm, stream, dtype, (send, self.size * count),
                                       (receive, count))
        received[...] = self._reduced(sent[self.rank * count:(self.rank + 1) * count], op)

    def _ncclAllGather(self, send, receive, count, dtype, comm, stream) -> None:  # noqa: N802
        sent, received = self._buffers("ncclAllGather", comm, stream, dtype, (send, count), (receive, self.size * count))
        received[...] = np.tile(sent.copy(), self.size)

    def _ncclBroadcast(self, send, receive, count, dtype, root, comm, stream) -> None:  # noqa: N802
        if not 0 <= root < self.size:
            self._refuse(f"ncclBroadcast from root {root} of {self.size}")
        sent, received = self._buffers("ncclBroadcast", comm, stream, dtype, (send, count), (receive, count))
        received[...] = sent

    # -- checks -------------------------------------------------------------------------------------

    def _check_comm(self, comm: int | None) -> None:
        if self.comm is None or comm != self.comm:
            self._refuse(f"a call with communicator {comm!r}, which ncclCommInitRank did not make (or was destroyed)")

    def _buffers(self, name: str, comm: int, stream: int, dtype: int, *buffers: tuple[int | None, int]) -> list[np.ndarray]:
        """Each (address, count) as the fake device's elements of `dtype`, after checking the call."""
        self._check_comm(comm)
        if dtype not in NUMPY_TYPES:
            self._refuse(f"{name} with datatype {dtype}, which is no ncclDataType_t")
        if not stream or stream not in self.driver.streams:
            self._refuse(f"{name} on stream {stream!r}, which is not a live stream")
        if stream in self.driver.capturing:
            self._refuse(f"{name} on a capturing stream (the reduction is made outside captured graphs)")
        kind = NUMPY_TYPES[dtype]
        views = []
        for address, count in buffers:
            if not address or address % kind.itemsize:
                self._refuse(f"{name}: buffer {address!r} is not aligned to its {kind} elements")
            try:
                span = self.driver._span(address, count * kind.itemsize, name)
            except Exception:
                raise Refused(INVALID_ARGUMENT) from None
            views.append(span.view(kind))
        return views

    def _reduced(self, values: np.ndarray, op: int) -> np.ndarray:
        """The reduction over `size` ranks that each sent `values`."""
        if op == REDUCTIONS["sum"]:
            return (values.astype(np.float64) * self.size).astype(values.dtype)
        if op in (REDUCTIONS["avg"], REDUCTIONS["max"], REDUCTIONS["min"]):
            return values.copy()
        if op == REDUCTIONS["prod"]:
            return (values.astype(np.float64) ** self.size).astype(values.dtype)
        self._refuse(f"a reduction {op}, which is no ncclRedOp_t")
        raise AssertionError("unreachable")


class _Function:
    """One of libnccl's functions: ctypes-style `argtypes`/`restype`, each argument converted through its type."""

    def __init__(self, library: FakeNccl, name: str, argtypes: Sequence[Any]) -> None:
        self.library, self.name = library, name
        self.argtypes: list[Any] = list(argtypes)
        self.restype: Any = None
        self.body: Callable[..., None] = getattr(library, "_" + name)

    def __call__(self, *args: Any) -> int:
        if self.restype is not ctypes.c_int or list(self.argtypes) != SIGNATURES[self.name]:
            raise TypeError(f"{self.name} was called before its C signature was declared")
        if len(args) != len(self.argtypes):
            raise TypeError(f"{self.name} takes {len(self.argtypes)} arguments, not {len(args)}")
        converted = [_converted(argtype, value) for argtype, value in zip(self.argtypes, args)]
        record = Call(self.name, tuple(converted))
        self.library.driver.calls.append(record)
        try:
            self.body(*converted)
        except Refused as refused:
            record.result = refused.result
            return refused.result
        return SUCCESS


def _converted(argtype: Any, value: Any) -> Any:
    """`value` as the C function receives it through `argtype` (ctypes' own conversion: a `TypeError` for a
    wrong one); a handle given as a `c_void_p` as its integer."""
    argtype.from_param(value)
    return value.value if isinstance(value, ctypes.c_void_p) else value


def install(monkeypatch: Any, driver: FakeDriver, rank: int = 0, size: int = 2) -> FakeNccl:
    """Make `backends/cuda/nccl.py` load a new fake libnccl over `driver` for the test."""
    from sexpgpu.backends.cuda import nccl

    library = FakeNccl(driver, rank, size)
    monkeypatch.setattr(nccl, "load_nccl", lambda: Nccl(library, "fake libnccl.so.2"))
    return library


class MirrorWorld(Communicator):
    """Rank `rank` of `size` ranks whose others are this one's mirror (they hold what it holds), for
    the MPI side of a run whose NCCL side is `FakeNccl`: sums are `size` times the value, a broadcast
    this rank's value, a gather each rank's value as `peer` (value, rank) says it (default: the same;
    a mirror that sits on another device says so)."""

    transport = "MPI"

    def __init__(self, rank: int = 0, size: int = 2, peer: Callable[[Any, int], Any] = lambda value, rank: value) -> None:
        self.rank, self.size = rank, size
        self.peer = peer

    def sum_into(self, buffer: np.ndarray) -> None:
        buffer *= self.size

    def reduce_scatter(self, buffer: np.ndarray, shard: np.ndarray) -> None:
        shard[...] = buffer[self.rank * shard.size:(self.rank + 1) * shard.size] * self.size

    def all_gather(self, shard: np.ndarray, buffer: np.ndarray) -> None:
        buffer[...] = np.tile(shard, self.size)

    def share(self, buffer: np.ndarray, root: int) -> None:
        pass

    def sum_values(self, values: Sequence[float]) -> list[float]:
        return [float(value) * self.size for value in values]

    def broadcast(self, value: Any, root: int = 0) -> Any:
        return value

    def gather(self, value: Any) -> list[Any] | None:
        return [value if rank == self.rank else self.peer(value, rank) for rank in range(self.size)] if self.is_root else None

    def abort(self, code: int) -> None:
        raise SystemExit(code)
