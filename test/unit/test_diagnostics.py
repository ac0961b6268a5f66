"""The diagnostics a compilation collects on its unit, and the one "did you mean"."""

import pytest
from sexpgpu.dialects.parser import parse_module
from sexpgpu.passes.manager import CompilationUnit, run_pipeline

from sexpgpu.diagnostics import Diagnostic, DiagnosticSink, Location, SxError, nearest

UNTERMINATED = 'graph.func @located loc("model.sx":3:1) {\n}\n'

EXPERIMENT = """
(defloader data :source (synthetic-tokens :vocab 16 :count 64 :seed 1) :fields ((tokens [5] i32)) :batch 2)
(defmodule net () (let ((w (param w [4] :init ones))) (fn (x) (* x (sum w)))))
(defmodel model (net))
(defn objective (batch) (mean (model (cast (get batch :tokens) f32))))
(defoptimizer opt (adamw :lr 0.1 :groups [(group "model.nothing.*" :lr 0.2)]))
(defrun :steps 2 :loader data :objective objective :optimizer opt)
"""


def test_the_error_that_stops_a_pipeline_is_recorded_with_its_notes():
    unit = CompilationUnit(path="t.sxir", module=parse_module(UNTERMINATED, "t.sxir", verify=False))
    with pytest.raises(SxError):
        run_pipeline(unit, "verify")
    (error, note) = unit.diagnostics.diagnostics
    assert (error.severity, error.loc.file, error.loc.line) == ("error", "model.sx", 3)
    assert "must end with 'graph.return'" in error.message
    assert (note.severity, note.loc.file, note.loc.line) == ("note", "t.sxir", 1)


@pytest.mark.parametrize("echo", [True, False])
def test_a_pass_warning_is_recorded_and_printed_unless_echo_is_off(tmp_path, capsys, echo):
    path = tmp_path / "exp.sx"
    path.write_text(EXPERIMENT)
    unit = CompilationUnit(path=str(path))
    unit.diagnostics.echo = echo
    run_pipeline(unit, "evaluate")
    message = 'optimizer group "model.nothing.*" matches no parameter'
    assert unit.diagnostics.diagnostics == [Diagnostic("warning", message, Location(str(path), 6, 43))]
    assert unit.facts.experiment.warnings == [(message, Location(str(path), 6, 43))]
    assert (f"warning: {message}" in capsys.readouterr().err) == echo


def test_a_sink_records_each_error_an_error_gathers():
    class Several(SxError):
        def __init__(self, errors):
            super().__init__(errors[0].message, errors[0].loc)
            self.errors = errors

    sink = DiagnosticSink()
    with pytest.raises(Several), sink.raising():
        raise Several([SxError("first", Location("a", 1, 1)), SxError("second", Location("a", 2, 1))])
    assert [d.message for d in sink.diagnostics] == ["first", "second"]


@pytest.mark.parametrize(
    ("name", "candidates", "suggested"),
    [
        ("lenght", ["len", "let", "list"], "len"),  # a transposition in a short name, by similarity
        ("mpa", ["map", "max"], "map"),  # a swap of two letters is one edit
        ("x", ["exp", "y"], None),  # a name of up to 3 characters: one edit at most
        ("c", ["-"], None),  # no character in common
        ("dcee", ["dce", "cse"], "dce"),
        ("widht", ["width", "heads"], "width"),
        ("tiny", ["small"], None),
    ],
)
def test_nearest(name, candidates, suggested):
    assert nearest(name, candidates) == suggested
    assert nearest(name, reversed(candidates)) == suggested
