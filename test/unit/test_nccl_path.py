"""GPU ranks reduce through NCCL (backends/cuda/nccl.py `NcclCollectives`, docs/distributed.md), run
without a GPU: the real CUDA executor and `CudaRuntime` over the fake driver (`fake_cuda_driver.py`),
the real NCCL layer over a fake libnccl (`fake_nccl.py`) that checks every argument and performs the
collectives: for a world of 2 ranks whose other rank mirrors this one (`MirrorWorld`), and across two
ranks that are threads of this process, each with a fake GPU of its own (`ThreadRanks`).

What is checked: the collectives move the data as NCCL's would; each runs on the side stream after an
event of the compute stream, and the compute stream waits for an event after it before its next
work; in a training step the reduction comes after the last microbatch's backward and before the
update; ZeRO-1 groups are reduce-scattered and all-gathered in place; host staging stays where NCCL
cannot serve (cuda-sim, `SEXPGPU_NCCL=off`, ranks sharing a GPU, NCCL missing)."""

from __future__ import annotations

import functools
import io
import threading
from pathlib import Path

import fake_cuda_driver
import fake_nccl
import numpy as np
import pytest
from fake_nccl import MirrorWorld
from sexpgpu.backends.cuda import driver_cuda
from sexpgpu.backends.cuda import nccl as nccl_layer
from sexpgpu.backends.cuda.errors import CudaToolchainMissing
from sexpgpu.backends.cuda.executable import CudaExecutable
from sexpgpu.backends.cuda.executor import CudaExecutor
from sexpgpu.backends.cuda.nccl import NcclCollectives
from sexpgpu.backends.training import Trainer, TrainingPlan
from test_fake_driver import record_alignments

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: The calls that order one NCCL window with the compute stream, in order (the collectives in between).
WINDOW_OPEN = ["cuEventRecord", "cuStreamWaitEvent", "ncclGroupStart"]
WINDOW_CLOSE = ["ncclGroupEnd", "cuEventRecord", "cuStreamWaitEvent"]


def on_other_gpu(place, rank):
    """The mirror rank's (host, device): the same machine, the device after this one's."""
    host, device = place
    return host, device + rank


@pytest.fixture
def fake(monkeypatch):
    driver = fake_cuda_driver.install(monkeypatch)
    yield driver
    assert driver.violations == []


@pytest.fixture
def nccl(monkeypatch, fake):
    monkeypatch.delenv("SEXPGPU_NCCL", raising=False)
    return fake_nccl.install(monkeypatch, fake)


@pytest.fixture
def executor(fake):
    executor = CudaExecutor("cuda", runtime=driver_cuda.CudaRuntime(0))
    yield executor
    executor.runtime.close()


def windows(calls) -> list[list]:
    """The calls of each NCCL window: from the event record that opens it to the stream wait that closes it."""
    names = [call.name for call in calls]
    found = []
    for index, name in enumerate(names):
        if name == "ncclGroupStart":
            end = names.index("ncclGroupEnd", index) + 3
            found.append(calls[index - 2:end])
    return found


def check_window(window, runtime, collectives: NcclCollectives) -> list:
    """The window's collectives, after checking it is ordered on the side stream by events."""
    names = [call.name for call in window]
    assert names[:3] == WINDOW_OPEN and names[-3:] == WINDOW_CLOSE, names
    compute, side = runtime.default_stream.handle, collectives.side.handle
    opened_by, side_waits = window[0], window[1]
    assert int(opened_by.args[1]) == compute and int(side_waits.args[0]) == side
    assert int(side_waits.args[1]) == int(opened_by.args[0])
    closed_by, compute_waits = window[-2], window[-1]
    assert int(closed_by.args[1]) == side and int(compute_waits.args[0]) == compute
    assert int(compute_waits.args[1]) == int(closed_by.args[0])
    collective_calls = window[3:-3]
    assert all(call.args[-1] == side for call in collective_calls)
    assert all(call.result == 0 for call in window)
    return collective_calls


def test_the_collectives_move_the_data_as_nccl_does_on_the_side_stream(fake, nccl, executor):
    collectives = executor.collectives(MirrorWorld(peer=on_other_gpu))
    assert isinstance(collectives, NcclCollectives) and collectives.transport == "NCCL"
    name, args = nccl.calls()[-1].name, nccl.calls()[-1].args
    assert (name, args[1], args[3]) == ("ncclCommInitRank", 2, 0)
    start = len(fake.calls)
    values = np.arange(8, dtype=np.float32)
    a, b = executor.upload(values), executor.upload(values[:3] + 0.5)
    collectives.sum_arrays([a, b])
    np.testing.assert_array_equal(executor.download(a), 2 * values)
    np.testing.assert_array_equal(executor.download(b), 2 * (values[:3] + 0.5))
    group = executor.upload(values)
    shard = executor.view(group, 0, (4,))
    collectives.reduce_scatter(group, shard)
    np.testing.assert_array_equal(executor.download(shard), 2 * values[:4])
    collectives.all_gather(shard, group)
    np.testing.assert_array_equal(executor.download(group), np.tile(2 * values[:4], 2))
    collectives.share_arrays([a], root=1)
    made = [call for call in windows(fake.calls[start:])]
    assert len(made) == 4
    collective_names = [[call.name for call in check_window(window, executor.runtime, collectives)]
                        for window in made]
    assert collective_names == [["ncclAllReduce", "ncclAllReduce"], ["ncclReduceScatter"], ["ncclAllGather"],
                                ["ncclBroadcast"]]
    all_reduce = made[0][3]
    assert all_reduce.args[:5] == (a.address, a.address, 8, 7, 0)  # in place, 8 f32 (ncclFloat32 = 7), ncclSum
    assert made[1][3].args[:4] == (group.address, shard.address, 4, 7)  # in place: rank 0's part is the first


def test_a_shard_that_is_not_this_ranks_part_is_an_internal_error(fake, nccl, executor):
    collectives = executor.collectives(MirrorWorld(peer=on_other_gpu))
    group = executor.zeros((8,), "f32")
    with pytest.raises(ValueError, match="is not rank 0's part of"):
        collectives.reduce_scatter(group, executor.view(group, 4, (4,)))


def test_host_staging_where_nccl_cannot_serve(fake, nccl, executor, monkeypatch, capsys):
    assert executor.collectives(MirrorWorld()) is None  # the mirror rank sits on the same GPU
    assert "several ranks share a GPU, which NCCL refuses" in capsys.readouterr().err
    monkeypatch.setenv("SEXPGPU_NCCL", "off")
    assert executor.collectives(MirrorWorld(peer=on_other_gpu)) is None
    monkeypatch.setenv("SEXPGPU_NCCL", "sometimes")
    with pytest.raises(Exception, match="SEXPGPU_NCCL=sometimes is not on or off"):
        executor.collectives(MirrorWorld(peer=on_other_gpu))
    monkeypatch.delenv("SEXPGPU_NCCL")

    def missing():
        raise CudaToolchainMissing("the NCCL library (libnccl.so.2, wheel nvidia-nccl-cu13) is not installed",
                                   "training on several GPU ranks")

    monkeypatch.setattr(nccl_layer, "load_nccl", missing)
    assert executor.collectives(MirrorWorld(peer=on_other_gpu)) is None
    assert "GPU ranks reduce through MPI by host staging" in capsys.readouterr().err
    assert nccl.calls() == []


def test_the_plan_explain_names_is_what_collectives_chooses(fake, nccl, executor, monkeypatch):
    """`planned_collectives` says, before any rank starts, the road `collectives` takes for ranks started on
    this machine (each opening its id of SEXPGPU_DEVICES), with why where it is host staging."""
    from sexpgpu.backends.distributed import CollectivesPlan

    monkeypatch.setenv("SEXPGPU_DEVICES", "0,1")
    assert executor.planned_collectives(2) == CollectivesPlan("NCCL")
    monkeypatch.setenv("SEXPGPU_DEVICES", "0,1,1")
    assert executor.planned_collectives(3) == CollectivesPlan("MPI", "ranks share GPU 1, which NCCL refuses")
    monkeypatch.delenv("SEXPGPU_DEVICES")  # --ranks N alone: every rank opens device 0
    assert executor.planned_collectives(2) == CollectivesPlan("MPI", "ranks share GPU 0, which NCCL refuses")
    monkeypatch.setenv("SEXPGPU_DEVICES", "0,1")
    monkeypatch.setenv("SEXPGPU_NCCL", "off")
    assert executor.planned_collectives(2) == CollectivesPlan("MPI", "SEXPGPU_NCCL=off")
    monkeypatch.delenv("SEXPGPU_NCCL")

    def missing():
        raise CudaToolchainMissing("the NCCL library (libnccl.so.2, wheel nvidia-nccl-cu13) is not installed",
                                   "training on several GPU ranks")

    monkeypatch.setattr(nccl_layer, "load_nccl", missing)
    plan = executor.planned_collectives(2)
    assert plan.transport == "MPI" and plan.host_staging.startswith("the NCCL library (libnccl.so.2")
    assert nccl_layer.planned_collectives("cuda-sim", 2) == CollectivesPlan("MPI", "cuda-sim has no NCCL")


@pytest.mark.parametrize("zero_stage", [1, 0])
def test_training_steps_reduce_through_nccl_after_the_last_backward_and_before_the_update(
        fake, nccl, monkeypatch, tmp_path, zero_stage):
    """examples/gpt.sx --variant smoke (4 microbatches: 2 on this rank of 2), 3 steps, through the real runtime
    over the fakes: each step the gradients meet in NCCL windows between the rank's last microbatch and the
    first update graph; with ZeRO-1 the flat groups are reduce-scattered and their parameters all-gathered
    after the shard updates."""
    record_alignments(monkeypatch, fake)
    graphs: list[str] = []
    call = CudaExecutable.__call__

    def marked(self, inputs, out=None):
        # The graph's name among the driver's calls, so the NCCL windows' place in a step shows.
        fake.calls.append(fake_cuda_driver.Call(f"graph {self.name}", ()))
        graphs.append(self.name)
        return call(self, inputs, out)

    monkeypatch.setattr(CudaExecutable, "__call__", marked)
    executor = CudaExecutor("cuda", runtime=driver_cuda.CudaRuntime(0))
    plan = TrainingPlan.compile(str(EXAMPLES / "gpt.sx"), "smoke", {"steps": 3})
    if zero_stage == 0:
        plan.run_op.attributes["zero_stage"] = 0
    trainer = Trainer(plan, tmp_path / "run", None, io.StringIO(), False, executor,
                      world=MirrorWorld(peer=on_other_gpu))
    collectives = trainer.collectives
    assert isinstance(collectives, NcclCollectives)
    assert (trainer.sharded is not None) == (zero_stage == 1)
    result = trainer.run()
    assert result.status == "done" and result.step == 3
    names = [call.name for call in fake.calls]
    steps = [index for index, name in enumerate(names) if name.startswith("graph train") and
             not name.startswith("graph train_accumulating") and not name.startswith("graph train_stacked_accumulating")]
    assert len(steps) == 3, [name for name in names if name.startswith("graph")]
    for number, first in enumerate(steps):
        stop = steps[number + 1] if number + 1 < len(steps) else len(names)
        step_calls = fake.calls[first:stop]
        step_names = names[first:stop]
        marks = [index for index, name in enumerate(step_names) if name.startswith("graph ")]
        microbatches = [index for index in marks if step_names[index].startswith("graph train")]
        updates = [index for index in marks if index > microbatches[-1]]
        made = windows(step_calls)
        assert made, f"step {number + 1} made no NCCL call"
        opened = step_calls.index(made[0][0])
        # After the last microbatch's backward; before any update graph runs.
        assert microbatches[-1] < opened < updates[0]
        collectives_made = [call.name for window in made for call in check_window(window, executor.runtime, collectives)]
        if zero_stage == 1:
            assert "ncclReduceScatter" in collectives_made and "ncclAllGather" in collectives_made
            gather = step_calls.index(next(w for w in made if w[3].name == "ncclAllGather")[0])
            # The parameters are gathered after the shard updates.
            assert any(microbatches[-1] < index < gather for index in updates)
        else:
            assert set(collectives_made) == {"ncclAllReduce"}
        for call in (c for window in made for c in window[3:-3]):
            assert call.args[3] == 7 and call.args[-2] == nccl.comm  # f32, the communicator NCCL made
    assert result.step == 3 and len(graphs) > 0
    executor.runtime.close()


def test_the_device_checks_nccl_part_runs_over_the_fakes(fake, monkeypatch):
    """tools/device-check's NCCL half (one rank on a GPU: a torchrun-style world of one and the executor's
    collectives) over the fakes, where a rank's collectives leave the values as they are."""
    import importlib.machinery
    import importlib.util

    fake_nccl.install(monkeypatch, fake, rank=0, size=1)
    for name in ("SEXPGPU_DEVICES", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    loader = importlib.machinery.SourceFileLoader("device_check", str(EXAMPLES.parent / "tools" / "device-check"))
    device_check = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(device_check)
    result = device_check.nccl_one_rank()
    assert result["device_collectives_unchanged"] and result["host_collectives_unchanged"]
    assert (result["transport"], result["nccl_version"]) == ("NCCL", "2.32.3")


def test_two_thread_ranks_train_through_nccl_making_the_same_collectives(monkeypatch, tmp_path):
    """Two ranks of examples/gpt.sx smoke (2 of the 4 microbatches each), 2 steps, as threads of this process,
    each with a fake GPU of its own (devices 0 and 1) and a fake libnccl that performs every collective
    across the two and checks both make the same ones in the same order (a mismatch hangs NCCL): the
    unique id reaches rank 1 through the MPI side, both train to the end, and only rank 0 writes the record."""
    from types import SimpleNamespace

    from sexpgpu.backends.cuda import cublaslt
    from sexpgpu.backends.cuda.nccl import Nccl

    alignments = SimpleNamespace()
    record_alignments(monkeypatch, alignments)
    local = threading.local()
    monkeypatch.setattr(driver_cuda, "load_driver", lambda: local.driver)
    monkeypatch.setattr(cublaslt, "cublaslt_library", lambda: local.cublas)
    monkeypatch.setattr(cublaslt, "descriptors_for", lambda spec: local.descriptors(spec))
    monkeypatch.setattr(nccl_layer, "load_nccl", lambda: local.nccl)
    monkeypatch.delenv("SEXPGPU_NCCL", raising=False)
    network = fake_nccl.ThreadRanks(2)
    plans = [TrainingPlan.compile(str(EXAMPLES / "gpt.sx"), "smoke", {"steps": 2}) for _ in range(2)]
    drivers, libraries = {}, {}

    def rank(index: int):
        local.driver = drivers[index] = fake_cuda_driver.FakeDriver(
            devices=2, kernel_alignment=lambda name: alignments.kernel_alignment(name))
        local.cublas = local.driver.cublaslt = fake_cuda_driver.FakeCublasLt(local.driver)
        local.descriptors = functools.cache(cublaslt.GemmDescriptors)
        libraries[index] = fake_nccl.FakeNccl(local.driver, index, 2, network)
        local.nccl = Nccl(libraries[index], "fake libnccl.so.2")
        executor = CudaExecutor("cuda", runtime=driver_cuda.CudaRuntime(index))
        trainer = Trainer(plans[index], tmp_path / "run", None, io.StringIO(), False, executor,
                          world=fake_nccl.ThreadWorld(network, index))
        assert isinstance(trainer.collectives, NcclCollectives)
        result = trainer.run()
        executor.runtime.close()
        return result

    results = network.run(rank)
    assert [(results[i].status, results[i].step) for i in range(2)] == [("done", 2), ("done", 2)]
    made = []
    for index in range(2):
        assert drivers[index].violations == []
        made.append([(call.name, *call.args[2:4]) for call in libraries[index].calls() if call.name in
                     ("ncclAllReduce", "ncclReduceScatter", "ncclAllGather", "ncclBroadcast")])
    assert made[0] == made[1]  # (name, count, datatype) of each collective, in order: the same on both ranks
    assert {"ncclReduceScatter", "ncclAllGather"} <= {name for name, _, _ in made[0]}
    assert (tmp_path / "run" / "events.jsonl").exists()
