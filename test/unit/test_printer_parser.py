"""The textual IR: printing, parsing, errors, and print→parse→print being byte-identical
for every IR file of the lit suite and for what the suite's pipelines print."""

import math
import re
from pathlib import Path

import pytest
from sexpgpu.dialects.core import Operation, SymbolRef, TensorType
from sexpgpu.dialects.parser import parse_module
from sexpgpu.dialects.printer import print_attribute, print_module
from sexpgpu.passes.manager import CompilationUnit, run_pipeline

from sexpgpu.diagnostics import Location, SxError

LIT = Path(__file__).resolve().parent.parent / "lit"
IR_FILES = sorted(LIT.rglob("*.sxir"))
_SPLIT = re.compile(r"^// -----\s*$", re.M)
_PIPELINE = re.compile(r"sexpgpu-opt [^|]*?-p '?([\w,{}=.-]+)'?")


def roundtrip(text: str) -> str:
    printed = print_module(parse_module(text, "<rt>", verify=False))
    assert print_module(parse_module(printed, "<rt2>", verify=False)) == printed
    return printed


def chunks_of(path: Path):
    """Each chunk of an IR file that parses (error tests hold chunks that must not)."""
    text = path.read_text()
    for chunk in _SPLIT.split(text) if "--split-input-file" in text else [text]:
        try:
            yield chunk, parse_module(chunk, str(path), verify=False)
        except SxError:
            assert "expected-error" in chunk or "not sexpgpu-opt" in text, f"{path} does not parse"


@pytest.mark.parametrize("path", IR_FILES, ids=lambda p: str(p.relative_to(LIT)))
def test_every_lit_ir_file_roundtrips(path):
    for _, module in chunks_of(path):
        printed = print_module(module)
        assert print_module(parse_module(printed, "<printed>", verify=False)) == printed


@pytest.mark.parametrize("path", IR_FILES, ids=lambda p: str(p.relative_to(LIT)))
def test_what_the_suite_prints_roundtrips(path):
    """Run each pipeline the file's RUN lines name and round-trip the printed result."""
    text = path.read_text()
    pipelines = set(_PIPELINE.findall(text))
    for chunk, module in chunks_of(path):
        for pipeline in pipelines:
            unit = CompilationUnit(path=str(path), text=chunk, module=module)
            try:
                module.verify()
                run_pipeline(unit, pipeline)
            except SxError:
                continue  # an error test: nothing printed
            roundtrip(unit.printable())
            module = parse_module(chunk, str(path), verify=False)


@pytest.mark.parametrize(
    "value, text",
    [
        (0.0015, "0.0015"),
        (1e-10, "1e-10"),
        (1.0, "1.0"),
        (1e20, "1e+20"),
        (-2, "-2"),
        (True, "true"),
        (None, "none"),
        (float("inf"), "inf"),
        (float("-inf"), "-inf"),
        ('a "b"\n', '"a \\"b\\"\\n"'),
        ([1, [2.5]], "[1, [2.5]]"),
        ({"lr": 1, "odd key": "x", "true": 0}, '{lr = 1, "odd key" = "x", "true" = 0}'),
        (TensorType((4, 8), "bf16"), "tensor<4x8xbf16>"),
        (TensorType((), "f32"), "tensor<f32>"),
        (SymbolRef("update/default/model.x"), '@"update/default/model.x"'),
        (SymbolRef("train"), "@train"),
    ],
)
def test_attribute_printing_and_reading_back(value, text):
    assert print_attribute(value) == text
    module = parse_module(f"exp.selection {{knobs = {{}}, variant = {text}}}", "<a>")
    read = next(module.body.ops).attributes["variant"]
    assert read == value and type(read) is type(value)


def test_nan_reads_back_as_nan():
    module = parse_module("exp.selection {knobs = {}, variant = nan}", "<a>")
    assert math.isnan(next(module.body.ops).attributes["variant"])


def test_locations_and_text_locations():
    module = parse_module(
        'graph.func @f {\n  %0 = graph.input {name = "x", role = "batch"} : () -> tensor<f32> '
        'loc("a.sx":3:4 via "p.sx":1:2)\n  graph.return %0 {names = ["x"]} : (tensor<f32>) -> ()\n}\n',
        "t.sxir",
    )
    func = next(module.body.ops)
    first = func.body.first_op
    assert first.loc == Location("a.sx", 3, 4, via=Location("p.sx", 1, 2))
    assert first.text_loc == Location("t.sxir", 2, 3)
    assert func.body.last_op.loc is None


@pytest.mark.parametrize(
    "text, message, where",
    [
        ("graph.nope", "unknown op 'graph.nope'", (1, 1)),
        ("exp.run {steps = }", "expected an attribute value, found '}'", (1, 18)),
        ('graph.func @f {\n  graph.return %9 {names = ["a"]} : (tensor<f32>) -> ()\n}', "use of undefined value %9", (2, 16)),
        ("graph.func @f {\n", "region is not closed", (1, 1)),
        ("exp.run {steps = 1} $", "expected end of line after the op, found '$'", (1, 21)),
    ],
)
def test_parse_errors_are_located(text, message, where):
    with pytest.raises(SxError, match=re.escape(message)) as err:
        parse_module(text, "bad.sxir")
    assert (err.value.loc.file, err.value.loc.line, err.value.loc.col) == ("bad.sxir", *where)


def test_empty_module_prints_nothing():
    assert print_module(parse_module("// only a comment\n", "e.sxir")) == ""


def test_name_hints_are_made_unique():
    module = parse_module(
        'graph.func @f {\n  %a = graph.input {name = "x", role = "batch"} : () -> tensor<f32>\n'
        '  graph.return %a {names = ["x"]} : (tensor<f32>) -> ()\n}\n',
        "n.sxir",
    )
    func = next(module.body.ops)
    b = Operation.create("graph.neg", [func.body.first_op.result], [TensorType((), "f32")])
    b.results[0].name_hint = "a"
    func.body.insert_before(b, func.body.last_op)
    c = Operation.create("graph.neg", [b.result], [TensorType((), "f32")])
    c.results[0].name_hint = "model.w/grad"
    func.body.insert_before(c, func.body.last_op)
    printed = print_module(module)
    assert "%a_1 = graph.neg %a" in printed and "%v_model.w_grad = graph.neg %a_1" in printed
    assert roundtrip(printed) == printed
