"""Lowering an experiment definition to the experiment module (the `exp` ops and the graphs).

`ExperimentLowering.module()` traces `prepare` + `objective` into `graph.func
@train` and each evaluation of the run into its own `graph.func`, and writes
the `exp` ops that `dialects/exp.py` documents.

Choices the spec leaves open: an optimizer group whose glob matches no
parameter is a warning (a variant may drop the parameters it names); a
diagnostic whose glob matches nothing is an error (it could never report
anything); a loader field no graph reads is a warning. Counters and
observations are recorded in the train graph only: evaluation graphs carry
their metrics. The train graph keeps every `graph.observe`; the `diagnose`
pass decides which the diagnosed graph needs and removes them from `train`.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from attrs import define, field

from ..diagnostics import DiagnosticSink, Location, SxError
from ..dialects.core import Operation, Region, SymbolRef, TensorType
from ..dialects.exp import OPTIMIZER_DEFAULTS
from ..dialects.inits import Init
from .calls import invoke
from .data import Keyword, TensorLike
from .expansions import in_expansions
from .experiment_definitions import (
    DiagnosticDef,
    EvaluationDef,
    ExperimentDefinition,
    LoaderDef,
    OptimizerSpec,
    RunDef,
    Schedule,
)
from .selection import plain_value
from .tracer import NAME_OF_DTYPE, Tensor, Trace, as_tensor, describe, tracing


@define
class ExperimentLowering:
    """Builds the module of one definition; its warnings go to the definition and to `sink`."""

    definition: ExperimentDefinition
    sink: DiagnosticSink = field(factory=DiagnosticSink)

    def warn(self, message: str, loc: Location | None) -> None:
        self.definition.warnings.append((message, loc))
        self.sink.warning(message, loc)

    def module(self, path: str) -> Operation:
        """The `builtin.module` of the experiment: exp ops, then the train and evaluation graphs.

        Tracing runs .sx code: call it inside `run_deep`, as the evaluator does. An error
        in code a macro's expansion made names the macro and its use (`in_expansions`).
        """
        try:
            return self._module(path)
        except SxError as err:
            raise in_expansions(err) from None

    def _module(self, path: str) -> Operation:
        definition = self.definition
        run = definition.run
        if run is None:
            raise SxError("the experiment has no defrun: add (defrun :steps … :loader … :objective … :optimizer …)", Location(path, 1, 1))
        definition.selection.check_command_line()
        group_ops = self._group_ops(run.optimizer)
        train = self._trace_train(run)
        if not definition.params:
            raise SxError(
                "the experiment has no parameters for the optimizer to train: register them with "
                "(param name [dims]) in a defmodule that defmodel builds",
                run.option_locs.get("optimizer") or run.loc,
            )
        evaluations = [self._trace_evaluation(run, ev) for ev in run.evaluations]
        module = Operation.create("builtin.module", regions=[Region.with_block()])
        body = module.body
        body.append(_exp_op(
            "exp.selection",
            definition.selection.loc,
            variant=definition.selection.variant,
            knobs={k: [plain_value(v), src] for k, (v, src) in definition.selection.values.items()},
        ))  # fmt: skip
        for p in definition.params.values():
            body.append(_exp_op(
                "exp.param", p.loc, path=p.path, type=TensorType(p.shape, p.dtype),
                init=p.init.as_attribute(), group=definition.groups[p.path],
            ))  # fmt: skip
        for loader in definition.loaders.values():
            body.append(_loader_op(loader))
        for op in group_ops:
            body.append(op)
        for ev in run.evaluations:
            body.append(_exp_op("exp.evaluation", ev.loc, name=ev.name, loader=ev.loader.name, every=ev.every, graph=SymbolRef(ev.name)))
        listed = {d.name for d in run.diagnostics}
        for diag in definition.diagnostics.values():
            self._check_diagnostic(diag, train)
            body.append(_exp_op(
                "exp.diagnostic", diag.loc, name=diag.name, of={"kind": diag.of.kind, "glob": diag.of.glob},
                reducer=diag.reducer, every=diag.every, enabled=diag.name in listed and diag.when,
            ))  # fmt: skip
        body.append(_exp_op(
            "exp.run", run.loc, steps=run.steps, loader=run.loader.name, microbatches=run.microbatches,
            precision=run.precision, seed=run.seed, checkpoints=run.checkpoints,
            evaluations=[e.name for e in run.evaluations], diagnostics=[d.name for d in run.diagnostics],
            # Only where written, so that the IR (and the fingerprint) of a run that leaves it stays the same.
            **({"zero_stage": run.zero_stage} if run.zero_stage is not None else {}),
        ))  # fmt: skip
        body.append(train.func)
        for trace in evaluations:
            body.append(trace.func)
        return module

    def inference(self) -> Operation:
        """`graph.func @sample {kind = "inference"}`: the model's forward for one sequence, as
        `sexpgpu sample` runs it. Call after `module`, inside `run_deep`.

        The model (the experiment's one `defmodel`) is traced as the objective calls it, with the
        batch dimension 1: its input is the batch input `tokens`, `[1, seq]` token ids of the dtype
        the objective gives it, and it must return `logits`, `[1, seq, vocab]` floats.
        """
        try:
            return self._inference()
        except SxError as err:
            raise in_expansions(err) from None

    def _inference(self) -> Operation:
        definition = self.definition
        run = definition.run
        assert run is not None, "module() checks there is a defrun"
        loc = run.option_locs.get("objective") or run.loc
        models = definition.tree.models
        if len(models) != 1:
            names = ", ".join(models) or "none"
            raise SxError(f"sample generates with the experiment's one defmodel; it has {len(models)} ({names})", loc)
        name, (_, model) = next(iter(models.items()))
        args = definition.traces["train"].module_calls.get(name)
        if args is None:
            raise SxError(f"sample traces model {name} as the objective calls it, but the objective never calls it", loc)
        if (len(args) != 1 or not isinstance(args[0], Tensor) or args[0].dtype not in ("i32", "i64")
                or len(args[0].shape) != 2):
            given = ", ".join(describe(a) for a in args) or "nothing"
            raise SxError(f"sample needs a model that takes one [batch, seq] tensor of token ids; the objective "
                          f"calls {name} with {given}", loc)
        seq, dtype = args[0].shape[1], args[0].dtype
        trace = Trace("sample", "inference", run.loc, record_counters=False, record_observations=False)
        with tracing(trace):
            for p in definition.params.values():
                p.trace_value(trace, p.loc)
            tokens = trace.input("batch", "tokens", TensorType((1, seq), dtype), loc)
            logits = invoke(model, [tokens], loc)
            shape = getattr(logits, "shape", None)
            if not isinstance(logits, TensorLike) or shape is None or len(shape) != 3 or shape[:2] != (1, seq):
                raise SxError(f"sample needs a model that returns [batch, seq, vocab] logits; for one sequence of "
                              f"{seq} tokens model {name} returns {describe(logits)}", loc)
            logits_t = as_tensor(logits, trace, loc, "model")
            if logits_t.dtype not in ("f32", "bf16", "f16"):
                raise SxError(f"sample needs float logits from model {name}, got {NAME_OF_DTYPE.get(logits_t.dtype)}", loc)
        trace.finish([("logits", logits_t)], loc)
        definition.traces["sample"] = trace
        return trace.func

    def _group_ops(self, optimizer: OptimizerSpec) -> list[Operation]:
        """Assign every parameter to the first group whose glob matches it; the rest is `default`."""
        members: dict[str, list[str]] = {g.glob: [] for g in optimizer.groups}
        members["default"] = []
        for path in self.definition.params:
            group = next((g.glob for g in optimizer.groups if fnmatch.fnmatchcase(path, g.glob)), "default")
            members[group].append(path)
            self.definition.groups[path] = group
        ops = []
        for g in [*optimizer.groups, None]:
            name = g.glob if g is not None else "default"
            if g is not None and not members[name]:
                self.warn(f"optimizer group \"{name}\" matches no parameter", g.loc)
            if g is None and not members[name] and optimizer.groups:
                continue
            hyper = {**OPTIMIZER_DEFAULTS[optimizer.kind], **optimizer.hyper, **(g.hyper if g else {})}
            hyper["lr"] = _schedule_attribute(hyper["lr"])
            ops.append(_exp_op(
                "exp.group", g.loc if g else optimizer.loc, name=name, optimizer=optimizer.kind,
                members=members[name], hyper=hyper, clip=optimizer.clip,
            ))  # fmt: skip
        return ops

    def _batch(self, trace: Trace, loader: LoaderDef) -> dict[Keyword, Tensor]:
        return {
            Keyword(f.name): trace.input("batch", f.name, TensorType((loader.batch, *f.shape), f.dtype), loader.loc)
            for f in loader.fields
        }

    def _inputs(self, trace: Trace, loader: LoaderDef) -> dict[Keyword, Tensor]:
        """Every parameter (in definition order), then the loader's fields, as graph inputs."""
        for p in self.definition.params.values():
            p.trace_value(trace, p.loc)
        return self._batch(trace, loader)

    def _prepared(self, run: RunDef, batch: dict[Keyword, Tensor]) -> Any:
        if run.prepare is None:
            return batch
        loc = run.option_locs.get("prepare") or run.loc
        prepared = invoke(run.prepare, [batch], loc)
        if not isinstance(prepared, dict):
            raise SxError(f"prepare must return a map of fields for the objective, got {describe(prepared)}", loc)
        return prepared

    def _trace_train(self, run: RunDef) -> Trace:
        trace = Trace("train", "train", run.loc)
        with tracing(trace):
            batch = self._inputs(trace, run.loader)
            loc = run.option_locs.get("objective") or run.loc
            loss = invoke(run.objective, [self._prepared(run, batch)], loc)
            if not isinstance(loss, TensorLike) or getattr(loss, "shape", None) != ():
                raise SxError(f"the objective must return a scalar loss tensor, got {describe(loss)}", loc)
            loss_t = as_tensor(loss, trace, loc, "objective")
            if loss_t.dtype not in ("f32", "bf16", "f16"):
                raise SxError(f"the objective must return a float loss, got {NAME_OF_DTYPE.get(loss_t.dtype)}", loc)
        self._warn_unused_fields(trace, run.loader)
        trace.finish([("loss", loss_t)], loc)
        self.definition.traces["train"] = trace
        return trace

    def _trace_evaluation(self, run: RunDef, ev: EvaluationDef) -> Trace:
        trace = Trace(ev.name, "evaluation", ev.loc, record_counters=False, record_observations=False)
        with tracing(trace):
            batch = self._inputs(trace, ev.loader)
            invoke(ev.fn, [self._prepared(run, batch)], ev.loc)
        if not trace.metrics:
            self.warn(f"evaluation {ev.name} emits no metric: its function should call (metric name value)", ev.loc)
        trace.finish([], ev.loc)
        self.definition.traces[ev.name] = trace
        return trace

    def _warn_unused_fields(self, trace: Trace, loader: LoaderDef) -> None:
        for f in loader.fields:
            if not trace.inputs[("batch", f.name)].value.has_uses:
                self.warn(f"field {f.name} of loader {loader.name} is not used by prepare or the objective", loader.loc)

    def _check_diagnostic(self, diag: DiagnosticDef, train: Trace) -> None:
        names = train.observed if diag.of.kind == "observed" else list(self.definition.params)
        if not any(fnmatch.fnmatchcase(n, diag.of.glob) for n in names):
            what = "observed tensor" if diag.of.kind == "observed" else "parameter"
            known = ", ".join(sorted(set(names))[:6]) or "none"
            raise SxError(f"diagnostic {diag.name}: \"{diag.of.glob}\" matches no {what} (there are: {known})", diag.loc)



def _exp_op(op_name: str, loc: Location | None, **attributes: Any) -> Operation:
    return Operation.create(op_name, attributes=attributes, loc=loc)


def _schedule_attribute(lr: Any) -> Any:
    if isinstance(lr, Schedule):
        return {"kind": lr.kind, **lr.options}
    if isinstance(lr, Init) and lr.kind == "constant":
        return {"kind": "constant", "value": lr.args["value"]}
    return float(lr)



def _loader_op(loader: LoaderDef) -> Operation:
    return _exp_op(
        "exp.loader",
        loader.loc,
        name=loader.name,
        source={"kind": loader.source.kind, **loader.source.options},
        fields=[{"name": f.name, "shape": list(f.shape), "dtype": NAME_OF_DTYPE[f.dtype]} for f in loader.fields],
        batch=loader.batch,
        shuffle=loader.shuffle,
        seed=loader.seed,
    )
