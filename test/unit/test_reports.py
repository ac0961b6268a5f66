"""The explain document, its text, diff and the streamed IR document, on experiments built by hand."""

from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from sexpgpu.dialects import exp, graph  # noqa: F401  (registers the ops)
from sexpgpu.dialects.core import Builder, Operation, Region, TensorType, Value
from sexpgpu.dialects.graph import show_shape
from sexpgpu.passes.manager import UnitFacts

import sexpgpu
from sexpgpu.byte_text import show_bytes
from sexpgpu.diagnostics import Location
from sexpgpu.report.document import LARGEST_KEPT, build_document
from sexpgpu.report.explain_text import DEVICE_HOLE, _show_constants, _tree_rows, render_text
from sexpgpu.report.text import compress_paths, human_count

SCHEMAS = Path(sexpgpu.__file__).parent / "schemas"


def _loc(line: int) -> Location:
    return Location("tiny.sx", line, 3)


def _exp(module: Operation, op_name: str, line: int, **attrs: Any) -> None:
    module.body.append(Operation.create(op_name, attributes=attrs, loc=_loc(line)))


def _func(module: Operation, name: str, kind: str, **attrs: Any) -> Builder:
    func = Operation.create("graph.func", attributes={"sym_name": name, "kind": kind, **attrs},
                            regions=[Region.with_block()], loc=_loc(1))
    module.body.append(func)
    return Builder(func.body, loc=_loc(40))


def _input(b: Builder, name: str, role: str, shape: tuple[int, ...], dtype: str = "f32") -> Value:
    return b.create("graph.input", [], {"name": name, "role": role}, result_types=[TensorType(shape, dtype)]).result


def _const(b: Builder, value: Any, dtype: str = "f32") -> Value:
    return b.create("graph.const", [], {"value": value}, result_types=[TensorType((), dtype)]).result


PARAMS = {"model.fc.weight": (4, 8), "model.fc.bias": (8,), "model.out.weight": (8, 3)}


def _forward(b: Builder, batch: int, loss_name: str, counter: bool) -> Value:
    w, bias, out = (_input(b, path, "param", shape) for path, shape in PARAMS.items())
    x = _input(b, "x", "batch", (batch, 4))
    _input(b, "y", "batch", (batch,), "i32")
    h = b.value("graph.matmul", x, w, loc=_loc(21))
    wide = b.value("graph.broadcast", bias, shape=[batch, 8], loc=_loc(22))
    act = b.value("graph.tanh", b.value("graph.add", h, wide, loc=_loc(22)), loc=_loc(23))
    logits = b.value("graph.matmul", act, out, loc=_loc(24))
    loss = b.value("graph.sum", b.value("graph.mul", logits, logits, loc=_loc(25)), axes=[0, 1], keep=False, loc=_loc(25))
    if counter:
        b.create("graph.counter", [_const(b, batch, "i32")], {"name": "records"}, loc=_loc(19))
    b.create("graph.metric", [loss], {"name": loss_name}, loc=_loc(26))
    return loss


def tiny_experiment(lr: float = 0.5, lr_source: str = "default", extra_layer: bool = False) -> Operation:
    """A three-parameter experiment with every section explain shows; counts below are by hand."""
    module = Operation.create("builtin.module", regions=[Region.with_block()])
    _exp(module, "exp.selection", 1, variant="smoke",
         knobs={"lr": [lr, lr_source], "hidden": [8, "variant"], "seed": [1, "default"]})
    params = dict(PARAMS)
    if extra_layer:
        params["model.extra.weight"] = (3, 3)
    for path, shape in params.items():
        group = "model.fc.*" if path.startswith("model.fc.") else "default"
        _exp(module, "exp.param", 10, path=path, type=TensorType(shape, "f32"),
             init={"kind": "normal", "std": 0.02}, group=group)
    _exp(module, "exp.loader", 3, name="train-loader", source={"kind": "synthetic-tokens", "vocab": 16},
         fields=[{"name": "x", "shape": [4], "dtype": "f32"}], batch=2, shuffle=True, seed=1)
    _exp(module, "exp.loader", 4, name="val-loader", source={"kind": "synthetic-tokens", "vocab": 16},
         fields=[{"name": "x", "shape": [4], "dtype": "f32"}], batch=3, shuffle=False, seed=1)
    _exp(module, "exp.group", 30, name="model.fc.*", optimizer="adamw", members=["model.fc.weight", "model.fc.bias"],
         hyper={"lr": lr}, clip=None, states={"m": 40, "v": 40}, constants=[0.0, 1e-08, 0.1, lr, 0.999])
    default_members = [p for p in params if not p.startswith("model.fc.")]
    _exp(module, "exp.group", 30, name="default", optimizer="sgd", members=default_members,
         hyper={"lr": lr}, clip=None, states={"momentum": sum(_numel(params[p]) for p in default_members)},
         constants=sorted([0.0, lr, 0.9]))
    _exp(module, "exp.evaluation", 33, name="eval", loader="val-loader", every=5, graph="eval")
    _exp(module, "exp.diagnostic", 35, name="grad-rms", of={"kind": "grads", "glob": "model.*"}, reducer="rms",
         every=2, enabled=True)
    _exp(module, "exp.diagnostic", 36, name="act-max", of={"kind": "observed", "glob": "model.act"},
         reducer="max", every=10, enabled=False)
    _exp(module, "exp.run", 38, steps=10, loader="train-loader", microbatches=3, precision="f32", seed=1,
         checkpoints=None, evaluations=["eval"], diagnostics=["grad-rms"])

    b = _func(module, "train", "train")
    loss = _forward(b, 2, "train/loss", counter=True)
    if extra_layer:
        _input(b, "model.extra.weight", "param", (3, 3))
    b.create("graph.return", [loss], {"names": ["loss"]})
    b = _func(module, "train/diagnosed", "train_diagnosed")
    loss = _forward(b, 2, "train/loss", counter=True)
    b.create("graph.return", [loss], {"names": ["loss"]})
    b = _func(module, "eval", "evaluation")
    loss = _forward(b, 3, "val/loss", counter=False)
    b.create("graph.return", [], {"names": []})
    for path, shape in params.items():
        group = "model.fc.*" if path.startswith("model.fc.") else "default"
        b = _func(module, f"update/{group}/{path}", "update", group=group, param=path)
        p = _input(b, "param", "param", shape)
        g = _input(b, "grad", "grad", shape)
        step = b.value("graph.mul", g, b.value("graph.broadcast", _const(b, lr), shape=list(shape)))
        b.create("graph.return", [b.value("graph.sub", p, step)], {"names": ["param"]})
    module.verify()
    return module


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


FACTS = UnitFacts(
    casts={"train": 0, "eval": 0},
    memory={"train": {"peak_bytes": 3 * 2**20 + 2**19, "param_bytes": 204, "grad_bytes": 204, "largest": []}},
)


def tiny_document(**kwargs: Any) -> dict[str, Any]:
    return build_document(tiny_experiment(**kwargs), copy.deepcopy(FACTS), "tiny.sx")


# -- the document -----------------------------------------------------------------------------


def test_document_counts_equal_hand_counts():
    doc = tiny_document()
    params = doc["parameters"]
    assert params["count"] == 3
    assert params["elements"] == 32 + 8 + 24
    assert params["master_bytes"] == 64 * 4
    assert [leaf["name"] for leaf in params["modules"][0]["leaves"]] == ["fc.weight", "fc.bias", "out.weight"]
    fc, default = doc["groups"]
    assert (fc["params"], fc["elements"], fc["state_elements"]) == (2, 40, 80)
    assert (default["params"], default["elements"], default["state_elements"]) == (1, 24, 24)
    assert default["constants"] == [0.0, 0.5, 0.9]
    train = doc["graphs"][0]
    assert train["name"] == "train"
    # 5 inputs, 1 const, 1 unary, 2 binary, 1 reduce, 1 shape, 2 contract, 2 emits; the return is no node.
    assert train["nodes"] == 15
    assert [(o["family"], o["count"]) for o in train["ops"]] == [
        ("input", 5), ("const", 1), ("unary", 1), ("binary", 2), ("reduce", 1), ("shape", 1), ("contract", 2), ("emit", 2),
    ]
    assert train["emits"] == [{"kind": "counter", "name": "records"}, {"kind": "metric", "name": "train/loss"}]
    assert train["largest"][0] == {"elements": 32, "shape": [4, 8], "dtype": "f32", "op": "input", "loc": "tiny.sx:40"}
    assert len(train["largest"]) == LARGEST_KEPT
    update = next(g for g in doc["graphs"] if g["name"] == "update model.fc.*")
    assert update["symbols"] == ["update/model.fc.*/model.fc.weight", "update/model.fc.*/model.fc.bias"]
    assert update["nodes"] == 2 * 6
    step = doc["step"]
    assert (step["microbatches"], step["batch"], step["records_per_step"]) == (3, 2, 6)
    assert step["counters"] == [{"name": "records", "per_step": 6, "static": True}]
    assert step["evaluations"] == [{"name": "eval", "every": 5, "loader": "val-loader", "batch": 3}]
    assert [d["enabled"] for d in doc["diagnostics"]] == [True, False]
    assert doc["diagnostics"][0]["graphs"] == ["train diagnosed"]
    assert doc["device"] is None


def test_document_validates_against_schema():
    schema = json.loads((SCHEMAS / "explain.schema.json").read_text())
    doc = tiny_document()
    jsonschema.validate(json.loads(json.dumps(doc)), schema)


def test_text_sections_in_order():
    text = render_text(tiny_document())
    heads = [line for line in text.splitlines() if line and not line.startswith(" ")]
    assert heads == [
        "tiny.sx: 3 parameters, 10 steps, precision f32  (sexpgpu-frontend 0.1.0)",
        "selection:", "parameters: 3, 64 elements, 256 B as f32 master weights",
        "graphs: 6 (an optimizer group's update graphs in one row)", "training step:",
        "diagnostics:", "precision:", DEVICE_HOLE,
    ]
    assert "  records          3 microbatches of 2 = 6 per step, 10 steps" in text
    assert "  counter records  6 per step (static)" in text
    assert "  evaluation       eval: every 5 steps, the whole loader in batches of 3" in text
    assert "  peak activation  <= 3.5 MiB for one microbatch" in text


def test_text_numbers_match_document():
    """Every number the text shows for parameters and graphs is the document's, rendered."""
    doc = tiny_document()
    text = render_text(doc)
    for g in doc["graphs"]:
        assert f"  {g['name']}  " in text
        assert f"{g['nodes']} nodes" in text
        ops = ", ".join(f"{o['family']} {o['count']}" for o in g["ops"])
        assert f"    ops      {ops}" in text
    for module in doc["parameters"]["modules"]:
        for leaf in module["leaves"]:
            row = re.search(rf"^    {re.escape(leaf['name'])} +(\[.*?\]) +(\w+) +(\S+) +(\S+)$", text, re.M)
            assert row is not None, leaf["name"]
            assert row.groups() == (show_shape(leaf["shape"]), leaf["dtype"],
                                    human_count(leaf["elements"]), leaf["group"])


def test_selection_columns_align():
    lines = render_text(tiny_document()).splitlines()
    start = lines.index("selection:")
    assert lines[start + 1 : start + 5] == [
        "  variant  smoke",
        "  lr       0.5         default",
        "  hidden   8           variant",
        "  seed     1           default",
    ]


def test_every_graph_lists_its_ten_largest_tensors():
    text = render_text(tiny_document())
    graphs = text[text.index("graphs:"):text.index("training step:")]
    evaluation = graphs[graphs.index("  eval  "):graphs.index("  update ")]
    rows = [line for line in evaluation.splitlines() if line.startswith("      ")]
    assert len(rows) == len(tiny_document()["graphs"][2]["largest"]) == 10
    assert "largest tensors: as train" in graphs  # train diagnosed's ten are train's


def test_nonfinite_constants_sort_where_they_belong():
    module = tiny_experiment()
    group = next(op for op in module.body.ops if op.name == "exp.group")
    group.attributes["constants"] = [float("nan"), 2.0, float("inf"), float("-inf"), 0.5]
    doc = build_document(module, copy.deepcopy(FACTS), "tiny.sx")
    assert doc["groups"][0]["constants"] == ["-inf", 0.5, 2.0, "inf", "nan"]
    assert "constants -inf, 0.5, 2, inf, nan" in render_text(doc)


@pytest.mark.parametrize(
    ("n", "shown"),
    [(1040, "1040"), (9999, "9999"), (10_000, "10k"), (393_216, "393k"), (786_432, "786k"), (6_438_912, "6.44M"),
     (13_300_000, "13.3M"), (999_600, "1M"), (124_000_000_000, "124G")],
)
def test_human_count(n, shown):
    assert human_count(n) == shown


def test_constants_elide_after_eight():
    assert _show_constants([float(i) for i in range(10)]) == "0, 1, 2, 3, 4, 5, 6, 7, ... (10 in all)"
    assert _show_constants([0.0, 1e-10, 0.05]) == "0, 1e-10, 0.05"


def _leaf(name: str, shape: list[int], group: str = "default") -> dict[str, Any]:
    elements = 1
    for d in shape:
        elements *= d
    return {"path": f"model.{name}", "name": name, "shape": shape, "dtype": "f32", "elements": elements, "group": group}


def test_tree_folds_alike_blocks():
    leaves = [_leaf("embed.table", [16, 4], "model.embed.*")]
    leaves += [_leaf(f"blocks.{i}.{p}", [4, 4]) for i in range(3) for p in ("fc.weight", "fc.bias")]
    leaves += [_leaf("out.weight", [4, 16])]
    rows = _tree_rows(leaves, 4)
    assert [r[0] for r in rows] == ["    embed.table", "    blocks.{0..2}", "      fc.weight", "      fc.bias", "    out.weight"]
    assert rows[1][1] == "3 × 32"
    assert rows[2][1:] == ["[4, 4]", "f32", "16", "default"]


def test_tree_keeps_blocks_apart_when_they_differ():
    # A block whose leaves land in another update group is its own subtree: nothing is folded away.
    leaves = [_leaf("blocks.0.fc.weight", [4, 4], "fast"), _leaf("blocks.1.fc.weight", [4, 4])]
    rows = _tree_rows(leaves, 4)
    assert [(r[0], r[-1]) for r in rows] == [
        ("    blocks.0", "16"), ("      fc.weight", "fast"), ("    blocks.1", "16"), ("      fc.weight", "default"),
    ]


def test_compress_paths():
    paths = [f"model.blocks.{i}.attn" for i in range(12)] + ["model.norm", "model.blocks.0.mlp", "model.blocks.2.mlp"]
    assert compress_paths(paths) == ["model.blocks.{0..11}.attn", "model.norm", "model.blocks.{0,2}.mlp"]


# -- the IR document --------------------------------------------------------------------------


def _ir_text(compact: bool = False, module: Operation | None = None) -> str:
    from sexpgpu.passes.ir_json import write_ir
    from sexpgpu.passes.manager import CompilationUnit

    unit = CompilationUnit(module=module or tiny_experiment())
    out = io.StringIO()
    write_ir(unit, out, compact)
    return out.getvalue()


@pytest.mark.parametrize("compact", [False, True])
def test_ir_document_validates_and_holds_every_op(compact):
    text = _ir_text(compact)
    assert ("\n" in text.rstrip("\n")) is not compact
    doc = json.loads(text)
    jsonschema.validate(doc, json.loads((SCHEMAS / "ir.schema.json").read_text()))
    module = tiny_experiment()
    funcs = [op for op in module.body.ops if op.name == "graph.func"]
    assert [g["name"] for g in doc["graphs"]] == [f.attributes["sym_name"] for f in funcs]
    for func, g in zip(funcs, doc["graphs"]):
        assert [o["op"] for o in g["ops"]] == [op.name for op in func.body.ops]
    train = doc["graphs"][0]["ops"]
    matmul = next(o for o in train if o["op"] == "graph.matmul")
    assert matmul["operands"] == [3, 0]
    assert matmul["results"] == [{"id": 5, "type": {"shape": [2, 8], "dtype": "f32"}}]
    assert matmul["loc"] == {"file": "tiny.sx", "line": 21, "col": 3}
    assert [p["path"] for p in doc["parameters"]] == list(PARAMS)
    assert doc["parameters"][0]["type"] == {"shape": [4, 8], "dtype": "f32"}
    assert doc["groups"][0]["update_graphs"] == ["update/model.fc.*/model.fc.weight", "update/model.fc.*/model.fc.bias"]
    assert doc["manifest"]["selection"]["knobs"]["lr"] == [0.5, "default"]


def test_ir_writes_nonfinite_floats_as_strings():
    module = tiny_experiment()
    b = Builder(next(op for op in module.body.ops if op.name == "graph.func").body)
    b.anchor = b.block.last_op
    b.create("graph.const", [], {"value": float("-inf")}, result_types=[TensorType((), "f32")])
    doc = json.loads(_ir_text(module=module))
    assert any(o["attributes"].get("value") == "-inf" for o in doc["graphs"][0]["ops"])


# -- diff -------------------------------------------------------------------------------------


def _diff(a: dict[str, Any], b: dict[str, Any], b_sets: list[str]) -> dict[str, Any]:
    from sexpgpu.tools.diff_cmd import describe, diff_documents

    sections = diff_documents(a, b)
    return {"a": describe("tiny.sx", None, []), "b": describe("tiny.sx", None, b_sets), "identical": not sections,
            "sections": sections}


def _public(diff: dict[str, Any]) -> dict[str, Any]:
    from sexpgpu.tools.diff_cmd import public

    return {**diff, "sections": public(diff["sections"])}


def test_diff_of_a_document_with_itself_is_identical():
    from sexpgpu.tools.diff_cmd import render_diff

    diff = _diff(tiny_document(), tiny_document(), [])
    assert render_diff(diff) == "a  tiny.sx\nb  tiny.sx\n\nidentical\n"


def test_diff_of_a_knob_shows_the_knob_row_and_the_constant_rows():
    from sexpgpu.tools.diff_cmd import render_diff

    diff = _diff(tiny_document(), tiny_document(lr=0.25, lr_source="set"), ["lr=0.25"])
    jsonschema.validate(_public(diff), json.loads((SCHEMAS / "diff.schema.json").read_text()))
    assert render_diff(diff) == (
        "a  tiny.sx\n"
        "b  tiny.sx --set lr=0.25\n"
        "\n"
        "knobs\n"
        "  lr  0.5 (default)  0.25 (set)\n"
        "\n"
        "optimizer groups\n"
        "  model.fc.* constants  0, 1e-08, 0.1, 0.5, 0.999  0, 1e-08, 0.1, 0.25, 0.999\n"
        "  default constants     0, 0.5, 0.9                0, 0.25, 0.9\n"
    )


def test_diff_of_one_more_layer_shows_parameter_and_node_count_rows():
    diff = _public(_diff(tiny_document(), tiny_document(extra_layer=True), []))
    sections = {s["name"]: s["rows"] for s in diff["sections"]}
    assert sections["parameters"] == [{"key": "model.extra.weight", "a": None, "b": "[3, 3] f32 default"}]
    graphs = {r["key"]: (r["a"], r["b"]) for r in sections["graphs"]}
    assert graphs["train nodes"] == ("15", "16")
    assert graphs["train input"] == ("5", "6")
    assert graphs["update default nodes"] == ("6", "12")
    groups = {r["key"]: (r["a"], r["b"]) for r in sections["optimizer groups"]}
    assert groups["default members"] == ("1 param, 24", "2 params, 33")


def test_diff_sections_over_twenty_rows_print_twenty_and_a_count():
    from sexpgpu.tools.diff_cmd import render_diff

    rows = [{"key": f"model.p{i}", "a": None, "b": "[1] f32 default"} for i in range(32)]
    text = render_diff({"a": "x.sx", "b": "y.sx", "identical": False, "sections": [{"name": "parameters", "rows": rows}]})
    lines = text.splitlines()
    assert lines[3] == "parameters"
    assert lines[4] == "  model.p0   -  [1] f32 default"
    assert lines[24] == "  … and 12 more"
    assert len(lines) == 25


def test_diff_shares_the_twenty_rows_fairly_among_graphs():
    from sexpgpu.tools.diff_cmd import render_diff

    rows = [{"key": f"{g} largest {i}", "a": "1", "b": "2", "group": g} for g, n in (("train", 30), ("eval", 5),
                                                                                   ("update default", 12)) for i in range(n)]
    text = render_diff({"a": "x.sx", "b": "y.sx", "identical": False, "sections": [{"name": "graphs", "rows": rows}]})
    lines = text.splitlines()[4:]
    assert sum(1 for line in lines if " largest " in line) == 20
    assert "  … and 22 more train rows" in lines and "  … and 5 more update default rows" in lines
    assert not any("more eval" in line for line in lines)
    assert lines.index("  … and 22 more train rows") == 8  # train's 8 rows, then its count, then eval's


def test_diff_leaves_out_train_variant_rows_that_repeat_trains():
    from sexpgpu.tools.diff_cmd import diff_documents

    def with_variant(doc: dict[str, Any], nodes: int) -> dict[str, Any]:
        variant = copy.deepcopy(doc["graphs"][0]) | {"name": "train accumulating", "kind": "train_accumulating",
                                                       "nodes": nodes}
        doc["graphs"].insert(1, variant)
        return doc

    a = with_variant(tiny_document(), 100)
    b = with_variant(tiny_document(extra_layer=True), 120)
    keys = [r["key"] for s in diff_documents(a, b) if s["name"] == "graphs" for r in s["rows"]]
    assert "train input" in keys and "train accumulating input" not in keys
    assert "train accumulating nodes" in keys  # 100 -> 120 is not train's 15 -> 16


def test_diff_condenses_a_long_changed_value_to_what_changed():
    from sexpgpu.tools.diff_cmd import condense

    peak = "<= {} MiB for one microbatch, an upper bound: nothing reused in place; parameters {} MiB and gradients {} MiB besides"
    assert condense(peak.format(106.5, 12.7, 12.7), peak.format(20.9, 2.6, 2.6)) == (
        "<= 106.5 MiB … parameters 12.7 MiB and gradients 12.7 MiB besides",
        "<= 20.9 MiB … parameters 2.6 MiB and gradients 2.6 MiB besides",
    )
    assert condense("a b c d e f g", "a b c d e f h") == ("… f g", "… f h")
    assert condense("x a b c d", "y a b c d") == ("x a …", "y a …")


# -- the examples, compiled -------------------------------------------------------------------


def test_gpt_example_text_and_json_agree_with_independent_counts():
    from sexpgpu.passes.manager import CompilationUnit, run_pipeline
    from sexpgpu.passes.pipelines import TRAINING_PIPELINE

    path = Path(__file__).resolve().parents[2] / "examples" / "gpt.sx"
    unit = run_pipeline(CompilationUnit(path=str(path), variant="smoke"), TRAINING_PIPELINE)
    doc = build_document(unit.module, unit.facts, unit.path)
    jsonschema.validate(json.loads(json.dumps(doc)), json.loads((SCHEMAS / "explain.schema.json").read_text()))
    params = [op for op in unit.module.body.ops if op.name == "exp.param"]
    assert doc["parameters"]["count"] == len(params) == 29
    assert doc["parameters"]["elements"] == sum(op.attributes["type"].numel for op in params) == 470528
    train = next(op for op in unit.module.body.ops if op.name == "graph.func" and op.attributes["kind"] == "train")
    train_doc = doc["graphs"][0]
    assert train_doc["nodes"] == len(train.body) - 1 == sum(o["count"] for o in train_doc["ops"])
    assert doc["step"]["counters"] == [{"name": "tokens", "per_step": 4 * 65 * 4, "static": True}]
    text = render_text(doc)
    assert f"parameters: 29, {human_count(470528)} elements, {show_bytes(470528 * 4)}" in text
    assert f"  train  {train_doc['nodes']} nodes, 0 casts added by the f32 policy" in text
    assert "  counter tokens   1040 per step (static)" in text
