"""What goes wrong while a run runs is an error a user can act on, never a bug report.

A record directory that cannot be made, a disk that fills during a checkpoint
or the event log, tensors or activations that do not fit in memory: each is
exit 1 (or 2 for a wrong `--out`) with a message naming what failed.
"""

from __future__ import annotations

import errno
import io
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from sexpgpu.backends.checkpoint import list_checkpoints
from sexpgpu.backends.events import read_events
from sexpgpu.backends.training import train
from sexpgpu.tools.main import main

from sexpgpu.diagnostics import SxError, UsageError

TINY = """\
(defknobs (width 4) (steps 4) (extra 1))
(defloader data :source (synthetic-tokens :vocab 16 :count 256 :seed 1) :fields ((tokens [5] i32)) :batch 2)
(defmodule net ()
  (let ((w (param w [width] :init ones)) (b (param b [extra width] :init zeros)))
    (fn (x) (* (mean (cast x f32)) (+ (sum w) (sum b))))))
(defmodel model (net))
(defn objective (batch) (model (get batch :tokens)))
(defoptimizer opt (adamw :lr 0.01))
(defrun :steps steps :loader data :objective objective :optimizer opt :checkpoints (every 2))
"""

#: An activation of [10, 20000, 20000] i32 (14.9 GiB) from small parameters.
HUGE_ACTIVATION = TINY.replace("(* (mean (cast x f32))", "(* (mean (cast (+ (reshape x [10 1 1]) (iota [1 20000 20000] 1)) f32))")


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.sx"
    path.write_text(TINY)
    return path


def quiet_train(path: Path, **kwargs):
    return train(str(path), stream=io.StringIO(), interactive=False, **kwargs)


@pytest.mark.parametrize(
    ("out", "message"),
    [("blocker", "it is a file, not a directory; choose another --out"),
     ("blocker/sub", "Not a directory; choose another --out")],
)
def test_an_out_that_cannot_be_a_record_directory_is_a_command_line_error(tiny, tmp_path, capsys, out, message):
    (tmp_path / "blocker").write_text("x")
    assert main(["run", str(tiny), "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the run record to {tmp_path / out}: {message}" in err and "Traceback" not in err


def test_a_full_disk_during_a_checkpoint_stops_the_run_cleanly(tiny, tmp_path, monkeypatch):
    import sexpgpu.backends.checkpoint as checkpoint

    real_save = checkpoint.save_file

    def save_file(tensors, path):
        if "step-4" in path:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    out = tmp_path / "run"
    with pytest.raises(SxError, match=r"cannot write the checkpoint .*step-4: No space left on device"):
        quiet_train(tiny, out=out)
    assert [s for s, _ in list_checkpoints(out)] == [2]
    assert not list((out / "checkpoints").glob(".step-*")), "no half-written checkpoint stays"
    end = read_events(out / "events.jsonl")[-1]
    assert end["type"] == "end" and end["status"] == "failed" and "No space left" in end["message"]


def test_a_full_disk_under_the_event_log_stops_the_run_with_the_first_error(tiny, tmp_path, monkeypatch):
    import sexpgpu.backends.events as events

    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("events.jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(events.os, "fsync", fsync)
    with pytest.raises(SxError, match=r"cannot write the event log .*events.jsonl: No space left on device"):
        quiet_train(tiny, out=tmp_path / "run")


def test_tensors_that_cannot_fit_are_refused_before_allocating_at_the_largest(tiny, monkeypatch):
    import sexpgpu.backends.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 100)
    with pytest.raises(SxError, match=r"the parameters with their gradients and optimizer states need 128 B \(128 "
                                      r"bytes\), more than the 100 B of memory this process may use; the largest, "
                                      r"model.w \[4\], needs 64 B of it") as err:
        quiet_train(tiny, sets={"extra": 1})
    assert err.value.loc is not None and (err.value.loc.line, err.value.loc.col) == (4, 12)


def test_an_activation_that_cannot_be_allocated_is_located_with_its_bytes(tmp_path):
    path = tmp_path / "huge.sx"
    path.write_text(HUGE_ACTIVATION)
    limit = 3 << 30

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    result = subprocess.run(
        [sys.executable, "-m", "sexpgpu.tools.main", "run", str(path), "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, preexec_fn=limit_memory,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    assert result.returncode == 1, result.stderr
    assert "huge.sx:5:" in result.stderr
    assert "error: out of memory: the [10, 20000, 20000] int32 result of graph.add needs 14.9 GiB (16000000000 " \
           "bytes)" in result.stderr
    assert "this process may use 3.0 GiB" in result.stderr and "Traceback" not in result.stderr


def test_usage_errors_are_not_reported_as_failures_of_the_run(tiny, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError):
        quiet_train(tiny, out=tmp_path / "file")


def test_a_negative_dimension_is_refused_at_its_form(tmp_path):
    path = tmp_path / "neg.sx"
    path.write_text(TINY.replace("(* (mean (cast x f32))", "(* (+ (mean (cast x f32)) (sum (cast (iota [-3] 0) f32)))"))
    with pytest.raises(SxError, match=r"'iota' would make a tensor of shape \[-3\]: a dimension cannot be negative") as err:
        quiet_train(path, out=tmp_path / "run")
    assert err.value.loc.line == 5


def test_the_summary_says_what_its_throughput_counts(tiny, tmp_path):
    stream = io.StringIO()
    train(str(tiny), out=tmp_path / "run", stream=stream, interactive=False)
    summary = stream.getvalue()
    assert "tok/s" in summary
    line = next(line for line in summary.splitlines() if line.strip().startswith("throughput"))
    assert line.endswith("tokens/s over steps 2-4 (training only: not compilation, the first step's warm-up, "
                         "evaluations or checkpoints)")


def test_a_run_over_records_counts_records(tmp_path):
    import numpy as np

    np.savez(tmp_path / "d.npz", x=np.zeros((6, 4), np.float32), y=np.arange(6) % 3)
    path = tmp_path / "records.sx"
    path.write_text("""\
(defloader data :source (npy-file "d.npz") :fields ((x [4] f32) (y [] i32)) :batch 2)
(defmodule net () (let ((w (param w [4 3] :init zeros))) (fn (x) (matmul x w))))
(defmodel model (net))
(defn objective (batch) (cross-entropy (model (get batch :x)) (get batch :y)))
(defoptimizer opt (sgd :lr 0.1))
(defrun :steps 1 :loader data :objective objective :optimizer opt)
""")
    stream = io.StringIO()
    train(str(path), out=tmp_path / "run", stream=stream, interactive=False)
    summary = stream.getvalue()
    assert " rec/s " in summary and "tok/s" not in summary
    assert "records/s over step 1 (training only: not compilation, evaluations or checkpoints)" in summary
