"""The communicator data-parallel ranks reduce through (docs/distributed.md).

A run of N ranks is N processes, one per device (or CPU rank), each holding
the whole model; they meet only here. Every collective is one of MPI's,
called through mpi4py (the `mpi` extra, over MPICH from its wheel), never
one written here:

- `SingleProcess`: one rank; every collective is the identity, and nothing
  of MPI is imported (a plain `sexpgpu run` needs no extra).
- `MpiCommunicator`: `MPI.COMM_WORLD` of the processes a launcher started
  (`mpiexec`, or `sexpgpu run --ranks N`, which runs the mpich wheel's
  `mpiexec`).

A step's gradients are device arrays; they meet through `DeviceCollectives`:
the device's own (NCCL on GPUs: backends/cuda/nccl.py, which the MPI world
only bootstraps), else `HostStaging`: downloaded into host buffers, reduced
by the communicator, written back (CPU ranks, cuda-sim, `SEXPGPU_NCCL=off`).

Gradients are summed by reduce-scatter then all-gather (`sum_into`): each
element is added by exactly one rank in MPI's fixed order and copied to the
others, so every rank holds bit-identical parameters afterwards whatever
the rank count — an `Allreduce` promises that only for some algorithms.
The ring all-reduce that NCCL and MPI run for large buffers is these two
steps too, so it moves no more bytes.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from attrs import frozen

from ..diagnostics import SxError

if TYPE_CHECKING:
    from .executor import DeviceArray, Executor

#: The install command the one-line error for a missing MPI names.
MPI_INSTALL = "pip install -e '.[mpi]'"

#: (rank variable, size variable) of each launcher whose environment a rank reads, in this order:
#: MPICH's hydra (`mpiexec`, and `sexpgpu run --ranks N`), Open MPI's `mpirun`.
MPI_LAUNCHER_VARIABLES = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
#: The variables of a `torchrun`-style launcher (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`; GPU ranks meet at
#: `MASTER_ADDR`:`MASTER_PORT`, backends/rendezvous.py).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE")
#: The local-rank variables (the rank among the ranks on one machine: the device it opens).
LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK")


def shard_bounds(count: int, ranks: int) -> list[tuple[int, int]]:
    """How `count` elements split into `ranks` consecutive shards: the first `count % ranks` shards
    one element longer (MPI's block distribution)."""
    base, extra = divmod(count, ranks)
    bounds, start = [], 0
    for rank in range(ranks):
        stop = start + base + (1 if rank < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class Communicator(ABC):
    """The ranks of one run: this process's `rank` among `size`, and the collectives they share."""

    rank: int
    size: int
    #: What the ranks reduce through, as reports name it ("none", "MPI").
    transport: str

    @property
    def is_root(self) -> bool:
        """Whether this rank writes the run record (rank 0)."""
        return self.rank == 0

    @abstractmethod
    def sum_into(self, buffer: np.ndarray) -> None:
        """Replace the 1-D float32 `buffer` by its element-wise sum over the ranks (bit-identical on
        every rank)."""

    @abstractmethod
    def reduce_scatter(self, buffer: np.ndarray, shard: np.ndarray) -> None:
        """Write into `shard` this rank's shard (`shard_bounds`) of the sum of `buffer` over the ranks."""

    @abstractmethod
    def all_gather(self, shard: np.ndarray, buffer: np.ndarray) -> None:
        """Fill `buffer` with every rank's `shard`, in rank order (`shard_bounds`)."""

    @abstractmethod
    def share(self, buffer: np.ndarray, root: int) -> None:
        """Replace `buffer` on every rank by rank `root`'s."""

    @abstractmethod
    def sum_values(self, values: Sequence[float]) -> list[float]:
        """The sums over the ranks of a few float64 values (metrics, counters, flags)."""

    @abstractmethod
    def broadcast(self, value: Any, root: int = 0) -> Any:
        """Rank `root`'s `value` (a small picklable object) on every rank."""

    @abstractmethod
    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value` in rank order on rank 0; None on the others."""

    @abstractmethod
    def abort(self, code: int) -> None:
        """End every rank of the run at once with exit status `code` (a rank failed alone)."""


class SingleProcess(Communicator):
    """One rank: nothing to share."""

    rank = 0
    size = 1
    transport = "none"

    def sum_into(self, buffer: np.ndarray) -> None:
        pass

    def reduce_scatter(self, buffer: np.ndarray, shard: np.ndarray) -> None:
        shard[...] = buffer

    def all_gather(self, shard: np.ndarray, buffer: np.ndarray) -> None:
        buffer[...] = shard

    def share(self, buffer: np.ndarray, root: int) -> None:
        pass

    def sum_values(self, values: Sequence[float]) -> list[float]:
        return [float(value) for value in values]

    def broadcast(self, value: Any, root: int = 0) -> Any:
        return value

    def gather(self, value: Any) -> list[Any] | None:
        return [value]

    def abort(self, code: int) -> None:
        raise SystemExit(code)


class MpiCommunicator(Communicator):
    """The processes of `MPI.COMM_WORLD`."""

    transport = "MPI"

    def __init__(self, mpi: Any) -> None:
        self._mpi = mpi
        self._comm = mpi.COMM_WORLD
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()

    def _counts(self, count: int) -> tuple[list[int], list[int]]:
        bounds = shard_bounds(count, self.size)
        return [stop - start for start, stop in bounds], [start for start, _ in bounds]

    def sum_into(self, buffer: np.ndarray) -> None:
        start, stop = shard_bounds(buffer.size, self.size)[self.rank]
        shard = np.empty(stop - start, dtype=buffer.dtype)
        self.reduce_scatter(buffer, shard)
        self.all_gather(shard, buffer)

    def reduce_scatter(self, buffer: np.ndarray, shard: np.ndarray) -> None:
        counts, _ = self._counts(buffer.size)
        self._comm.Reduce_scatter(buffer, shard, counts, op=self._mpi.SUM)

    def all_gather(self, shard: np.ndarray, buffer: np.ndarray) -> None:
        counts, displacements = self._counts(buffer.size)
        self._comm.Allgatherv(shard, [buffer, counts, displacements, self._mpi.FLOAT])

    def sum_values(self, values: Sequence[float]) -> list[float]:
        summed = np.asarray(values, dtype=np.float64)
        self._comm.Allreduce(self._mpi.IN_PLACE, summed, op=self._mpi.SUM)
        return summed.tolist()

    def share(self, buffer: np.ndarray, root: int) -> None:
        self._comm.Bcast(buffer, root=root)

    def broadcast(self, value: Any, root: int = 0) -> Any:
        return self._comm.bcast(value, root=root)

    def gather(self, value: Any) -> list[Any] | None:
        return self._comm.gather(value, root=0)

    def abort(self, code: int) -> None:
        self._comm.Abort(code)


@frozen
class CollectivesPlan:
    """How the ranks of a device will meet for a step's gradients, said before any rank starts (`explain
    --ranks`): the transport a run's manifest names (`NCCL`, `MPI`) and, for device arrays that MPI reaches
    through host memory (`HostStaging`), why the device's own collectives do not serve them."""

    transport: str
    host_staging: str | None = None


class DeviceCollectives(ABC):
    """The collectives a step's reduction runs on float32 device arrays (backends/ranks.py)."""

    #: What the gradients meet through, as the run record names it ("MPI", "NCCL").
    transport: str

    @abstractmethod
    def sum_arrays(self, arrays: Sequence[DeviceArray]) -> None:
        """Each of `arrays` replaced by its element-wise sum over the ranks (the same on every rank)."""

    @abstractmethod
    def share_arrays(self, arrays: Sequence[DeviceArray], root: int) -> None:
        """Each of `arrays` replaced on every rank by rank `root`'s."""

    @abstractmethod
    def reduce_scatter(self, group: DeviceArray, shard: DeviceArray) -> None:
        """`shard`, this rank's part of `group` (`shard_bounds`, equal parts), replaced by that part of
        `group`'s sum over the ranks."""

    @abstractmethod
    def all_gather(self, shard: DeviceArray, group: DeviceArray) -> None:
        """`group` filled with every rank's `shard`, in rank order (this rank's is already in place)."""


class HostStaging(DeviceCollectives):
    """Device arrays reduced through host buffers by the ranks' communicator: downloaded, reduced, written
    back. Arrays summed together are packed into one buffer, so a step makes one collective of them."""

    def __init__(self, executor: Executor, world: Communicator) -> None:
        self.executor = executor
        self.world = world
        self.transport = world.transport
        #: Host buffers by element count, kept from step to step.
        self._buffers: dict[int, np.ndarray] = {}

    def _buffer(self, numel: int) -> np.ndarray:
        if numel not in self._buffers:
            self._buffers[numel] = np.empty(numel, dtype=np.float32)
        return self._buffers[numel]

    def _packed(self, arrays: Sequence[DeviceArray]) -> tuple[np.ndarray, list[tuple[int, ...]]]:
        values = [self.executor.download(array) for array in arrays]
        host = self._buffer(sum(value.size for value in values))
        offset = 0
        for value in values:
            host[offset:offset + value.size] = value.reshape(-1)
            offset += value.size
        return host, [value.shape for value in values]

    def _unpack(self, arrays: Sequence[DeviceArray], host: np.ndarray, shapes: list[tuple[int, ...]]) -> None:
        offset = 0
        for array, shape in zip(arrays, shapes):
            size = int(np.prod(shape, dtype=np.int64))
            self.executor.write(array, host[offset:offset + size].reshape(shape))
            offset += size

    def sum_arrays(self, arrays: Sequence[DeviceArray]) -> None:
        if arrays:
            host, shapes = self._packed(arrays)
            self.world.sum_into(host)
            self._unpack(arrays, host, shapes)

    def share_arrays(self, arrays: Sequence[DeviceArray], root: int) -> None:
        if arrays:
            host, shapes = self._packed(arrays)
            self.world.share(host, root)
            self._unpack(arrays, host, shapes)

    def reduce_scatter(self, group: DeviceArray, shard: DeviceArray) -> None:
        host, _ = self._packed([group])
        shard_host = self._buffer(host.size // self.world.size)
        self.world.reduce_scatter(host, shard_host)
        self.executor.write(shard, shard_host)

    def all_gather(self, shard: DeviceArray, group: DeviceArray) -> None:
        shard_host, _ = self._packed([shard])
        host = self._buffer(shard_host.size * self.world.size)
        self.world.all_gather(shard_host, host)
        self.executor.write(group, host)


def launcher_world() -> tuple[int, int, str] | None:
    """(rank, size, the launcher's variables) where a launcher started this process as one of
    several ranks; None for a lone process."""
    for rank_variable, size_variable in (*MPI_LAUNCHER_VARIABLES, TORCHRUN_VARIABLES):
        rank, size = os.environ.get(rank_variable), os.environ.get(size_variable)
        if rank is not None and size is not None and rank.isdigit() and size.isdigit():
            return int(rank), int(size), f"{rank_variable}/{size_variable}"
    return None


def local_rank() -> int:
    """This rank's index among the ranks on its machine (0 for a lone process)."""
    for variable in LOCAL_RANK_VARIABLES:
        value = os.environ.get(variable)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def import_mpi(ranks: int) -> Any:
    """mpi4py's `MPI` module (initializing MPI); a one-line error naming the extra without it."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise SxError(f"{ranks} ranks need MPI (mpi4py and an MPI library); install them with "
                      f"`{MPI_INSTALL}`") from None
    return MPI


def open_communicator(device: str = "cpu",
                      gpu_world: Callable[[int, int], Communicator] | None = None) -> Communicator:
    """The communicator of this process: MPI's world when an MPI launcher started it among several ranks;
    for the ranks of a `torchrun`-style launch, `gpu_world(rank, size)` (NCCL's, `cuda.nccl.NcclWorld`,
    which the caller gives for `--device cuda`); else a single process."""
    world = launcher_world()
    if world is None or world[1] == 1:
        return SingleProcess()
    rank, size, variables = world
    if variables == "/".join(TORCHRUN_VARIABLES):
        if gpu_world is not None:
            return gpu_world(rank, size)
        raise SxError(f"{variables} say this is rank {rank} of {size}, but ranks on {device} meet through MPI's "
                      f"collectives, which those variables cannot join: start them with `mpiexec -n {size} "
                      f"sexpgpu run ...` or `sexpgpu run --ranks {size}` (docs/distributed.md)")
    communicator = MpiCommunicator(import_mpi(size))
    if communicator.size != size:
        raise SxError(f"{variables} say {size} ranks, but MPI's world has {communicator.size}: is mpi4py "
                      "built against another MPI than the launcher's?")
    return communicator
