"""The `exp` dialect: what an experiment is, beside its graphs.

These ops have no operands or results; their attributes hold the experiment:
the selection, the parameter tree, loaders, optimizer groups, evaluations,
diagnostics and the run. They sit at the top of a `builtin.module`, next to
the `graph.func` ops of the graphs. Attribute values are ints, floats,
bools, strings, `none`, lists, dicts, tensor types and symbol refs.

What `evaluate` makes (later passes add what their docstrings say):

    exp.selection {variant = "smoke" | none, knobs = {lr = [0.0015, "default"], ...}}
    exp.param {path = "model.embed.table", type = tensor<256x128xf32>,
               init = {kind = "normal", std = 0.02}, group = "model.embed.*"}   one per leaf
    exp.loader {name, source = {kind = "token-file", path = ..., ...},
                fields = [{name = "tokens", shape = [65], dtype = "i32"}], batch, shuffle, seed}
    exp.group {name = "default", optimizer = "adamw" | "sgd", members = [paths],
               hyper = {lr = {kind = "warmup-cosine", peak, warmup, steps, floor}, betas, eps,
                        weight_decay, momentum, nesterov}, clip = none | float}
              build-updates adds states = {m = elements, v = elements};
              fold-constants adds constants = [sorted floats]
    exp.evaluation {name = "eval", loader = "val-loader", every = 25, graph = @eval}
    exp.diagnostic {name, of = {kind = "observed" | "grads" | "params", glob}, reducer, every,
                    enabled = true | false}
    exp.run {steps, loader, microbatches, precision, seed, checkpoints = none | N,
             evaluations = [names], diagnostics = [names], zero_stage = 0 | 1 (only where written;
             absent: 1, ZeRO-1 over data-parallel ranks)}
    graph.func @train {kind = "train"}: inputs role "param" (named by path) and
             role "batch" (named by field); returns ["loss"]; autodiff adds "grad/<path>"
    graph.func @sample {kind = "inference"}: only when `evaluate{inference=true}` asks (what
             `sexpgpu sample` compiles): the model's forward for one sequence, inputs role "param"
             and the batch input "tokens" [1, seq]; returns ["logits"] [1, seq, vocab]

The constants below (graph kinds, optimizers and their defaults, reducers,
precisions) are their one definition: the frontend, the passes and the
backends read them from here.
"""

from __future__ import annotations

from typing import Any

from .core import OpDef, Operation, VerifyError, register_op

#: The kinds (`kind` attribute) of the graphs that run the model on a microbatch: the precision
#: policy casts them and the memory plan bounds their activations.
MODEL_GRAPH_KINDS = ("train", "train_accumulating", "train_stacked", "train_diagnosed", "evaluation", "inference")
#: The kinds of the graphs that update parameters from gradients once a step: their constants fold.
OPTIMIZER_GRAPH_KINDS = ("clip", "update")
#: Every kind of `graph.func`, in the order reports list graphs; `working_copies` makes the weights' bf16
#: working copies from the parameters when the driver sets them (passes/working_copies.py).
GRAPH_KINDS = MODEL_GRAPH_KINDS + OPTIMIZER_GRAPH_KINDS + ("working_copies",)
#: The order reports list graphs in, by kind; a graph of no kind goes last.
GRAPH_ORDER = {kind: i for i, kind in enumerate(GRAPH_KINDS)}
#: How a `graph.func`'s kind reads in reports; evaluations and clip graphs read as their symbol.
KIND_TITLES = {
    "train": "train",
    "train_accumulating": "train accumulating",
    "train_stacked": "train stacked",
    "train_diagnosed": "train diagnosed",
    "working_copies": "working copies",
}

#: Each optimizer (`exp.group` `optimizer`) and the hyperparameters a group leaves out take:
#: PyTorch's defaults, so a bare (adamw :lr 1e-3) means what it means there.
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    "sgd": {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0},
}
#: The optimizers, by name.
OPTIMIZERS = tuple(OPTIMIZER_DEFAULTS)
#: How a diagnostic (`exp.diagnostic` `reducer`) reduces a tensor to one number (norm = √Σx²).
REDUCERS = ("mean", "rms", "max", "min", "norm")
#: The run's precisions (`exp.run` `precision`): f32, or bf16 compute with f32 master weights.
PRECISIONS = ("f32", "bf16")
#: How a token source's ids relate to text (a loader source's `tokenizer`): one id per byte, GPT-2's
#: BPE (through tiktoken), or ids without text.
TOKENIZERS = ("bytes", "gpt2", "none")
#: The layouts of a `token-file` (its `format`): `auto` reads llm.c's header when the file starts with
#: one, `llmc` requires it, `nanogpt` is a headerless stream.
TOKEN_FILE_FORMATS = ("auto", "llmc", "nanogpt")

#: The epsilon of global-norm clipping (`exp.group` `clip`): grads scale by min(1, clip / (norm + eps)),
#: as torch.nn.utils.clip_grad_norm_ does. The clip graphs and any backend's own clipping share it.
CLIP_EPS = 1e-6


class _ExpOp(OpDef):
    family = "exp"
    num_operands = 0
    num_results = 0
    pure = False


@register_op
class ModuleOp(OpDef):
    """The top-level container; printed as its ops, one a line."""

    name = "builtin.module"
    family = "module"
    num_operands = 0
    num_results = 0
    num_regions = 1
    pure = False


@register_op
class SelectionOp(_ExpOp):
    """`exp.selection {variant, knobs = {name = [value, source]}}`."""

    name = "exp.selection"
    required_attrs = ("variant", "knobs")


@register_op
class ParamOp(_ExpOp):
    """`exp.param {path, type, init, group}`: one leaf of the parameter tree."""

    name = "exp.param"
    required_attrs = ("path", "type", "init", "group")


@register_op
class LoaderOp(_ExpOp):
    name = "exp.loader"
    required_attrs = ("name", "source", "fields", "batch")


@register_op
class GroupOp(_ExpOp):
    """An optimizer group: its members, states (with element counts) and folded constants."""

    name = "exp.group"
    required_attrs = ("name", "optimizer", "members")


@register_op
class EvaluationOp(_ExpOp):
    name = "exp.evaluation"
    required_attrs = ("name", "loader", "every", "graph")


@register_op
class DiagnosticOp(_ExpOp):
    name = "exp.diagnostic"
    required_attrs = ("name", "of", "reducer", "every")


@register_op
class RunOp(_ExpOp):
    name = "exp.run"
    required_attrs = ("steps", "loader", "microbatches", "precision", "seed")

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        if op.attributes["precision"] not in PRECISIONS:
            raise VerifyError(f"precision must be {' or '.join(PRECISIONS)}, got {op.attributes['precision']}", op)


def graph_title(func: Operation) -> str:
    """A `graph.func`'s row name in the reports: `train accumulating`, `update <group>` (a group's update
    graphs share one row), else its symbol (an evaluation's name, a clip graph's)."""
    kind = func.attributes.get("kind", "")
    if kind == "update":
        return f"update {func.attributes.get('group', func.attributes['sym_name'])}"
    return KIND_TITLES.get(kind, func.attributes["sym_name"])
