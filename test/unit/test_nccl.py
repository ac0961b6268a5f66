"""The NCCL layer for CUDA ranks (backends/cuda/nccl.py), without a GPU: the library of the
nvidia-nccl-cu13 wheel loads and its symbols resolve, arguments reach NCCL as its C signatures say, a
refused call is an error naming it and NCCL's words, and the unique id rank 0 makes reaches every rank
through MPI (2 real ranks), which then ask NCCL to join."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sexpgpu.backends.cuda import nccl as nccl_layer
from sexpgpu.backends.cuda.errors import CudaToolchainMissing
from sexpgpu.backends.cuda.nccl import SIGNATURES, UNIQUE_ID_BYTES, Nccl, NcclComm, NcclError
from sexpgpu.backends.distributed import SingleProcess

INSTALLED = Path(nccl_layer.library_path()).is_absolute()
needs_nccl = pytest.mark.skipif(not INSTALLED, reason="the cuda extra brings NCCL (nvidia-nccl-cu13)")

JOIN = r'''
import json, sys
from sexpgpu.backends.cuda.nccl import NcclComm, NcclError, load_nccl, shared_unique_id
from sexpgpu.backends.distributed import open_communicator
world = open_communicator()
nccl = load_nccl()
uid = shared_unique_id(nccl, world)
try:
    NcclComm.over(nccl, world).close()
    joined = "joined"
except NcclError as err:
    joined = err.message
open(f"{sys.argv[1]}/rank-{world.rank}.json", "w").write(json.dumps({"uid": uid.hex(), "joined": joined}))
'''


@needs_nccl
def test_the_wheel_library_loads_and_every_function_resolves():
    nccl = nccl_layer.load_nccl()
    assert nccl.path.endswith("nvidia/nccl/lib/libnccl.so.2")
    major, minor, _ = nccl.version()
    assert (major, minor) >= (2, 19)
    library = ctypes.CDLL(nccl.path)
    for name in SIGNATURES:
        assert getattr(library, name) is not None


@needs_nccl
def test_unique_ids_are_fresh_bytes():
    nccl = nccl_layer.load_nccl()
    first, second = nccl.unique_id(), nccl.unique_id()
    assert len(first) == len(second) == UNIQUE_ID_BYTES and first != second


class _Function:
    """A stand-in for one of libnccl's functions: records its calls, returns a fixed ncclResult_t."""

    def __init__(self, calls: list, name: str, result: int = 0) -> None:
        self.calls, self.name, self.result = calls, name, result
        self.argtypes: list = []
        self.restype = None

    def __call__(self, *args):
        self.calls.append((self.name, args))
        if self.name == "ncclGetUniqueId":
            ctypes.memmove(args[0], b"u" * UNIQUE_ID_BYTES, UNIQUE_ID_BYTES)
        return self.result


class _Library:
    def __init__(self, failing: str | None = None) -> None:
        self.calls: list = []
        for name in SIGNATURES:
            setattr(self, name, _Function(self.calls, name, 2 if name == failing else 0))
        self.ncclGetErrorString = lambda result: b"unhandled system error"
        self.ncclGetLastError = lambda comm: b"socket closed"


def test_arguments_are_marshalled_as_the_c_signatures_say():
    library = _Library()
    comm = NcclComm.over(Nccl(library, "fake"), SingleProcess())
    assert library.ncclAllReduce.argtypes[2] is ctypes.c_size_t and library.ncclAllReduce.restype is ctypes.c_int
    name, (handle, ranks, uid, rank) = library.calls[-1]
    assert (name, ranks, rank, bytes(bytearray(uid))) == ("ncclCommInitRank", 1, 0, b"u" * UNIQUE_ID_BYTES)
    comm.reduce_scatter(0x7000, 0x8000, 256, "f32", "avg", 0x99)
    comm.all_gather(0x8000, 0x7000, 256, "bf16", 0x99)
    comm.all_reduce(0x7000, 0x7000, 512, "f32", "sum", 0)
    assert library.calls[-3:] == [
        ("ncclReduceScatter", (0x7000, 0x8000, 256, 7, 4, comm.handle, 0x99)),
        ("ncclAllGather", (0x8000, 0x7000, 256, 9, comm.handle, 0x99)),
        ("ncclAllReduce", (0x7000, 0x7000, 512, 7, 0, comm.handle, 0)),
    ]


def test_a_refused_call_names_it_and_nccls_words():
    comm = NcclComm.over(Nccl(_Library(failing="ncclAllGather"), "fake"), SingleProcess())
    with pytest.raises(NcclError) as raised:
        comm.all_gather(1, 2, 3, "f32", 0)
    assert raised.value.message == "ncclAllGather failed: unhandled system error (socket closed)"


def test_without_the_library_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(nccl_layer, "library_path", lambda: "/nowhere/libnccl.so.2")
    nccl_layer.load_nccl.cache_clear()
    try:
        with pytest.raises(CudaToolchainMissing, match=r"the NCCL library \(libnccl.so.2, wheel nvidia-nccl-cu13\) "
                                                       r"is not installed .*install the CUDA toolchain with pip"):
            nccl_layer.load_nccl()
    finally:
        nccl_layer.load_nccl.cache_clear()


@needs_nccl
def test_two_ranks_share_rank_0s_unique_id_through_mpi_and_ask_nccl_to_join(tmp_path):
    pytest.importorskip("mpi4py", reason="the mpi extra brings MPI")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    done = subprocess.run([str(mpiexec), "-n", "2", sys.executable, "-c", JOIN, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    results = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert results[0]["uid"] == results[1]["uid"] and len(bytes.fromhex(results[0]["uid"])) == UNIQUE_ID_BYTES
    # Without a GPU NCCL cannot join (a CUDA error); on one GPU it refuses two ranks on the same device.
    for result in results:
        assert result["joined"] == "joined" or result["joined"].startswith("ncclCommInitRank failed: "), result
