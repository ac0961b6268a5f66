"""GPU ranks of a torchrun-style launch (backends/rendezvous.py, `NcclWorld` in backends/cuda/nccl.py):
rank 0's NCCL unique id reaches the other ranks through MASTER_ADDR:MASTER_PORT (2 real processes, through
rank 0's own service and through torchrun's agent store), a rank that never comes is one line naming it,
and the host collectives of such a world are NCCL's (over the fake driver and fake libnccl)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import fake_cuda_driver
import fake_nccl
import numpy as np
import pytest
from sexpgpu.backends import rendezvous
from sexpgpu.backends.cuda.executor import CudaExecutor
from sexpgpu.backends.cuda.nccl import UNIQUE_ID_BYTES, NcclCollectives, NcclWorld
from sexpgpu.backends.rendezvous import share_bytes

from sexpgpu.diagnostics import SxError

#: One rank of the exchange: rank 0 offers its bytes, every rank prints what it got.
RANK = r'''
import os, sys
from sexpgpu.backends.rendezvous import share_bytes
rank = int(os.environ["RANK"])
got = share_bytes(rank, int(os.environ["WORLD_SIZE"]), lambda: bytes([rank + 7]) * 128, 128, seconds=60)
print(got.hex())
'''


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_ranks(size: int, port: int, **extra: str) -> list[subprocess.Popen]:
    ranks = []
    for rank in range(size):
        env = {name: value for name, value in os.environ.items() if not name.startswith("TORCHELASTIC_")}
        env.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", **extra)
        ranks.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return ranks


def outputs(ranks: list[subprocess.Popen]) -> list[str]:
    found = []
    for process in ranks:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        found.append(out.strip())
    return found


def test_two_processes_get_rank_0s_bytes_through_its_own_service():
    # Rank 1 starts first: it retries until rank 0 listens.
    ranks = start_ranks(2, free_port())[::-1]
    assert outputs(ranks) == [(bytes([7]) * 128).hex()] * 2


def test_two_processes_get_rank_0s_bytes_through_torchruns_agent_store():
    torch_distributed = pytest.importorskip("torch.distributed", reason="torchrun's store is PyTorch's")
    from datetime import timedelta

    port = free_port()
    # What torchrun's agent runs: the store's server, at MASTER_PORT.
    store = torch_distributed.TCPStore("127.0.0.1", port, 3, is_master=True, timeout=timedelta(seconds=60),
                                       wait_for_workers=False)
    ranks = start_ranks(2, port, TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    assert outputs(ranks) == [(bytes([7]) * 128).hex()] * 2
    assert store.get(f"{rendezvous.STORE_KEY}/0") == bytes([7]) * 128


def test_a_rank_that_never_comes_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(SxError, match=r"^ranks 1, 2 did not reach rank 0 on MASTER_PORT \d+ within 1 s$"):
        share_bytes(0, 3, lambda: b"x" * 4, 4, seconds=1)
    with pytest.raises(SxError, match=r"^rank 1 could not reach rank 0 at MASTER_ADDR:MASTER_PORT 127.0.0.1:\d+ "
                                      r"within 1 s"):
        share_bytes(1, 3, lambda: b"x" * 4, 4, seconds=1)


@pytest.mark.parametrize("address, port", [(None, "29500"), ("127.0.0.1", None), ("127.0.0.1", "port")])
def test_master_address_missing_or_wrong_is_one_line(monkeypatch, address, port):
    for name, value in (("MASTER_ADDR", address), ("MASTER_PORT", port)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(SxError, match=r"RANK/WORLD_SIZE start GPU ranks that meet at MASTER_ADDR:MASTER_PORT, but "
                                      r"they are .*; set both \(torchrun does\)"):
        share_bytes(0, 2, lambda: b"x", 1)


def test_a_torchrun_world_on_gpus_makes_its_host_collectives_with_nccl(monkeypatch):
    """Rank 0 of 2 (the other mirrors it, its rendezvous a thread here) over the fake driver and libnccl: the
    unique id reaches rank 1, metrics are summed, objects broadcast and gathered through device buffers,
    and the executor's gradients go through the same communicator."""
    driver = fake_cuda_driver.install(monkeypatch)
    library = fake_nccl.install(monkeypatch, driver)
    port = free_port()
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("SEXPGPU_DEVICES", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    fetched: list[bytes] = []
    peer = threading.Thread(target=lambda: fetched.append(rendezvous._fetch(1, "127.0.0.1", port, UNIQUE_ID_BYTES, 30)))
    peer.start()
    world = NcclWorld(0, 2)
    peer.join()
    assert fetched == [library.uid] and world.transport == "NCCL"
    assert world.sum_values([1.5, -2.0, 0.0]) == [3.0, -4.0, 0.0]
    assert world.broadcast({"out": "runs/x", "step": 3}) == {"out": "runs/x", "step": 3}
    assert world.gather([np.arange(3.0)])[1][0].tolist() == [0.0, 1.0, 2.0]
    names = [call.name for call in library.calls()]
    assert names[0] == "ncclGetUniqueId" and names[1] == "ncclCommInitRank"
    assert {"ncclAllReduce", "ncclBroadcast", "ncclAllGather"} <= set(names)
    executor = CudaExecutor("cuda", runtime=world.runtime)
    collectives = executor.collectives(world)
    assert isinstance(collectives, NcclCollectives) and collectives.comm is world.comm
    assert driver.violations == []
