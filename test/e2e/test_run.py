"""`sexpgpu run` end to end on the tiny example, shrunk by its smoke variant.

Runs go through the command line in a subprocess (as a user runs them), with
one BLAS thread so a busy machine cannot oversubscribe its cores; errors that
happen before the first step are checked in process, through
`backends.training.train`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from sexpgpu.backends.checkpoint import list_checkpoints, manifest_checksum, read_checkpoint
from sexpgpu.backends.cuda.selection import runtime_unavailable
from sexpgpu.backends.events import events_schema, read_events
from sexpgpu.backends.training import train

from sexpgpu.diagnostics import SxError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-gpt.sx"
#: Smoke-sized: 20 steps of a one-layer width-32 model, evaluated only at the end.
SMALL = ["--variant", "smoke", "--set", "eval-every=1000"]
#: bf16 losses stay within this relative distance of the f32 ones, step by step, over 50 steps
#: (measured: 3.3e-4 at most).
BF16_TOLERANCE = 0.01


def run_cli(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "sexpgpu.tools.main", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})}, cwd=ROOT,
    )
    if check:
        assert result.returncode == 0, result.stderr + result.stdout
    return result


def start_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sexpgpu.tools.main", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})}, cwd=ROOT,
    )


def step_losses(run_dir: Path) -> dict[int, float]:
    """Step → loss; a resumed record's later lines win, as they do for `sexpgpu plot`."""
    return {e["step"]: e["loss"] for e in read_events(run_dir / "events.jsonl") if e["type"] == "step"}


def wait_for(condition, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """20 smoke steps, checkpoints at 10 and 20: the run every other test compares with."""
    out = tmp_path_factory.mktemp("baseline")
    run_cli("run", str(EXAMPLE), *SMALL, "--out", str(out))
    return out


def test_run_trains_and_records_valid_events_and_checkpoints(baseline):
    events = read_events(baseline / "events.jsonl")
    validator = jsonschema.Draft202012Validator(events_schema())
    for event in events:
        validator.validate(event)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert events[-1]["status"] == "done" and events[-1]["step"] == 20
    assert events[0]["parameters"] > 0 and events[0]["manifest"]["precision"] == "f32"
    assert {e["counters"]["tokens"] for e in events if e["type"] == "step"} == {4 * 16}
    losses = step_losses(baseline)
    assert sorted(losses) == list(range(1, 21))
    first, last = np.mean([losses[s] for s in range(1, 6)]), np.mean([losses[s] for s in range(16, 21)])
    assert last < first - 0.5, (first, last)
    evals = [e for e in events if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [20] and evals[0]["metrics"]["val/loss"] < losses[1]
    assert [e["step"] for e in events if e["type"] == "diagnostic"] == [10, 20]
    assert [e["step"] for e in events if e["type"] == "checkpoint"] == [10, 20]
    assert [s for s, _ in list_checkpoints(baseline)] == [10, 20]
    manifest = read_checkpoint(baseline / "checkpoints" / "step-20").manifest
    assert manifest["loaders"]["train-loader"]["position"] == 20 * 4
    assert manifest["selection"]["variant"] == "smoke"
    assert all(len(h) == 64 for h in manifest["sources"].values())


def test_resume_continues_bit_for_bit(baseline, tmp_path):
    out = tmp_path / "resumed"
    run_cli("run", str(EXAMPLE), *SMALL, "--resume", str(baseline / "checkpoints" / "step-10"), "--out", str(out))
    resumed, original = step_losses(out), step_losses(baseline)
    assert sorted(resumed) == list(range(11, 21))
    assert all(resumed[s] == original[s] for s in resumed), (resumed, original)
    start = read_events(out / "events.jsonl")[0]
    assert start["manifest"]["start_step"] == 10 and start["manifest"]["resumed_from"].endswith("step-10")


def test_killed_during_a_checkpoint_keeps_the_previous_one_and_resumes(baseline, tmp_path):
    out = tmp_path / "killed"
    process = start_cli("run", str(EXAMPLE), *SMALL, "--out", str(out),
                        env={"SEXPGPU_TEST_CHECKPOINT_PAUSE": "20:120"})
    try:
        wait_for(lambda: any((out / "checkpoints").glob(".step-20.tmp-*/optimizer.safetensors")))
    finally:
        process.kill()
        process.communicate()
    assert [s for s, _ in list_checkpoints(out)] == [10]
    read_checkpoint(out / "checkpoints" / "step-10")
    # A second run from scratch gives the baseline's losses bit for bit.
    assert step_losses(out) == step_losses(baseline)
    run_cli("run", str(EXAMPLE), *SMALL, "--resume", str(out))
    assert step_losses(out) == step_losses(baseline)
    assert not list((out / "checkpoints").glob(".step-*"))
    assert read_events(out / "events.jsonl")[-1]["status"] == "done"


def test_bf16_follows_f32_within_tolerance(tmp_path):
    fifty = ["--set", "steps=50", "--set", "checkpoint-every=1000"]
    run_cli("run", str(EXAMPLE), *SMALL, *fifty, "--out", str(tmp_path / "f32"))
    run_cli("run", str(EXAMPLE), *SMALL, *fifty, "--set", "precision=bf16", "--out", str(tmp_path / "bf16"))
    f32, bf16 = step_losses(tmp_path / "f32"), step_losses(tmp_path / "bf16")
    assert sorted(bf16) == list(range(1, 51))
    assert f32 != bf16
    worst = max(abs(bf16[s] - f32[s]) / f32[s] for s in f32)
    assert worst < BF16_TOLERANCE, worst
    assert read_events(tmp_path / "bf16" / "events.jsonl")[0]["manifest"]["precision"] == "bf16"


def test_ctrl_c_checkpoints_and_ends_interrupted(tmp_path):
    out = tmp_path / "interrupted"
    process = start_cli("run", str(EXAMPLE), *SMALL, "--set", "steps=100000", "--out", str(out))
    try:
        wait_for(lambda: (out / "events.jsonl").exists() and '"step"' in (out / "events.jsonl").read_text())
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130
    end = read_events(out / "events.jsonl")[-1]
    assert end["type"] == "end" and end["status"] == "interrupted" and end["step"] >= 1
    # Periodic checkpoints may precede it; the interrupt writes the last one, at the step it stopped.
    assert [s for s, _ in list_checkpoints(out)][-1] == end["step"]


def test_non_finite_loss_ends_diverged_naming_the_step(tmp_path):
    out = tmp_path / "diverged"
    result = run_cli("run", str(EXAMPLE), *SMALL, "--set", "lr=1e30", "--out", str(out), check=False)
    assert result.returncode == 1
    events = read_events(out / "events.jsonl")
    validator = jsonschema.Draft202012Validator(events_schema())
    for event in events:
        validator.validate(event)
    assert events[-2]["loss"] is None or None in events[-2]["metrics"].values()
    end = events[-1]
    assert end["status"] == "diverged"
    assert end["message"].startswith(f"step {end['step']}: ") and " is " in end["message"]
    assert "training diverged at step" in result.stderr
    assert not list_checkpoints(out) or max(s for s, _ in list_checkpoints(out)) < end["step"]


def test_synthetic_tokens_train_without_a_file(tmp_path):
    """A branch-2 Markov chain is learnable far below the 256-way uniform loss (5.5 nats)."""
    example = tmp_path / "synthetic.sx"
    example.write_text(EXAMPLE.read_text().replace(
        '(token-file "data/train.u16" :tokenizer bytes)', "(synthetic-tokens :vocab 256 :count 50000 :seed 3 :branch 2)"))
    shutil.copytree(ROOT / "examples" / "data", tmp_path / "data")
    run_cli("run", str(example), *SMALL, "--set", "steps=60", "--set", "lr=0.01", "--out", str(tmp_path / "out"))
    losses = step_losses(tmp_path / "out")
    assert np.mean([losses[s] for s in range(56, 61)]) < 3.5


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(text))


def copy_example(tmp_path: Path) -> Path:
    """The example in a scratch directory, with its data beside it as the file names it."""
    shutil.copytree(ROOT / "examples" / "data", tmp_path / "data")
    return Path(shutil.copy(EXAMPLE, tmp_path / "tiny-gpt.sx"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "train.u16").unlink(), "cannot read data/train.u16: no such file"),
        (lambda d: (d / "train.u16").write_bytes(b""), "data/train.u16 is empty"),
        (lambda d: np.arange(30, dtype="<u2").tofile(d / "train.u16"), "data/train.u16 holds 30 tokens, too short"),
        (lambda d: np.array([65] * 99 + [300] + [65] * 100, dtype="<u2").tofile(d / "train.u16"),
         "data/train.u16: token id 300 at position 99 is outside the model's vocabulary of 256"),
    ],
)
def test_bad_data_is_an_error_at_the_defloader_before_the_first_step(tmp_path, damage, message):
    example = copy_example(tmp_path)
    damage(tmp_path / "data")
    with pytest.raises(SxError) as err:
        train(str(example), variant="smoke", out=tmp_path / "out")
    assert err.value.message.startswith("loader train-loader: ") and message in err.value.message
    assert (Path(err.value.loc.file), err.value.loc.line) == (example, line_of(example, "(defloader train-loader"))
    assert not (tmp_path / "out").exists()


def test_bad_data_on_the_command_line_exits_1_with_a_located_diagnostic(tmp_path):
    example = copy_example(tmp_path)
    (tmp_path / "data" / "val.u16").unlink()
    result = run_cli("run", str(example), "--variant", "smoke", "--out", str(tmp_path / "out"), check=False)
    assert result.returncode == 1
    line = line_of(example, "(defloader val-loader")
    assert f"tiny-gpt.sx:{line}:1: error: loader val-loader: cannot read data/val.u16: no such file" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_new_run_does_not_write_into_an_existing_record(baseline):
    before = (baseline / "events.jsonl").read_bytes()
    with pytest.raises(SxError, match=r"already holds a run record; continue it with --resume"):
        train(str(EXAMPLE), variant="smoke", out=baseline)
    assert (baseline / "events.jsonl").read_bytes() == before


def test_resume_refuses_another_experiment_naming_what_differs(baseline):
    before = (baseline / "events.jsonl").read_bytes()
    with pytest.raises(SxError, match=r"different experiment: knob width = 32 there, 48 here"):
        train(str(EXAMPLE), variant="smoke", sets={"eval-every": 1000, "width": 48}, resume=baseline)
    assert (baseline / "events.jsonl").read_bytes() == before


def test_resume_refuses_a_checkpoint_of_other_graphs_of_the_same_source_in_one_line(baseline, tmp_path):
    """A checkpoint an earlier compiler wrote (same source, knobs and parameters, other graphs: a wave changed
    the update graphs) is refused on the command line in one line, exit 1, no traceback; nothing changes."""
    record = Path(shutil.copytree(baseline, tmp_path / "record"))
    manifest_path = record / "checkpoints" / "step-20" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["fingerprint"] = "0" * 64
    manifest["checksum"] = manifest_checksum(manifest)
    manifest_path.write_text(json.dumps(manifest))
    before = (record / "events.jsonl").read_bytes()
    result = run_cli("run", str(EXAMPLE), *SMALL, "--resume", str(record), check=False)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"error: cannot resume from {record / 'checkpoints' / 'step-20'}: it was written by a different experiment: "
        "the graphs differ"]
    assert (record / "events.jsonl").read_bytes() == before


def test_resume_refuses_a_damaged_checkpoint_and_changes_nothing(baseline, tmp_path):
    record = Path(shutil.copytree(baseline, tmp_path / "record"))
    damaged = record / "checkpoints" / "step-20" / "params.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-8] + b"\0" * 8)
    listing = sorted(str(p.relative_to(record)) for p in record.rglob("*"))
    before = (record / "events.jsonl").read_bytes()
    with pytest.raises(SxError, match=r"step-20 is damaged .*params.safetensors does not match.*an earlier one is"):
        train(str(EXAMPLE), variant="smoke", sets={"eval-every": 1000}, resume=record)
    assert (record / "events.jsonl").read_bytes() == before
    assert sorted(str(p.relative_to(record)) for p in record.rglob("*")) == listing


def test_cuda_without_a_gpu_is_one_line_and_exit_1(tmp_path):
    """No CUDA driver or GPU (CI has none): the registry's probe says so, before any work."""
    if runtime_unavailable("cuda") is None:
        pytest.skip("this machine has a CUDA GPU")
    result = run_cli("run", str(EXAMPLE), "--device", "cuda", "--out", str(tmp_path / "out"), check=False)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("error: the CUDA executor cannot open here: ")
    assert line.endswith("so run --device cuda cannot run; use --device cpu (or unset SEXPGPU_DEVICE)")
    assert not (tmp_path / "out").exists()


def test_plot_writes_a_png(baseline, tmp_path):
    pytest.importorskip("matplotlib")
    result = run_cli("plot", str(baseline), "-o", str(tmp_path / "m.png"))
    assert "wrote" in result.stdout
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install_it(baseline, monkeypatch, tmp_path):
    from sexpgpu.tools.plot_cmd import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SxError, match=r"needs matplotlib; install it with: pip install 'sexpgpu\[plot\]'"):
        plot(baseline, tmp_path / "m.png")


def test_events_schema_ships_with_the_package():
    schema = events_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert json.loads(json.dumps(schema))["title"] == "sexpgpu run events"
