"""The communicator (backends/distributed.py), the ranks' part of a step (backends/ranks.py) and the
launcher's account of a dead rank (backends/launch.py).

The MPI collectives run in real ranks: a small script under the mpich wheel's
`mpiexec`, with 2 and 3 ranks (an element count that does not divide).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sexpgpu.backends import distributed, ranks
from sexpgpu.backends.distributed import (
    MPI_INSTALL,
    SingleProcess,
    launcher_world,
    open_communicator,
    shard_bounds,
)
from sexpgpu.backends.launch import HydraWatch

from sexpgpu.diagnostics import SxError

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "RANK", "WORLD_SIZE")

COLLECTIVES = r'''
import json, sys
import numpy as np
from sexpgpu.backends.distributed import open_communicator, shard_bounds
world = open_communicator()
r, n = world.rank, world.size
count = 7
buffer = (np.arange(count, dtype=np.float32) + 1) * (r + 1)
summed = buffer.copy()
world.sum_into(summed)
start, stop = shard_bounds(count, n)[r]
shard = np.empty(stop - start, np.float32)
world.reduce_scatter(buffer, shard)
gathered = np.empty(count, np.float32)
world.all_gather(np.full(stop - start, r, np.float32), gathered)
shared = buffer.copy()
world.share(shared, n - 1)
result = {"rank": r, "size": n, "summed": summed.tolist(), "shard": shard.tolist(), "gathered": gathered.tolist(),
          "shared": shared.tolist(), "values": world.sum_values([r, 0.5]), "broadcast": world.broadcast(f"from {r}", root=n - 1),
          "gather": world.gather(r)}
open(f"{sys.argv[1]}/rank-{r}.json", "w").write(json.dumps(result))
'''


@pytest.fixture
def no_launcher(monkeypatch):
    for variable in LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


@pytest.mark.parametrize("size", [2, 3])
def test_mpi_collectives_in_real_ranks(size, tmp_path):
    pytest.importorskip("mpi4py", reason="the mpi extra brings MPI")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    done = subprocess.run([str(mpiexec), "-n", str(size), sys.executable, "-c", COLLECTIVES, str(tmp_path)],
                          capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    results = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(size)]
    assert [result["rank"] for result in results] == list(range(size))
    total = sum(range(1, size + 1))
    expected = ((np.arange(7) + 1) * total).tolist()
    bounds = shard_bounds(7, size)
    for result in results:
        start, stop = bounds[result["rank"]]
        assert result["summed"] == expected
        assert result["shard"] == expected[start:stop]
        assert result["gathered"] == [float(rank) for rank, (a, b) in enumerate(bounds) for _ in range(a, b)]
        assert result["shared"] == ((np.arange(7) + 1) * size).tolist()
        assert result["values"] == [sum(range(size)), 0.5 * size]
        assert result["broadcast"] == f"from {size - 1}"
        assert result["gather"] == (list(range(size)) if result["rank"] == 0 else None)


def test_shard_bounds_split_like_mpi_blocks():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(4, 2) == [(0, 2), (2, 4)]
    assert shard_bounds(1, 2) == [(0, 1), (1, 1)]


def test_a_lone_process_is_a_single_rank(no_launcher):
    assert launcher_world() is None
    world = open_communicator()
    assert isinstance(world, SingleProcess) and (world.rank, world.size, world.is_root) == (0, 1, True)
    buffer = np.arange(3, dtype=np.float32)
    world.sum_into(buffer)
    assert buffer.tolist() == [0, 1, 2] and world.sum_values([2, 3]) == [2.0, 3.0]


def test_the_launcher_environment_gives_the_rank(monkeypatch, no_launcher):
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "4")
    assert launcher_world() == (1, 4, "PMI_RANK/PMI_SIZE")
    monkeypatch.delenv("PMI_RANK")
    monkeypatch.delenv("PMI_SIZE")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert launcher_world() == (0, 2, "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE")


@pytest.mark.parametrize("device", ["cpu", "cpu-c", "cuda-sim"])
def test_torchrun_variables_on_a_cpu_are_one_line_naming_mpiexec(monkeypatch, no_launcher, device):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SxError, match=rf"RANK/WORLD_SIZE say this is rank 1 of 2, but ranks on {device} meet through "
                                      r"MPI's collectives, which those variables cannot join: start them with "
                                      r"`mpiexec -n 2 sexpgpu run \.\.\.` or `sexpgpu run --ranks 2`"):
        open_communicator(device)


def test_sexpgpu_run_under_torchrun_variables_on_cpu_is_one_line_exit_1(tmp_path):
    env = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    done = subprocess.run([sys.executable, "-m", "sexpgpu.tools.main", "run", str(ROOT / "examples" / "tiny-gpt.sx"),
                           "--variant", "smoke", "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr == ("error: RANK/WORLD_SIZE say this is rank 0 of 2, but ranks on cpu meet through MPI's "
                           "collectives, which those variables cannot join: start them with `mpiexec -n 2 sexpgpu "
                           "run ...` or `sexpgpu run --ranks 2` (docs/distributed.md)\n")
    assert not (tmp_path / "run").exists()


def test_without_mpi4py_several_ranks_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(SxError) as raised:
        distributed.import_mpi(2)
    assert raised.value.message == f"2 ranks need MPI (mpi4py and an MPI library); install them with `{MPI_INSTALL}`"


def test_run_ranks_without_mpi4py_is_one_line_exit_1(monkeypatch, capsys, no_launcher, tmp_path):
    from sexpgpu.tools.main import main

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    code = main(["run", str(ROOT / "examples" / "tiny-gpt.sx"), "--variant", "smoke", "--set", "microbatches=2", "--ranks", "2",
                 "--out", str(tmp_path / "run")])
    assert code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: 2 ranks need MPI (mpi4py and an MPI library); install them with `{MPI_INSTALL}`"]
    assert not (tmp_path / "run").exists()


def test_microbatches_must_divide_by_the_ranks():
    assert ranks.local_microbatches(8, 4, None) == 2
    with pytest.raises(SxError, match=r":microbatches 6 cannot be dealt evenly to 4 ranks"):
        ranks.local_microbatches(6, 4, None)


class _Rank:
    """A stand-in for one rank of a world (what `dealt` and `evaluation_share` read)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


class _Loader:
    batch = 4

    def __init__(self) -> None:
        self.position = 40
        self.drawn: list[int] = []

    def next_batch(self) -> None:
        self.drawn.append(self.position)
        self.position += self.batch


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_each_rank_draws_its_consecutive_microbatches_and_ends_where_one_rank_would(rank):
    loader = _Loader()
    with ranks.dealt(loader, _Rank(rank, 3), 2):
        loader.next_batch()
        loader.next_batch()
    starts = [40 + 4 * index for index in range(6)]
    assert loader.drawn == starts[2 * rank:2 * rank + 2]
    assert loader.position == 40 + 6 * 4


def test_evaluation_batches_are_shared_round_robin():
    batches = list(range(7))
    assert list(ranks.evaluation_share(iter(batches), _Rank(1, 3))) == [1, 4]
    assert list(ranks.evaluation_share(iter(batches), _Rank(0, 3))) == [0, 3, 6]


def test_hydra_banner_becomes_the_dead_process_and_how_it_died():
    banner = ("step 3/20  loss 4.1\n\n" + "=" * 83 + "\n=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
              "=   PID 4242 RUNNING AT vm\n=   EXIT CODE: 9\n=   CLEANING UP REMAINING PROCESSES\n"
              "=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES\n" + "=" * 83 + "\n"
              "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n"
              "This typically refers to a problem with your application.\n"
              "Please see the FAQ page for debugging suggestions\n")
    watch, out = HydraWatch(), io.StringIO()
    watch.relay(io.StringIO(banner), out)
    assert out.getvalue() == "step 3/20  loss 4.1\n"
    assert (watch.dead_pid, watch.how) == (4242, "was killed by SIGKILL")


def test_a_rank_record_holds_the_pid_and_last_words(monkeypatch, tmp_path):
    monkeypatch.setenv(ranks.RANK_DIRECTORY_VARIABLE, str(tmp_path))
    record = ranks.RankRecord(_Rank(1, 2))
    record.say("in step 7")
    (pid, words, silent), = ranks.read_rank_records(tmp_path).values()
    assert (pid, words) == (os.getpid(), "in step 7") and 0 <= silent < ranks.HEARTBEAT_SECONDS
    # The heartbeat keeps it fresh while the words stand.
    os.utime(record.path, (0, 0))
    time.sleep(ranks.HEARTBEAT_SECONDS + 0.5)
    assert ranks.read_rank_records(tmp_path)[1][2] < ranks.HEARTBEAT_SECONDS + 0.5


def test_a_rank_silent_too_long_while_its_process_lives_is_ended(tmp_path):
    from sexpgpu.backends.launch import SILENT_SECONDS, SilenceWatch

    stopped = subprocess.Popen(["sleep", "120"])
    os.kill(stopped.pid, signal.SIGSTOP)
    ended = subprocess.Popen(["true"])
    ended.wait()
    for rank, pid in ((0, ended.pid), (1, stopped.pid)):
        (tmp_path / f"rank-{rank}").write_text(f"{pid}\nin step 7\n")
        old = time.time() - SILENT_SECONDS - 1
        os.utime(tmp_path / f"rank-{rank}", (old, old))
    (tmp_path / "rank-2").write_text(f"{os.getpid()}\nin step 7\n")  # alive and fresh
    watch = SilenceWatch(tmp_path)
    watch.start()
    try:
        assert stopped.wait(timeout=10) == -signal.SIGKILL
    finally:
        watch.stop()
        stopped.kill()
    pid, seconds = watch.silent
    assert pid == stopped.pid and seconds > SILENT_SECONDS


def test_the_explain_document_with_ranks_validates_against_its_schema(capsys):
    import jsonschema
    from sexpgpu.tools.main import main

    assert main(["explain", str(ROOT / "test" / "lit" / "reports" / "small.sx"), "--ranks", "2", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    jsonschema.validate(document, json.loads((ROOT / "sexpgpu" / "schemas" / "explain.schema.json").read_text()))
    assert document["ranks"]["zero_stage"] == 1 and document["ranks"]["tokens_per_rank"] == 20
