"""File access is confined: only the files a compilation reads are opened, quoted or hashed.

A location in textual IR may name any path (`loc("/etc/passwd":1:1)`); the
tools never open it, to quote a line in a diagnostic or to hash it for a
manifest. Inputs that are not regular files are refused before a byte is read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sexpgpu.tools.opt import main as opt_main

from sexpgpu.diagnostics import display_path

SECRET = "top secret line"

IR_NAMING = """\
graph.func @f {
  %0 = graph.input {name = "x", role = "batch"} : () -> tensor<4xf32> loc("SECRET":1:1)
  %1 = graph.exp %0, %0 : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32> loc("SECRET":1:1)
  graph.return %1 {names = ["y"]} : (tensor<4xf32>) -> ()
}
"""


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text(SECRET + "\n")
    return path


def test_a_diagnostic_never_quotes_a_file_only_a_location_names(tmp_path, secret, capsys):
    ir = tmp_path / "naming.sxir"
    ir.write_text(IR_NAMING.replace("SECRET", str(secret)))
    assert opt_main([str(ir)]) == 1
    err = capsys.readouterr().err
    assert f"{secret}:1:1: error: 'graph.exp' expects 1 operands, got 2" in err
    assert SECRET not in err
    # The IR file itself was read: its note quotes its line.
    assert "naming.sxir:3:3: note:" in err and "%1 = graph.exp %0, %0" in err


def test_ir_json_hashes_only_the_files_the_compilation_read(tmp_path, secret, capsys):
    ir = tmp_path / "naming.sxir"
    ir.write_text(IR_NAMING.replace("SECRET", str(secret)).replace("%1 = graph.exp %0, %0 : (tensor<4xf32>, "
                                                                      "tensor<4xf32>)", "%1 = graph.exp %0 : (tensor<4xf32>)"))
    assert opt_main([str(ir), "-p", "ir-json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [source["path"] for source in document["manifest"]["files"]] == [display_path(str(ir))]


def test_the_run_manifest_hashes_the_sources_as_read(tmp_path):
    from sexpgpu.backends.training import TrainingPlan

    source = tmp_path / "exp.sx"
    source.write_text("""\
(defloader data :source (synthetic-tokens :vocab 16 :count 256 :seed 1) :fields ((tokens [5] i32)) :batch 2)
(defmodule net () (let ((w (param w [4] :init ones))) (fn (x) (* x (sum w)))))
(defmodel model (net))
(defn objective (batch) (mean (model (cast (get batch :tokens) f32))))
(defoptimizer opt (adamw :lr 0.01))
(defrun :steps 2 :loader data :objective objective :optimizer opt)
""")
    import hashlib

    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    experiment = TrainingPlan.compile(str(source), None, [])
    source.write_text("; edited after compiling\n")
    assert experiment.source_hashes == {display_path(str(source)): digest}


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_opt_refuses_an_input_that_is_not_a_file(tmp_path, kind, capsys):
    path = {"fifo": tmp_path / "in.sxir", "directory": tmp_path, "device": "/dev/zero"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    assert opt_main([str(path)]) == 2
    what = {"fifo": "a FIFO", "directory": "a directory", "device": "a character device"}[kind]
    assert f"error: cannot read {path}: it is {what}, not a file" in capsys.readouterr().err


def test_opt_reads_standard_input_as_bytes():
    result = subprocess.run([sys.executable, "-m", "sexpgpu.tools.opt", "-", "-p", "read"], input=b"(f)\n\xe9",
                            capture_output=True, timeout=60)
    assert result.returncode == 1
    assert "<stdin>:2:1: error: the file is not UTF-8 text: byte 0xe9" in result.stderr.decode()


@pytest.mark.parametrize(
    ("line", "message", "col"),
    [
        ('%0 = graph.input {name = "x\\q", role = "batch"} : () -> tensor<4xf32>', 'bad string "x\\\\q": invalid \\\\escape',
         28),
        ("%0 = graph.const {value = " + "9" * 5000 + "} : () -> tensor<4xf32>", "integer of 5000 digits is too long", 29),
        ('%0 = graph.input {name = "x", role = "batch"} : () -> tensor<4xf32> loc("a\\q.sx":1:1)', "bad string", 71),
        ('%0 = graph.input {name = @, role = "batch"} : () -> tensor<4xf32>', "expected a symbol name after '@'", 28),
        ("%0 = graph.const {value = ->} : () -> tensor<4xf32>", "expected an integer, found '->'", 29),
    ],
)
def test_textual_ir_strings_and_integers_are_located_errors(tmp_path, capsys, line, message, col):
    ir = tmp_path / "bad.sxir"
    ir.write_text(f"graph.func @f {{\n  {line}\n  graph.return %0 {{names = [\"y\"]}} : (tensor<4xf32>) -> ()\n}}\n")
    assert opt_main([str(ir)]) == 1
    err = capsys.readouterr().err
    assert f"bad.sxir:2:{col}: error: " in err and "Traceback" not in err
    assert __import__("re").search(message, err), err
