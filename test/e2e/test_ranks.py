"""Data-parallel ranks end to end: 2 real MPI ranks on CPUs against 1 (docs/distributed.md).

The tiny example's smoke variant with 2 microbatches a step (one per rank),
a gradient diagnostic, clipping, evaluations and checkpoints every 3 steps:
every part of a step that the ranks reduce. Each rank runs one BLAS thread.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from sexpgpu.backends.checkpoint import list_checkpoints, read_checkpoint
from sexpgpu.backends.events import events_schema, read_events

pytest.importorskip("mpi4py", reason="the mpi extra (pip install -e '.[mpi]') brings MPI")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-gpt.sx"
STEPS = 6
SMALL = ["--variant", "smoke", "--set", "microbatches=2", "--set", f"steps={STEPS}", "--set", "diagnose-every=3",
         "--set", "checkpoint-every=3", "--set", "eval-every=3"]
#: Losses of 2 ranks against 1 (f32): the issue's bound. Measured: equal bit for bit (one microbatch
#: a rank: the sum over the ranks adds the same two gradients as one rank does).
RELATIVE = 1e-6
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "sexpgpu.tools.main", *args]


def run_cli(*args: str, check: bool = True, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([*(launcher or []), *command(*args)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **ONE_THREAD}, cwd=ROOT)
    if check:
        assert result.returncode == 0, result.stderr + result.stdout
    return result


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [event for event in read_events(run_dir / "events.jsonl") if event["type"] == kind]


def numbers(event: dict) -> dict:
    """The numbers of a step, diagnostic or eval event, by name."""
    found = {"loss": event["loss"]} if "loss" in event else {}
    for key in ("metrics", "values", "counters"):
        found.update({f"{key}:{name}": value for name, value in event.get(key, {}).items()})
    return found


def assert_same_run(ours: Path, theirs: Path, first_step: int = 1) -> None:
    for kind in ("step", "diagnostic", "eval"):
        mine = [e for e in events_of(ours, kind) if e["step"] >= first_step]
        other = [e for e in events_of(theirs, kind) if e["step"] >= first_step]
        assert [e["step"] for e in mine] == [e["step"] for e in other], kind
        for a, b in zip(mine, other):
            for name, value in numbers(a).items():
                assert abs(value - numbers(b)[name]) <= RELATIVE * abs(value), (kind, a["step"], name, value, numbers(b)[name])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one-rank")
    run_cli("run", str(EXAMPLE), *SMALL, "--out", str(out))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two-ranks")
    run_cli("run", str(EXAMPLE), *SMALL, "--out", str(out), "--ranks", "2")
    return out


def test_two_ranks_train_as_one_and_rank_0_records(one_rank, two_ranks):
    assert_same_run(two_ranks, one_rank)
    events = read_events(two_ranks / "events.jsonl")
    schema = events_schema()
    for event in events:
        jsonschema.validate(event, schema)
    manifest = events[0]["manifest"]
    assert (manifest["ranks"], manifest["microbatches_per_rank"], manifest["zero_stage"]) == (2, 1, 1)
    assert manifest["tokens_per_step"] == events_of(one_rank, "start")[0]["manifest"]["tokens_per_step"]
    # One record: rank 0's events (one start, one end) and checkpoints.
    assert [e["type"] for e in events].count("start") == 1 and events[-1]["status"] == "done"
    assert [step for step, _ in list_checkpoints(two_ranks)] == [3, 6]


def test_zero_stage_0_under_an_outside_mpiexec_trains_the_same(one_rank, tmp_path):
    experiment = tmp_path / "tiny-gpt.sx"
    text = EXAMPLE.read_text().replace(":precision precision :seed seed)",
                                       ":precision precision :seed seed :zero-stage 0)")
    assert text != EXAMPLE.read_text()
    experiment.write_text(text)
    (tmp_path / "data").symlink_to(ROOT / "examples" / "data")
    out = tmp_path / "run"
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    run_cli("run", str(experiment), *SMALL, "--out", str(out), launcher=[mpiexec, "-n", "2"])
    assert events_of(out, "start")[0]["manifest"]["zero_stage"] == 0
    assert_same_run(out, one_rank)


def test_a_two_rank_checkpoint_resumes_on_two_ranks_exactly_and_on_one(two_ranks, tmp_path):
    step_3 = two_ranks / "checkpoints" / "step-3"
    on_two, on_one = tmp_path / "two", tmp_path / "one"
    run_cli("run", str(EXAMPLE), *SMALL, "--resume", str(step_3), "--out", str(on_two), "--ranks", "2")
    resumed = {e["step"]: e["loss"] for e in events_of(on_two, "step")}
    assert resumed == {e["step"]: e["loss"] for e in events_of(two_ranks, "step") if e["step"] > 3}
    run_cli("run", str(EXAMPLE), *SMALL, "--resume", str(step_3), "--out", str(on_one))
    assert_same_run(on_one, two_ranks, first_step=4)


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_process(pid: int, rank: int) -> int | None:
    for child in descendants(pid):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in environ and b"-m" in Path(f"/proc/{child}/cmdline").read_bytes():
            return child
    return None


def wait_for(condition, seconds: float = 180) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.05)


@pytest.mark.parametrize(("rank", "signum", "how", "during", "env"), [
    (1, signal.SIGKILL, "was killed by SIGKILL", r"(in step|writing the checkpoint of step) \d+", {}),
    (0, signal.SIGKILL, "was killed by SIGKILL", "writing the checkpoint of step 6",
     {"SEXPGPU_TEST_CHECKPOINT_PAUSE": "6:120"}),
    # Stopped, not dead: it stops responding, and the launcher ends it.
    (1, signal.SIGSTOP, r"stopped responding \(no sign of life for \d+ s\)",
     r"(in step|writing the checkpoint of step) \d+", {}),
])
def test_a_killed_or_stopped_rank_stops_the_others_naming_it_and_the_last_checkpoint_loads(tmp_path, rank, signum,
                                                                                          how, during, env):
    out = tmp_path / "run"
    process = subprocess.Popen(command("run", str(EXAMPLE), *SMALL, "--set", "steps=400", "--out", str(out),
                                       "--ranks", "2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **ONE_THREAD, **env}, cwd=ROOT)
    try:
        if env:
            wait_for(lambda: any((out / "checkpoints").glob(".step-6.tmp-*/optimizer.safetensors")))
        else:
            wait_for(lambda: len(list_checkpoints(out)) >= 1)
        victim = rank_process(process.pid, rank)
        assert victim is not None
        everyone = descendants(process.pid)
        os.kill(victim, signum)
        signalled = time.time()
        _, stderr = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
    assert time.time() - signalled < 30
    assert process.returncode == 1
    line = stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: rank {rank} \(process {victim}\) {how} {during}; the other "
                        r"ranks were stopped; the last checkpoint, \S+/checkpoints/step-\d+, is intact", line), line
    assert "BAD TERMINATION" not in stderr
    last = list_checkpoints(out)[-1][1]
    assert last.name == line.rsplit("/", 1)[1].removesuffix(", is intact")
    read_checkpoint(last)
    assert events_of(out, "end")[-1]["status"] == "failed"
    assert not [pid for pid in everyone if Path(f"/proc/{pid}").exists()]


def test_microbatches_that_do_not_divide_are_a_located_error_before_any_rank_starts(tmp_path):
    result = run_cli("run", str(EXAMPLE), "--variant", "smoke", "--set", "microbatches=3", "--ranks", "2",
                     "--out", str(tmp_path / "run"), check=False)
    assert result.returncode == 1
    assert "tiny-gpt.sx:" in result.stderr and "error: :microbatches 3 cannot be dealt evenly to 2 ranks" in result.stderr
    assert not (tmp_path / "run").exists()


def test_ctrl_c_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    # Its own session, so the Ctrl-C goes to the launcher and every rank, as a terminal sends it.
    process = subprocess.Popen(command("run", str(EXAMPLE), *SMALL, "--set", "steps=400", "--set",
                                       "checkpoint-every=1000", "--out", str(out), "--ranks", "2"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, **ONE_THREAD}, cwd=ROOT)
    try:
        wait_for(lambda: (out / "events.jsonl").exists() and len(events_of(out, "step")) >= 2)
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, stderr
    end = events_of(out, "end")[-1]
    assert end["status"] == "interrupted"
    assert [step for step, _ in list_checkpoints(out)] == [end["step"]]


def test_a_new_run_on_ranks_refuses_an_existing_record_before_any_rank_starts(two_ranks):
    result = run_cli("run", str(EXAMPLE), *SMALL, "--out", str(two_ranks), "--ranks", "2", check=False)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"error: {two_ranks} already holds a run record; continue it with "
                                          f"--resume {two_ranks}, or choose another --out"]
