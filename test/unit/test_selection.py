"""Knobs, variants and --set: values by the default's type, sources, and errors that name the knob."""

import pytest
from sexpgpu.frontend.data import Symbol
from sexpgpu.frontend.evaluator import Evaluator
from sexpgpu.frontend.selection import Knob, Selection, Variant, parse_set_value

from sexpgpu.diagnostics import SxError, UsageError

FILE = """
(defknobs
  (lr 0.5 "learning rate")
  (layers 4)
  (name "run")
  (shuffle true)
  (precision f32))
(defvariant small :layers 2 :lr 1)
(def doubled (* 2 layers))
"""


def evaluate(tmp_path, variant=None, sets=()):
    path = tmp_path / "knobs.sx"
    path.write_text(FILE)
    evaluator = Evaluator(variant=variant, sets=list(sets))
    evaluator.eval_file(str(path))
    return evaluator


def test_defaults_then_variant_then_set(tmp_path):
    ev = evaluate(tmp_path)
    assert ev.experiment.selection.values["layers"] == (4, "default")
    assert ev.globals["doubled"] == 8
    ev = evaluate(tmp_path, "small", ["layers=3"])
    values = ev.experiment.selection.values
    assert values["layers"] == (3, "set")
    assert values["lr"] == (1.0, "variant") and isinstance(values["lr"][0], float)
    assert values["name"] == ("run", "default")
    assert ev.globals["doubled"] == 6


def test_set_parses_by_the_defaults_type():
    assert parse_set_value(Knob("lr", 0.5, None, None), "1e-3") == 0.001
    assert parse_set_value(Knob("n", 4, None, None), "1_000") == 1000
    assert parse_set_value(Knob("b", True, None, None), "false") is False
    assert parse_set_value(Knob("s", "x", None, None), "hello") == "hello"
    assert parse_set_value(Knob("p", Symbol("f32"), None, None), "bf16") == Symbol("bf16")
    for knob, text in [(Knob("n", 4, None, None), "4.5"), (Knob("b", True, None, None), "yes"),
                       (Knob("p", Symbol("f32"), None, None), "f64")]:  # fmt: skip
        with pytest.raises(SxError, match=f"knob '{knob.name}' takes"):
            parse_set_value(knob, text)


def test_unknown_knob_is_a_command_line_error_suggesting_the_nearest(tmp_path):
    with pytest.raises(UsageError, match="unknown knob 'layer'; did you mean 'layers'"):
        evaluate(tmp_path, sets=["layer=2"])


def test_unknown_variant_is_a_command_line_error_listing_the_known_ones(tmp_path):
    with pytest.raises(UsageError, match=r"unknown variant 'tiny' \(variants: small\)"):
        evaluate(tmp_path, "tiny")


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e999"])
def test_a_float_knob_set_from_the_command_line_is_finite(text):
    with pytest.raises(SxError, match=f"--set lr={text}: knob 'lr' takes a finite float"):
        parse_set_value(Knob("lr", 0.5, None, None), text)


def test_variant_values_are_checked_against_the_knobs():
    selection = Selection()
    selection.select([Knob("layers", 4, None, None)], None)
    with pytest.raises(SxError, match="knob 'layers' takes an int"):
        selection.check_variant(Variant("v", {"layers": "two"}, None))
    with pytest.raises(SxError, match="unknown knob 'layer'"):
        selection.check_variant(Variant("v", {"layer": 2}, None))


def test_selection_flags_without_knobs_are_command_line_errors():
    selection = Selection(variant="smoke")
    with pytest.raises(UsageError, match="unknown variant 'smoke'"):
        selection.check_command_line()
