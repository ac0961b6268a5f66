"""The experiment forms, the traced module, and the Python API on the project's examples."""

import math
from pathlib import Path

import numpy as np
import pytest
from sexpgpu.frontend.evaluator import eval_file_lines
from sexpgpu.passes.manager import CompilationUnit, run_pipeline

import sexpgpu
from sexpgpu.diagnostics import SxError

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "gpt.sx")
CLASSIFIER = str(ROOT / "examples" / "mlp-classifier.sx")

HEADER = """
(defloader data :source (token-file "train.u16") :fields ((tokens [9] i32)) :batch 2)
(defmodule net (&key (extra false))
  (let ((embed (sub embed (embedding 16 8)))
        (more  (when extra (param extra [8] :init (constant 0.5))))
        (head  (sub head (linear 8 16))))
    (fn (tokens) (head (embed tokens)))))
(defmodel model (net :extra EXTRA))
(defn objective (batch)
  (let ((tokens (get batch :tokens)))
    (cross-entropy (model (slice tokens 1 0 8)) (slice tokens 1 1 9))))
"""


def experiment_file(tmp_path, body: str, extra: bool = False) -> str:
    path = tmp_path / "exp.sx"
    path.write_text(HEADER.replace("EXTRA", "true" if extra else "false") + body)
    return str(path)


def evaluate(path: str, variant=None, sets=()):
    unit = run_pipeline(CompilationUnit(path=path, variant=variant, sets=list(sets)), "evaluate")
    return unit.module, unit.facts.experiment


RUN = """
(defoptimizer opt (adamw :lr 0.01 :groups [(group "model.embed.*" :weight-decay 0)]))
(defrun :steps 3 :loader data :objective objective :optimizer opt)
"""


def test_smoke_gpt_parameter_count_by_hand():
    vocab, layers, width, seq = 256, 2, 128, 64
    block = (
        2 * width  # norm1 weight, bias
        + width * 3 * width + 3 * width  # attn.qkv
        + width * width + width  # attn.proj
        + 2 * width  # norm2
        + width * 4 * width + 4 * width  # mlp.fc
        + 4 * width * width + width  # mlp.proj
    )
    expected = vocab * width + seq * width + layers * block + 2 * width + width * vocab
    exp = sexpgpu.compile(GPT, variant="smoke")
    counted = sum(math.prod(shape) for shape, _, _ in exp.parameters.values())
    assert counted == expected
    assert len(exp.parameters) == 1 + 1 + 12 * layers + 2 + 1
    assert list(exp.parameters)[:3] == ["model.embed.table", "model.pos", "model.blocks.0.norm1.weight"]
    assert exp.parameters["model.embed.table"] == ((256, 128), "f32", "model.embed.*")
    assert exp.parameters["model.blocks.1.attn.qkv.weight"] == ((128, 384), "f32", "default")


def test_api_selection_and_train_graph():
    exp = sexpgpu.compile(GPT, variant="smoke", set={"lr": 0.003, "layers": 1})
    assert exp.selection["lr"] == (0.003, "set")
    assert exp.selection["width"] == (128, "variant")
    assert exp.selection["heads"] == (4, "default")
    params = exp.init_params()
    tokens = np.random.default_rng(0).integers(0, 256, (4, 65)).astype(np.int32)
    out = exp.run_graph("train", {**params, "tokens": tokens})
    # Small initial weights: the loss starts near the uniform guess, ln 256.
    assert abs(float(out["loss"]) - math.log(256)) < 0.1
    assert out["grads"].keys() == params.keys()
    assert out["counters"]["tokens"] == 4 * 65
    assert float(out["metrics"]["train/loss"]) == pytest.approx(float(out["loss"]))
    metrics = exp.run_graph("eval", {**params, "tokens": tokens})
    assert set(metrics) == {"val/loss"}


def test_init_depends_only_on_seed_and_path(tmp_path):
    body = RUN.replace(":optimizer opt", ":optimizer opt :seed SEED")
    a = sexpgpu.compile(experiment_file(tmp_path, body.replace("SEED", "1"))).init_params()
    b = sexpgpu.compile(experiment_file(tmp_path, body.replace("SEED", "1"), extra=True)).init_params()
    c = sexpgpu.compile(experiment_file(tmp_path, body.replace("SEED", "2"))).init_params()
    assert set(b) - set(a) == {"model.extra"} and np.all(b["model.extra"] == 0.5)
    for path in a:
        np.testing.assert_array_equal(a[path], b[path])
    assert not np.array_equal(a["model.embed.table"], c["model.embed.table"])
    assert np.all(a["model.head.bias"] == 0) and a["model.head.weight"].std() == pytest.approx(0.02, rel=0.2)


def test_module_contract(tmp_path):
    module, exp = evaluate(experiment_file(tmp_path, RUN))
    ops = {op.name: op for op in module.body.ops}
    assert ops["exp.run"].attributes["steps"] == 3 and ops["exp.run"].attributes["checkpoints"] is None
    groups = [op.attributes for op in module.body.ops if op.name == "exp.group"]
    assert [(g["name"], g["members"]) for g in groups] == [
        ("model.embed.*", ["model.embed.table"]),
        ("default", ["model.head.weight", "model.head.bias"]),
    ]
    assert groups[0]["hyper"]["weight_decay"] == 0.0 and groups[1]["hyper"]["weight_decay"] == 0.01
    train = ops["graph.func"]
    inputs = [(op.attributes["role"], op.attributes["name"]) for op in train.body.ops if op.name == "graph.input"]
    assert inputs == [("param", "model.embed.table"), ("param", "model.head.weight"),
                      ("param", "model.head.bias"), ("batch", "tokens")]  # fmt: skip
    assert train.body.last_op.attributes["names"] == ["loss"]
    module.verify()


def test_schedules_and_optimizer_options_are_data(tmp_path):
    body = """
(defoptimizer opt (sgd :lr (warmup-cosine 0.1 :warmup 5 :steps 100 :floor 0.1) :momentum 0.9 :nesterov true :clip 1.0))
(defrun :steps 3 :loader data :objective objective :optimizer opt :checkpoints (every 2) :precision bf16)
"""
    module, _ = evaluate(experiment_file(tmp_path, body))
    (group,) = [op.attributes for op in module.body.ops if op.name == "exp.group"]
    assert group["hyper"]["lr"] == {"kind": "warmup-cosine", "peak": 0.1, "warmup": 5, "steps": 100, "floor": 0.1}
    assert group["hyper"]["nesterov"] is True and group["clip"] == 1.0
    run = next(op.attributes for op in module.body.ops if op.name == "exp.run")
    assert (run["checkpoints"], run["precision"]) == (2, "bf16")


def test_group_matching_nothing_is_a_warning(tmp_path, capsys):
    _, exp = evaluate(experiment_file(tmp_path, RUN.replace("model.embed.*", "model.nothing.*")))
    assert exp.warnings[0][0] == 'optimizer group "model.nothing.*" matches no parameter'
    assert "warning: optimizer group" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("(defoptimizer opt (sgd :lr 0.1))\n(defrun :steps 1 :loader data :objective (fn (b) (get b :tokens)) :optimizer opt)",
         "the objective must return a scalar loss tensor, got a tensor of shape"),
        ("(defdiagnostic d :of (grads \"model.nope.*\") :reducer rms :every 5)\n" + RUN,
         'diagnostic d: "model.nope.\\*" matches no parameter'),
        ("(defoptimizer opt (sgd :lr 0.1))\n(defevaluation e :loader val :every 2 :fn objective)",
         "unbound symbol 'val'"),
        ("(defoptimizer opt (adamw :lr 0.1 :momentum 0.9))", "adamw has no option :momentum"),
        ("(defdiagnostic d :of (grads \"*\") :reducer median :every 5)", ":reducer must be one of mean, rms, max, min, norm"),
        (RUN + "(defrun :steps 1 :loader data :objective objective :optimizer opt)", "defrun appears twice"),
        ("(defoptimizer opt (sgd :lr 0.1))", "the experiment has no defrun"),
    ],
)
def test_experiment_errors(tmp_path, body, message):
    with pytest.raises(SxError, match=message):
        evaluate(experiment_file(tmp_path, body))


@pytest.mark.parametrize(
    ("sets", "message", "where"),
    [
        (["layers=2147483648"], r"sub-list blocks: 2147483648 submodules is more than a list may have \(16384\)",
         "model.sx:30"),
        (["width=1000000000"], r"shape \[1000000000 3000000000\] has 3000000000000000000 elements, more than a "
                               r"parameter may have", "model.sx:4"),
    ],
)
def test_absurd_knobs_stop_with_an_error_at_the_form(sets, message, where):
    with pytest.raises(SxError, match=message) as err:
        evaluate(GPT, sets=sets)
    assert err.value.loc.short().endswith(where)


def test_eval_prints_each_form():
    lines = eval_file_lines(GPT, variant="smoke")
    assert lines == [
        "nil", "defknobs", "smoke", "lr-scan",
        "train-loader = #<loader 1 fields, batch 4>", "val-loader = #<loader 1 fields, batch 4>",
        "prepare = #<function prepare>", "model = #<model gpt as model>", "objective = #<function objective>",
        "optimizer = #<optimizer adamw>", "evaluate = #<function evaluate>", "eval", "attn-max",
        "defrun = #<run 300 steps>",
    ]  # fmt: skip


def test_classifier_example_compiles_and_runs_a_step():
    exp = sexpgpu.compile(CLASSIFIER, variant="smoke")
    assert list(exp.parameters) == [
        "model.input.weight", "model.input.bias", "model.layers.0.weight", "model.layers.0.bias",
        "model.output.weight", "model.output.bias",
    ]  # fmt: skip
    assert exp.parameters["model.output.bias"][2] == "model.*.bias"
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((32, 8)).astype(np.float32), "label": rng.integers(0, 4, 32).astype(np.int32)}
    out = exp.run_graph("train", {**exp.init_params(), **batch})
    assert set(out["metrics"]) == {"train/loss", "train/accuracy"} and out["counters"]["records"] == 32


def test_unused_field_warning_and_diagnostic_switches(tmp_path):
    body = """
(defloader two :source (npy-file "d.npz") :fields ((tokens [9] i32) (unused [3] f32)) :batch 2)
(defknobs (watch false))
(defdiagnostic g :of (grads "model.head.*") :reducer rms :every 5 :when watch)
(defdiagnostic p :of (params "model.*") :reducer norm :every 5)
(defoptimizer opt (sgd :lr 0.1))
(defrun :steps 1 :loader two :objective objective :optimizer opt :diagnostics [g])
"""
    module, exp = evaluate(experiment_file(tmp_path, body), sets=["watch=true"])
    assert ("field unused of loader two is not used by prepare or the objective", exp.loaders["two"].loc) in exp.warnings
    enabled = {op.attributes["name"]: op.attributes["enabled"] for op in module.body.ops if op.name == "exp.diagnostic"}
    assert enabled == {"g": True, "p": False}
    module, _ = evaluate(experiment_file(tmp_path, body))
    assert [op.attributes["enabled"] for op in module.body.ops if op.name == "exp.diagnostic"] == [False, False]
