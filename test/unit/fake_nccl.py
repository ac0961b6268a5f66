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
- performed on the fake device memory: with `ThreadRanks`, across ranks that are threads of this
  process, each over a fake driver of its own (every rank must make the same collectives in the same
  order, with the same counts, types and reductions, or it is a violation: on NCCL, a hang); without,
  for a world whose other ranks are this one's mirror: every rank sent the same bytes as this one
  (`size` copies of them), so a sum is `size` times the buffer, an all-gather repeats this rank's
  part, a reduce-scatter sums this rank's part.

`ThreadWorld` is the MPI side of thread ranks, `MirrorWorld` of a mirrored world.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from fake_cuda_driver import Call, FakeDriver
from sexpgpu.backends.cuda.nccl import DATA_TYPES, REDUCTIONS, SIGNATURES, UNIQUE_ID_BYTES, Nccl
from sexpgpu.backends.distributed import Communicator, shard_bounds

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


class ThreadRanks:
    """`size` ranks that are threads of this process: what they exchange meets here."""

    def __init__(self, size: int, seconds: float = 300.0) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=seconds)
        self._posted: list[Any] = [None] * size

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's `value` (a copy, pickled: no rank sees another's objects), once all have posted."""
        self._posted[rank] = pickle.dumps(value)
        self._barrier.wait()
        every = [pickle.loads(posted) for posted in self._posted]
        self._barrier.wait()  # no rank posts its next value before every rank has read this one
        return every

    def abort(self) -> None:
        """A rank failed: the others' waits end with `threading.BrokenBarrierError`."""
        self._barrier.abort()

    def run(self, rank_body: Callable[[int], Any], seconds: float = 600.0) -> list[Any]:
        """`rank_body(rank)` on a thread for each rank; their results in rank order, or the first failure
        raised (after aborting the others, which would wait for the failed rank at their next collective)."""
        results: dict[int, Any] = {}
        failures: list[BaseException] = []

        def rank(index: int) -> None:
            try:
                results[index] = rank_body(index)
            except BaseException as failure:
                failures.append(failure)
                self.abort()

        threads = [threading.Thread(target=rank, args=(index,)) for index in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=seconds)
        if failures:
            raise failures[0]
        return [results[index] for index in range(self.size)]


class FakeNccl:
    """libnccl.so.2 for rank `rank` of `size` over `driver`'s fake GPU: the other ranks threads of `network`,
    or this one's mirrors (see the module docstring)."""

    def __init__(self, driver: FakeDriver, rank: int = 0, size: int = 2, network: ThreadRanks | None = None) -> None:
        self.driver = driver
        self.rank, self.size = rank, size
        self.network = network
        self.uid = bytes(range(UNIQUE_ID_BYTES))
        self.comm: int | None = None
        self.depth = 0
        #: The collectives of the group in progress: (what every rank must agree on, what was sent, where it goes).
        self.queued: list[tuple[tuple, np.ndarray, np.ndarray]] = []
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
        if self.depth == 0:
            self._perform()

    def _ncclAllReduce(self, send, receive, count, dtype, op, comm, stream) -> None:  # noqa: N802
        self._collective(("ncclAllReduce", count, dtype, op), comm, stream, (send, count), (receive, count))

    def _ncclReduceScatter(self, send, receive, count, dtype, op, comm, stream) -> None:  # noqa: N802
        self._collective(("ncclReduceScatter", count, dtype, op), comm, stream, (send, self.size * count),
                         (receive, count))

    def _ncclAllGather(self, send, receive, count, dtype, comm, stream) -> None:  # noqa: N802
        self._collective(("ncclAllGather", count, dtype), comm, stream, (send, count), (receive, self.size * count))

    def _ncclBroadcast(self, send, receive, count, dtype, root, comm, stream) -> None:  # noqa: N802
        if not 0 <= root < self.size:
            self._refuse(f"ncclBroadcast from root {root} of {self.size}")
        self._collective(("ncclBroadcast", count, dtype, root), comm, stream, (send, count), (receive, count))

    # -- performing ---------------------------------------------------------------------------------

    def _collective(self, what: tuple, comm: int, stream: int, send: tuple[int, int], receive: tuple[int, int]) -> None:
        """Queue the collective (what was sent copied now, as NCCL reads it in order); a lone one runs at once."""
        name, _, dtype, *_ = what
        sent, received = self._buffers(name, comm, stream, dtype, send, receive)
        if what[0] in ("ncclAllReduce", "ncclReduceScatter") and what[3] not in REDUCTIONS.values():
            self._refuse(f"{name} with reduction {what[3]}, which is no ncclRedOp_t")
        self.queued.append((what, sent.copy(), received))
        if self.depth == 0:
            self._perform()

    def _perform(self) -> None:
        queued, self.queued = self.queued, []
        if self.network is None:
            every = [[sent for _, sent, _ in queued]] * self.size
        else:
            posted = self.network.exchange(self.rank, [(what, sent) for what, sent, _ in queued])
            agreed = [[what for what, _ in calls] for calls in posted]
            if any(calls != agreed[self.rank] for calls in agreed):
                self._refuse(f"the ranks made different collectives (on NCCL, a hang): {agreed}")
            every = [[sent for _, sent in calls] for calls in posted]
        for index, (what, _, received) in enumerate(queued):
            received[...] = self._result(what, [sends[index] for sends in every])

    def _result(self, what: tuple, sent: list[np.ndarray]) -> np.ndarray:
        """What this rank receives of the collective `what`, each rank having sent `sent[rank]`."""
        name, count = what[0], what[1]
        if name == "ncclAllGather":
            return np.concatenate(sent)
        if name == "ncclBroadcast":
            return sent[what[3]]
        reduced = self._reduced(sent, what[3])
        return reduced[self.rank * count:(self.rank + 1) * count] if name == "ncclReduceScatter" else reduced

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

    def _reduced(self, sent: list[np.ndarray], op: int) -> np.ndarray:
        """The element-wise reduction of every rank's buffer, in rank order."""
        combine = {REDUCTIONS["sum"]: operator.add, REDUCTIONS["avg"]: operator.add, REDUCTIONS["prod"]: operator.mul,
                   REDUCTIONS["max"]: np.maximum, REDUCTIONS["min"]: np.minimum}[op]
        reduced = functools.reduce(combine, sent[1:], sent[0].copy())
        return (reduced / len(sent)).astype(reduced.dtype) if op == REDUCTIONS["avg"] else reduced


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
    """Make `backends/cuda/nccl.py` load a new fake libnccl over `driver`, for a mirrored world, for the test."""
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


class ThreadWorld(Communicator):
    """The MPI side of rank `rank` of `ranks` (threads of this process): each collective an exchange of
    copies, reduced in rank order as MPI's fixed order does."""

    transport = "MPI"

    def __init__(self, ranks: ThreadRanks, rank: int) -> None:
        self.ranks = ranks
        self.rank, self.size = rank, ranks.size

    def _every(self, value: Any) -> list[Any]:
        return self.ranks.exchange(self.rank, value)

    def sum_into(self, buffer: np.ndarray) -> None:
        buffer[...] = functools.reduce(operator.add, self._every(buffer))

    def reduce_scatter(self, buffer: np.ndarray, shard: np.ndarray) -> None:
        start, stop = shard_bounds(buffer.size, self.size)[self.rank]
        shard[...] = functools.reduce(operator.add, self._every(buffer))[start:stop]

    def all_gather(self, shard: np.ndarray, buffer: np.ndarray) -> None:
        buffer[...] = np.concatenate(self._every(shard))

    def share(self, buffer: np.ndarray, root: int) -> None:
        buffer[...] = self._every(buffer)[root]

    def sum_values(self, values: Sequence[float]) -> list[float]:
        return [float(sum(column)) for column in zip(*self._every([float(v) for v in values]))]

    def broadcast(self, value: Any, root: int = 0) -> Any:
        return self._every(value)[root]

    def gather(self, value: Any) -> list[Any] | None:
        every = self._every(value)
        return every if self.is_root else None

    def abort(self, code: int) -> None:
        self.ranks.abort()
        raise SystemExit(code)
