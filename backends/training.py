"""The training driver behind `sexpgpu run` and `sexpgpu.train`.

It runs on an executor (backends/executor.py), the `cpu` one (the numpy
interpreter) unless told otherwise, and knows nothing else of the device:
every graph it runs is made by the compiler, the experiment's and those the
run pipeline derives for it (`passes.pipelines.run_graphs`: the bf16
working copies' maker, flat group updates and clipping, the stacking
variants), and is
compiled by the executor; arrays move only through the executor's array
operations.

One step of a run:

1. `microbatches` batches from the run's loader: the first through `train`
   (or `train_diagnosed` on a diagnostic step), the rest through
   `train_accumulating`, which adds into the gradients so far — or, where the
   executor stacks k of them (`Executor.stacking` picks k among the stacking
   variants), k at a time through `train_stacked/<k>` and then
   `train_stacked_accumulating/<k>`;
2. the clip graphs, if any, then one update graph per parameter (param, grad,
   states, step → new param and states); the first of them to read a
   gradient multiplies the summed gradients by 1/microbatches
   (`build-updates`), so the step's gradient is that of the mean loss;
3. metrics averaged and counters summed over the microbatches, a `step`
   event; evaluations whose cadence divides the step (and the last step) run
   over their whole loader; diagnostics whose cadence divides the step reduce
   their tensors; checkpoints at their cadence and at the end.

Every graph is called before any result of the step is read: each batch is
written into the same executor arrays (`Executor.write`), every gradient into
the same output arrays, and the step's losses and metrics are read once at
its end, so a device runs the step while the host prepares the next batch.

Everything is fixed by the run seed: the initial parameters, the loaders'
draws (keyed by position) and the graphs. Two runs, or a run and its resumed
continuation, give bit-identical losses.

On several data-parallel ranks (`world`, docs/distributed.md) each rank runs
its share of the step's microbatches and backends/ranks.py sums the
gradients, metrics and evaluations over the ranks; rank 0 writes the record.

Stopping: Ctrl-C finishes the current step, writes a checkpoint and an `end`
event `interrupted` (a second Ctrl-C stops at once); a non-finite loss or
metric ends the run `diverged`, naming the step and the metric; any other
error ends it `failed` and is re-raised.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import re
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from attrs import frozen

from ..diagnostics import SxError, UsageError, display_path, source_digest
from ..dialects.core import Operation
from ..dialects.graph import is_derived
from ..dialects.inits import initial_params
from ..passes.flat_updates import flat_layout, flat_update_graphs
from ..passes.manager import CompilationUnit, run_pipeline
from ..passes.pipelines import TRAINING_PIPELINE, run_graphs
from ..passes.variants import stack_variants
from ..passes.working_copies import MAKER, PREFIX, ROLE, UPDATE_OUTPUT
from ..version import __version__
from . import ranks
from .checkpoint import (
    TensorSpec,
    read_checkpoint,
    remove_incomplete,
    resolve_checkpoint,
    write_checkpoint,
)
from .devices import open_device
from .distributed import Communicator, SingleProcess
from .events import finite_or_none
from .executor import DeviceArray, Executable, Executor, LoweringText, OutOfDeviceMemory
from .loaders import Loader, vocabulary_bounds
from .memory import check_training_tensors_fit, ran_out
from .progress import ProgressReporter, Throughput, format_metrics, format_seconds

_LOCATION = re.compile(r' loc\([^)]*\)')


@frozen
class RunResult:
    """How a run ended: its status, last step, record directory and final numbers."""

    status: str
    step: int
    out_dir: Path
    message: str | None
    train_loss: float | None
    evaluations: dict[str, dict[str, float | None]]
    tokens_per_s: float


def _symbol(value: Any) -> str:
    return str(getattr(value, "name", value))


class _Interrupt:
    """Turns the first Ctrl-C into a flag checked between steps; the second stops at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class TrainingPlan:
    """What the driver trains: the module of an experiment after the training pipeline and the run's
    graphs (`passes.pipelines.run_graphs`), read once (the run's settings, parameters, loaders,
    evaluations, diagnostics and graphs)."""

    def __init__(self, module: Operation, path: str, fingerprint: str | None = None) -> None:
        self.path = path
        self._fingerprint = fingerprint
        ops = list(module.body.ops)
        self.module = module
        self.run_op = self._one(ops, "exp.run")
        self.selection = self._one(ops, "exp.selection").attributes
        self.param_ops = [op for op in ops if op.name == "exp.param"]
        self.loader_ops = {str(op.attributes["name"]): op for op in ops if op.name == "exp.loader"}
        attrs = self.run_op.attributes
        # Only what the defrun lists runs; a diagnostic can also be switched off by its `:when`.
        evaluations = set(attrs.get("evaluations") or [])
        diagnostics = set(attrs.get("diagnostics") or [])
        self.evaluation_ops = [op for op in ops if op.name == "exp.evaluation" and op.attributes["name"] in evaluations]
        self.diagnostic_ops = [op for op in ops if op.name == "exp.diagnostic" and op.attributes["name"] in diagnostics
                               and op.attributes.get("enabled", True) is not False]
        self.graphs = {_symbol(op.attributes["sym_name"]): op for op in ops if op.name == "graph.func"}
        self.steps = int(attrs["steps"])
        self.microbatches = int(attrs["microbatches"])
        self.precision = str(attrs["precision"])
        self.seed = int(attrs["seed"])
        cadence = attrs.get("checkpoints")
        self.checkpoint_every = int(cadence) if isinstance(cadence, int) and cadence > 0 else None
        self.train_loader_name = str(attrs["loader"])

    @classmethod
    def compile(cls, path: str, variant: str | None = None,
                sets: dict[str, Any] | list[str] | None = None, stacking: bool = False) -> TrainingPlan:
        """The plan of the experiment file at `path` under a selection (the run pipeline's module; with
        `stacking`, for an executor that stacks microbatches, the stacking variants too)."""
        unit = run_pipeline(CompilationUnit(path=path, variant=variant, sets=set_flags(sets)), TRAINING_PIPELINE)
        # The experiment's fingerprint, before the run's graphs rewrite it (`working-copies`) for the driver.
        fingerprint = experiment_fingerprint(unit.module)
        return cls(run_pipeline(unit, run_graphs(stacking)).module, path, fingerprint)

    @staticmethod
    def _one(ops: list[Any], name: str) -> Any:
        found = [op for op in ops if op.name == name]
        if not found:
            raise SxError(f"the experiment has no {name} (is there a defrun?)")
        return found[0]

    def graph(self, name: str) -> Any:
        if name not in self.graphs:
            raise SxError(f"the experiment has no graph @{name} (graphs: {', '.join(sorted(self.graphs))})",
                          self.run_op.loc)
        return self.graphs[name]

    def graphs_of_kind(self, kind: str) -> list[Any]:
        """The experiment's graphs of `kind` (not those the run pipeline derived from them)."""
        return [op for op in self.graphs.values() if op.attributes.get("kind") == kind and not is_derived(op)]

    @property
    def parameter_count(self) -> int:
        return sum(op.attributes["type"].numel for op in self.param_ops)

    @functools.cached_property
    def fingerprint(self) -> str:
        """The experiment's fingerprint (`experiment_fingerprint`): of the training pipeline's module where
        the plan was compiled from it, else of the plan's module."""
        return self._fingerprint if self._fingerprint is not None else experiment_fingerprint(self.module)

    @functools.cached_property
    def source_hashes(self) -> dict[str, str]:
        """SHA-256 of every source file an op of the experiment came from, as the compilation read it.

        Only files the compilation read are hashed: a file a location names is never opened.
        """
        files = {op.loc.file for op in self.module.walk() if op.loc is not None and not op.loc.file.startswith("<")}
        hashes = {}
        for file in sorted(files):
            digest = source_digest(file)
            if digest is not None:
                hashes[display_path(file)] = digest
        return hashes

    def knobs(self) -> dict[str, list[Any]]:
        return {str(k): list(v) for k, v in dict(self.selection["knobs"]).items()}


class DeviceSetup:
    """What a run prepares on its executor before the first step, without loaders, data or a record:
    every graph compiled, the parameters (at their initial values), gradients and optimizer states
    allocated, the stacking degree chosen. `explain --device cuda` shows an opened device's lowering
    report after this (the executor's `lowering_document`); `Trainer` goes on to train."""

    def __init__(self, plan: TrainingPlan, executor: Executor, world: Communicator | None = None) -> None:
        self.plan = plan
        #: Where the graphs run and the parameters, gradients and states live.
        self.executor = executor
        #: The data-parallel ranks this process is one of (backends/ranks.py).
        self.world = world if world is not None else SingleProcess()
        #: How many of a step's microbatches this rank runs.
        self.local_microbatches = ranks.local_microbatches(plan.microbatches, self.world.size, plan.run_op.loc)
        check_training_tensors_fit(list(plan.module.body.ops))
        self._compile_graphs()
        self._allocate()
        self._compile_gradient_graphs()
        self._choose_stacking()
        #: ZeRO-1 over the flat groups it can shard (None: every rank updates everything), and the sum
        #: over the ranks of the gradients it does not reduce itself.
        self.sharded, self.reduce_gradients = ranks.plan_reduction(self)

    # -- setup ---------------------------------------------------------------------------------

    def _compile_graphs(self) -> None:
        plan = self.plan
        compile_func = self.executor.compile
        self.train = compile_func(plan.graph("train"))
        self.train_accumulating = compile_func(plan.graph("train_accumulating")) if self.local_microbatches > 1 else None
        self.train_diagnosed = compile_func(plan.graph("train_diagnosed")) if plan.diagnostic_ops else None
        # A diagnosed graph that adds into previous gradients reduces the whole step's: it runs last.
        accumulates = self.train_diagnosed is not None and any(
            spec.role == "grad" for spec in self.train_diagnosed.inputs)
        #: Whether the diagnosed graph reduces the step's summed gradient (backends/ranks.py).
        self.diagnosis_accumulates = accumulates
        self.diagnosed_microbatch = self.local_microbatches - 1 if accumulates else 0
        self.evaluations = [
            (op, compile_func(plan.graph(_symbol(op.attributes["graph"])))) for op in plan.evaluation_ops
        ]
        flat_funcs = flat_update_graphs(plan.module)
        flat = {str(member["path"]) for func in flat_funcs for member in func.attributes["members"]}
        #: param path → (its update graph, None for a member of a flat group; state name → shape)
        self.updates: dict[str, tuple[Executable | None, dict[str, tuple[int, ...]]]] = {}
        for func in plan.graphs_of_kind("update"):
            path = str(func.attributes["param"])
            states = {str(op.attributes["name"]): tuple(op.result.type.shape) for op in func.body.ops
                      if op.name == "graph.input" and op.attributes.get("role") == "state"}
            self.updates[path] = (compile_func(func) if path not in flat else None, states)
        missing = [op.attributes["path"] for op in plan.param_ops if op.attributes["path"] not in self.updates]
        if missing:
            raise SxError(f"no update graph for parameter {missing[0]}", plan.run_op.loc)
        #: Groups updated as one: (the group's update graph over flat [N] arrays, its member paths).
        self.flat_groups: list[tuple[Executable, list[str]]] = [
            (compile_func(func), [str(member["path"]) for member in func.attributes["members"]])
            for func in flat_funcs]
        #: Makes the weights' bf16 working copies from the parameters (`working-copies`; None: no copies).
        self.copy_maker = compile_func(plan.graphs[MAKER]) if MAKER in plan.graphs else None

    def _allocate(self) -> None:
        """The parameters (at their initial values), their gradients and states, on the executor.

        The parameters of the flat groups live in one float32 array, their
        gradients in another (the train graphs write them there), and each
        state of a group in one per group; `self.params` and `self.states`
        hold views into them in the members' shapes, so everything else
        (graph inputs, checkpoints, resume) sees one array per parameter and
        state.
        """
        ex = self.executor
        shapes = {str(op.attributes["path"]): tuple(op.attributes["type"].shape) for op in self.plan.param_ops}
        #: param path → its (start, end) in the flat arrays
        self.flat_bounds: dict[str, tuple[int, int]] = flat_layout(self.plan.module)
        end = max((stop for _, stop in self.flat_bounds.values()), default=0)
        self.flat_params = ex.zeros((end,), "f32")
        self.flat_grads = ex.zeros((end,), "f32")
        self.params: dict[str, DeviceArray] = {}
        self.flat_grad_views: dict[str, DeviceArray] = {}
        for path, value in initial_params(self.plan.param_ops, self.plan.seed).items():
            if path in self.flat_bounds:
                start = self.flat_bounds[path][0]
                self.params[path] = ex.view(self.flat_params, start, shapes[path])
                ex.copy(ex.upload(value), self.params[path])
                self.flat_grad_views[f"grad/{path}"] = ex.view(self.flat_grads, start, shapes[path])
            else:
                self.params[path] = ex.upload(value)
        self._allocate_working_copies(end, shapes)
        #: The arrays every train graph writes its gradients into (views of the flat array, or one each).
        self.grad_out: dict[str, DeviceArray] = dict(self.flat_grad_views)
        for path in shapes:
            if path not in self.flat_bounds:
                self.grad_out[f"grad/{path}"] = ex.zeros(shapes[path], "f32")
        #: (input name, shape, dtype) → the array each batch field is written into.
        self.batch_arrays: dict[tuple[str, tuple[int, ...], str], DeviceArray] = {}
        #: The step number update graphs read, written before each step's updates.
        self.step_input = ex.scalar("f32")
        #: param path → (its group's flat state arrays, the group's start in the flat arrays)
        flat_states: dict[str, tuple[dict[str, DeviceArray], int]] = {}
        #: per flat group: (its update graph, its inputs but the step, its outputs: the same arrays)
        self.flat_updates: list[tuple[Executable, dict[str, DeviceArray], dict[str, DeviceArray]]] = []
        for graph, paths in self.flat_groups:
            start, stop = self.flat_bounds[paths[0]][0], self.flat_bounds[paths[-1]][1]
            states = {state: ex.zeros((stop - start,), "f32") for state in self.updates[paths[0]][1]}
            flat_states.update(dict.fromkeys(paths, (states, start)))
            param = ex.view(self.flat_params, start, (stop - start,))
            grad = ex.view(self.flat_grads, start, (stop - start,))
            written = {"param": param, **states}
            if UPDATE_OUTPUT in graph.output_names:
                written[UPDATE_OUTPUT] = ex.view(self.flat_copies, start, (stop - start,))
            self.flat_updates.append((graph, {"param": param, "grad": grad, **states}, written))
        self.states: dict[str, DeviceArray] = {}
        for path, (_, state_shapes) in self.updates.items():
            for state, shape in state_shapes.items():
                if path in flat_states:
                    arrays, start = flat_states[path]
                    self.states[f"{path}/{state}"] = ex.view(arrays[state], self.flat_bounds[path][0] - start, shape)
                else:
                    self.states[f"{path}/{state}"] = ex.zeros(shape, "f32")

    def _allocate_working_copies(self, flat_size: int, shapes: dict[str, tuple[int, ...]]) -> None:
        """The bf16 working copy of each parameter the copy maker makes: views of one bf16 array laid out
        as the flat parameters for the flat groups' members, an array each else; made from the parameters."""
        ex = self.executor
        #: param path → its bf16 working copy, written by its update and read by the model graphs.
        self.copies: dict[str, DeviceArray] = {}
        #: The flat groups' copies, laid out as `flat_params`.
        self.flat_copies = ex.zeros((flat_size,), "bf16") if self.copy_maker is not None else None
        for name in self.copy_maker.output_names if self.copy_maker is not None else []:
            path = name.removeprefix(PREFIX)
            bounds = self.flat_bounds.get(path)
            self.copies[path] = (ex.view(self.flat_copies, bounds[0], shapes[path]) if bounds
                                 else ex.zeros(shapes[path], "bf16"))
        self.make_working_copies()

    def make_working_copies(self) -> None:
        """Each working copy made anew from its parameter (at the start and when the parameters are loaded:
        the copies are derived state, not in checkpoints)."""
        if self.copy_maker is not None:
            self.copy_maker({path: self.params[path] for path in self.copies},
                            {PREFIX + path: copy for path, copy in self.copies.items()})

    def _compile_gradient_graphs(self) -> None:
        """The clip graphs (a clip's flat twin over its span of the flat gradient array where
        `flatten-updates` made one)."""
        plan = self.plan
        flat_clips = {str(func.attributes["sym_name"]).removesuffix("/flat"): func
                      for func in plan.graphs.values() if is_derived(func) and func.attributes.get("kind") == "clip"}
        #: per clip: (its graph, the span of the flat gradient array it clips, or None: the gradients)
        self.clips: list[tuple[Executable, DeviceArray | None]] = []
        for func in plan.graphs_of_kind("clip"):
            flat = flat_clips.get(str(func.attributes["sym_name"]))
            if flat is not None:
                start, stop = flat.attributes["span"]
                span = self.executor.view(self.flat_grads, start, (stop - start,))
                self.clips.append((self.executor.compile(flat), span))
            else:
                self.clips.append((self.executor.compile(func), None))
        #: The parameters outside the flat array (updated one by one).
        self.lone_params = [path for path in self.updates if path not in self.flat_bounds]

    def _choose_stacking(self) -> None:
        """How many microbatches one call runs (the executor's choice; 1 on the CPU), and the stacked
        graphs when more than one."""
        self.stack = 1
        self.train_stacked: Executable | None = None
        self.train_stacked_accumulating: Executable | None = None
        if self.local_microbatches == 1:
            return
        # The degrees that divide each rank's microbatches (the compiler made one per divisor of the step's).
        variants = {k: graphs for k, graphs in stack_variants(self.plan.module).items()
                    if self.local_microbatches % k == 0}
        self.stack = self.executor.stacking(self.local_microbatches, variants)
        if self.stack > 1:
            stacked, *accumulating = variants[self.stack]
            self.train_stacked = self.executor.compile(stacked)
            if self.stack < self.local_microbatches:
                self.train_stacked_accumulating = self.executor.compile(accumulating[0])



class Trainer(DeviceSetup):
    """Runs one training plan's loop on an executor and records it."""

    def __init__(self, plan: TrainingPlan, out_dir: Path, resume: Path | None,
                 reporter_stream: Any = None, interactive: bool | None = None,
                 executor: Executor | None = None, lowering_text: LoweringText | None = None,
                 world: Communicator | None = None) -> None:
        self.plan = plan
        self.out_dir = out_dir
        self.loaders = {name: Loader.from_op(op) for name, op in plan.loader_ops.items()}
        if plan.train_loader_name not in self.loaders:
            raise SxError(f"defrun names loader {plan.train_loader_name}, which is not defined", plan.run_op.loc)
        self.train_loader = self.loaders[plan.train_loader_name]
        self._check_vocabularies()
        super().__init__(plan, executor if executor is not None else open_device("cpu", "run"), world)
        self.start_step = 0
        self.resumed_from: Path | None = None
        if resume is not None:
            self._resume(resume)
        #: The checkpoint the run would resume from now: the last written, else the one it resumed from.
        self.last_checkpoint = self.resumed_from
        self.reporter_stream = reporter_stream
        self.interactive = interactive
        #: Renders the executor's lowering facts for the run to print and record (the top layer's renderer).
        self.lowering_text = lowering_text

    def _check_vocabularies(self) -> None:
        bounds: dict[str, dict[str, int]] = {}

        def merge(loader: str, graph: Any) -> None:
            for field, bound in vocabulary_bounds(graph).items():
                current = bounds.setdefault(loader, {})
                current[field] = min(bound, current.get(field, bound))

        merge(self.plan.train_loader_name, self.plan.graph("train"))
        for op in self.plan.evaluation_ops:
            merge(str(op.attributes["loader"]), self.plan.graph(_symbol(op.attributes["graph"])))
        for name, loader_bounds in bounds.items():
            if name in self.loaders:
                self.loaders[name].check_vocabulary(loader_bounds)

    def _resume(self, resume: Path) -> None:
        checkpoint = read_checkpoint(resolve_checkpoint(resume))
        manifest = checkpoint.manifest
        if manifest.get("fingerprint") != self.plan.fingerprint:
            raise SxError(self._difference(manifest, checkpoint.path))
        checkpoint.check_matches(*self.tensor_specs())
        ex = self.executor
        for path, value in self.params.items():
            ex.copy(ex.upload(checkpoint.params[path]), value)
        self.make_working_copies()
        for name, value in self.states.items():
            ex.copy(ex.upload(checkpoint.states[name]), value)
        if self.sharded is not None:
            self.sharded.load_states(checkpoint.states)
        for name, state in manifest.get("loaders", {}).items():
            if name in self.loaders:
                self.loaders[name].restore(state)
        self.start_step = checkpoint.step
        self.resumed_from = checkpoint.path

    def _difference(self, manifest: dict[str, Any], path: Path) -> str:
        """Why a checkpoint belongs to another experiment, as precisely as the manifest tells."""
        head = f"cannot resume from {path}: it was written by a different experiment"
        theirs = manifest.get("selection", {})
        ours = {"variant": self.plan.selection.get("variant"), "knobs": self.plan.knobs()}
        reasons = []
        if theirs.get("variant") != ours["variant"]:
            reasons.append(f"variant {theirs.get('variant')} there, {ours['variant']} here")
        their_knobs = theirs.get("knobs", {})
        for knob in sorted(set(their_knobs) | set(ours["knobs"])):
            a = their_knobs.get(knob, [None])[0]
            b = ours["knobs"].get(knob, [None])[0]
            if a != b:
                reasons.append(f"knob {knob} = {a} there, {b} here")
        shapes = {k: tuple(v) for k, v in manifest.get("parameters", {}).items()}
        here = {op.attributes["path"]: tuple(op.attributes["type"].shape) for op in self.plan.param_ops}
        for name in sorted(set(shapes) | set(here)):
            if shapes.get(name) != here.get(name):
                reasons.append(f"parameter {name} is {list(shapes[name]) if name in shapes else 'absent'} there, "
                               f"{list(here[name]) if name in here else 'absent'} here")
        if not reasons:
            sources = manifest.get("sources", {})
            changed = [f for f, h in self.plan.source_hashes.items() if sources.get(f) not in (None, h)]
            reasons.append(f"source changed: {', '.join(changed)}" if changed else "the graphs differ")
        return f"{head}: " + "; ".join(reasons)

    # -- one step ------------------------------------------------------------------------------

    def _inputs(self, graph: Executable, batch: dict[str, np.ndarray],
                grads: dict[str, DeviceArray] | None = None) -> dict[str, DeviceArray]:
        """A graph's inputs: the parameters, the batch's fields (written into the executor's arrays
        for them, the same every call) and, given, the gradients."""
        inputs: dict[str, DeviceArray] = {}
        for spec in graph.inputs:
            if spec.role == "param":
                inputs[spec.name] = self.params[spec.name]
            elif spec.role == ROLE:
                inputs[spec.name] = self.copies[spec.name.removeprefix(PREFIX)]
            elif spec.role == "batch":
                key = (spec.name, tuple(spec.type.shape), spec.type.dtype)
                if key not in self.batch_arrays:
                    self.batch_arrays[key] = self.executor.zeros(spec.type.shape, spec.type.dtype)
                self.executor.write(self.batch_arrays[key], batch[spec.name])
                inputs[spec.name] = self.batch_arrays[key]
            elif spec.role == "grad" and grads is not None:
                # `train_accumulating` names its gradient inputs like the outputs they continue.
                inputs[spec.name] = grads[spec.name]
        return inputs

    def _microbatch_graph(self, index: int, diagnosed: bool) -> Executable:
        if diagnosed and self.train_diagnosed is not None and index == self.diagnosed_microbatch:
            return self.train_diagnosed
        if index > 0:
            assert self.train_accumulating is not None
            return self.train_accumulating
        return self.train

    def _calls(self, diagnosed: bool) -> list[tuple[Executable, int]]:
        """The graph calls of one step, each with how many microbatches it takes. A diagnostic step
        runs one microbatch a call (the diagnosed graph is one microbatch's)."""
        if self.stack > 1 and not (diagnosed and self.train_diagnosed is not None):
            assert self.train_stacked is not None
            count = self.local_microbatches // self.stack
            return [(self.train_stacked if index == 0 else self.train_stacked_accumulating, self.stack)
                    for index in range(count)]
        return [(self._microbatch_graph(index, diagnosed), 1) for index in range(self.local_microbatches)]

    def _next_batches(self, count: int) -> dict[str, np.ndarray]:
        """The loader's next batch, or its next `count` stacked along a new first axis."""
        if count == 1:
            return self.train_loader.next_batch()
        batches = [self.train_loader.next_batch() for _ in range(count)]
        return {name: np.stack([batch[name] for batch in batches]) for name in batches[0]}

    def train_step(self, step: int) -> tuple[float, dict[str, float], dict[str, int | float], dict[str, np.ndarray]]:
        """Optimizer step `step` (counted from 1, as `run` counts: AdamW's bias correction 1 - beta^step is
        0 at step 0, which would make every parameter NaN); returns the loss, metrics, counters and the
        observations."""
        if step < 1:
            raise ValueError(f"training steps count from 1, not {step}")
        ex = self.executor
        diagnosed = any(step % int(op.attributes["every"]) == 0 for op in self.plan.diagnostic_ops)
        calls: list[tuple[Any, int]] = []
        planned = self._calls(ranks.diagnoses_here(self, diagnosed))
        # Where the diagnosed graph must see the gradient of every rank, it runs after their sum.
        held = planned.pop() if ranks.sums_whole(self, diagnosed) and ranks.diagnoses_here(self, diagnosed) else None
        with ranks.dealt(self.train_loader, self.world, self.local_microbatches):
            for index, (graph, count) in enumerate(planned):
                # Every gradient goes into the same arrays; after the first call they are also its inputs.
                grads = self.grad_out if index > 0 else None
                result = graph(self._inputs(graph, self._next_batches(count), grads), self.grad_out)
                calls.append((result, count))
            # The summed gradients of every rank's microbatches, on every rank (or its shard: ZeRO-1).
            shared_observations = ranks.reduce_step(self, diagnosed, held, calls)
        for clip, span in self.clips:
            clipping = {"grad": span} if span is not None else {spec.name: self.grad_out[spec.name]
                                                                for spec in clip.inputs}
            # In place: the clipped gradients are written over the gradients.
            clip(clipping, clipping)
        ex.write(self.step_input, np.asarray(step, dtype=np.float32))
        for update, arrays, written in self.flat_updates:
            # In place: the new parameters and states are written over the old.
            update({**arrays, "step": self.step_input}, written)
        if self.sharded is not None:
            self.sharded.update(self.step_input)
        for path in self.lone_params:
            update, states = self.updates[path]
            assert update is not None
            inputs = {"param": self.params[path], "grad": self.grad_out[f"grad/{path}"], "step": self.step_input}
            inputs.update({state: self.states[f"{path}/{state}"] for state in states})
            written = {name: inputs[name] for name in ("param", *states)}
            if path in self.copies:
                written[UPDATE_OUTPUT] = self.copies[path]
            # In place: the parameter, state and copy buffers live for the whole run.
            update(inputs, written)
        # The step's values, read once every call is made (a device runs them meanwhile).
        loss_sum = 0.0
        metric_sums: dict[str, float] = {}
        counter_sums: dict[str, int | float] = {}
        observed: dict[str, np.ndarray] = {}
        for result, count in calls:
            loss_sum += count * float(ex.download(result.outputs["loss"]))
            for name, value in result.metrics.items():
                metric_sums[name] = metric_sums.get(name, 0.0) + count * float(value)
            for name, value in result.counters.items():
                counter_sums[name] = counter_sums.get(name, 0) + np.sum(value).item()
            observed.update(result.observed)
        if shared_observations is not None:
            observed = shared_observations
        total = self.plan.microbatches
        loss_sum = ranks.sum_over_ranks(self.world, {"": loss_sum})[""]
        metric_sums = ranks.sum_over_ranks(self.world, metric_sums)
        counter_sums = ranks.sum_over_ranks(self.world, counter_sums)
        metrics = {name: value / total for name, value in metric_sums.items()}
        return loss_sum / total, metrics, counter_sums, observed

    def evaluate(self, op: Any, graph: Executable) -> tuple[dict[str, float], int]:
        loader = self.loaders[str(op.attributes["loader"])]
        sums: dict[str, float] = {}
        batches = 0
        for batch in ranks.evaluation_share(loader.whole(), self.world):
            for name, value in graph(self._inputs(graph, batch)).metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            batches += 1
        # Each rank evaluated its share of the batches: the sums and counts of them all.
        batches = int(ranks.sum_over_ranks(self.world, {"": float(batches)})[""])
        sums = ranks.sum_over_ranks(self.world, sums)
        return {name: total / batches for name, total in sums.items()}, batches

    @staticmethod
    def diagnose(op: Any, observed: dict[str, np.ndarray]) -> dict[str, float]:
        """A diagnostic's values: the scalars `train_diagnosed` observed as `<diagnostic>:<tensor>`."""
        prefix = f"{op.attributes['name']}:"
        return {name.removeprefix(prefix): float(value) for name, value in observed.items() if name.startswith(prefix)}

    # -- the run -------------------------------------------------------------------------------

    def tokens_per_step(self) -> int:
        record = self.train_loader.fields[0].shape
        return self.plan.microbatches * self.train_loader.batch * int(np.prod(record, dtype=np.int64))

    def counted(self) -> tuple[str, int]:
        """What the progress and the summary count, and how many a step processes: tokens of a token
        source, else records."""
        if self.train_loader.tokens is not None:
            return "tokens", self.tokens_per_step()
        return "records", self.plan.microbatches * self.train_loader.batch

    def tensor_specs(self) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
        """The shape and dtype of each parameter and optimizer state a checkpoint holds (float32 masters)."""
        f32 = np.dtype(np.float32)
        params = {str(op.attributes["path"]): (tuple(op.attributes["type"].shape), f32) for op in self.plan.param_ops}
        states = {f"{path}/{state}": (tuple(shape), f32)
                  for path, (_, shapes) in self.updates.items() for state, shape in shapes.items()}
        return params, states

    def manifest(self, step: int) -> dict[str, Any]:
        return {
            "selection": {"variant": self.plan.selection.get("variant"), "knobs": self.plan.knobs()},
            "loaders": {name: loader.state() for name, loader in self.loaders.items()},
            "rng": {"seed": self.plan.seed, "loader_draws": "keyed by (loader seed, position)"},
            "sources": self.plan.source_hashes,
            "fingerprint": self.plan.fingerprint,
            "parameters": {op.attributes["path"]: list(op.attributes["type"].shape) for op in self.plan.param_ops},
            "sexpgpu_version": __version__,
        }

    def checkpoint(self, events: Any, reporter: ProgressReporter, step: int) -> None:
        started = time.perf_counter()
        download = self.executor.download
        states = {name: download(value) for name, value in self.states.items()}
        if self.sharded is not None:
            # Every rank sends its shards; rank 0 writes the whole states (any rank count resumes them).
            gathered = self.sharded.gathered_states()
            states.update(gathered or {})
        if not self.world.is_root:
            return
        path = write_checkpoint(self.out_dir, step, {name: download(value) for name, value in self.params.items()},
                                states, self.manifest(step))
        self.last_checkpoint = path
        events.write("checkpoint", step=step, path=str(path), seconds=time.perf_counter() - started)
        reporter.say(f"checkpoint {display_path(str(path))}")

    def run(self) -> RunResult:
        plan = self.plan
        events = ranks.event_log(self.world, self.out_dir / "events.jsonl")
        if self.world.is_root:
            remove_incomplete(self.out_dir)
        record = ranks.RankRecord(self.world)
        events.write(
            "start",
            file=display_path(plan.path),
            selection={"variant": plan.selection.get("variant"), "knobs": plan.knobs()},
            manifest={
                "steps": plan.steps, "start_step": self.start_step, "microbatches": plan.microbatches,
                "batch": self.train_loader.batch, "precision": plan.precision, "seed": plan.seed,
                "device": self.executor.device, "tokens_per_step": self.tokens_per_step(), "sources": plan.source_hashes,
                "fingerprint": plan.fingerprint, "version": __version__,
                "resumed_from": str(self.resumed_from) if self.resumed_from else None,
                **ranks.manifest_fields(self),
            },
            parameters=plan.parameter_count,
        )
        lowering = self.executor.lowering_facts()
        report = self.lowering_text(lowering) if lowering is not None and self.lowering_text is not None else None
        if report is not None and self.world.is_root:
            # Before the first step, on standard error (what the device made of the graphs), and in the log.
            print(report, file=sys.stderr, flush=True)
            events.write("lowering", text=report)
        unit, per_step = self.counted()
        reporter = ProgressReporter(plan.steps, self.start_step, ranks.progress_stream(self.world, self.reporter_stream),
                                    self.interactive,
                                    unit="tok" if unit == "tokens" else "rec")
        throughput = Throughput(unit)
        run_started = time.perf_counter()
        step = self.start_step
        status, message = "done", None
        train_loss: float | None = None
        last_evals: dict[str, dict[str, float | None]] = {}
        try:
            with _Interrupt() as interrupt:
                while step < plan.steps:
                    if ranks.any_rank(self.world, interrupt.requested):
                        status, message = "interrupted", f"interrupted after step {step}"
                        break
                    record.say(f"in step {step + 1}")
                    started = time.perf_counter()
                    loss, metrics, counters, observed = self.train_step(step + 1)
                    step += 1
                    seconds = time.perf_counter() - started
                    throughput.add(step, per_step, self.tokens_per_step(), seconds)
                    rate = self.tokens_per_step() / seconds if seconds > 0 else 0.0
                    events.write("step", step=step, loss=loss, metrics=metrics, counters=counters,
                                 seconds=seconds, tokens_per_s=rate)
                    bad = next((name for name, v in {"loss": loss, **metrics}.items() if not math.isfinite(v)), None)
                    if bad is not None:
                        value = loss if bad == "loss" else metrics[bad]
                        status, message = "diverged", f"step {step}: {bad} is {value}"
                        break
                    train_loss = loss
                    elapsed = time.perf_counter() - run_started
                    reporter.step(step, loss, per_step / seconds if seconds > 0 else 0.0,
                                  elapsed / (step - self.start_step) * (plan.steps - step))
                    for op in plan.diagnostic_ops:
                        if step % int(op.attributes["every"]) == 0:
                            events.write("diagnostic", step=step, name=str(op.attributes["name"]),
                                         reducer=str(op.attributes["reducer"]), values=self.diagnose(op, observed))
                    for op, graph in self.evaluations:
                        if step % int(op.attributes["every"]) == 0 or step == plan.steps:
                            eval_started = time.perf_counter()
                            results, batches = self.evaluate(op, graph)
                            name = str(op.attributes["name"])
                            last_evals[name] = {k: finite_or_none(v) for k, v in results.items()}
                            events.write("eval", step=step, name=name, metrics=results, batches=batches,
                                         seconds=time.perf_counter() - eval_started)
                            reporter.say(f"step {step} {name}: {format_metrics(last_evals[name])}")
                    if plan.checkpoint_every and (step % plan.checkpoint_every == 0 or step == plan.steps):
                        record.say(f"writing the checkpoint of step {step}")
                        self.checkpoint(events, reporter, step)
                if status == "interrupted":
                    self.checkpoint(events, reporter, step)
        except BaseException as err:
            reporter.close()
            if isinstance(err, OutOfDeviceMemory) and self.last_checkpoint is not None:
                # Nothing of the failed step was written: the run resumes from its last checkpoint.
                err.message += f"; the last checkpoint, {display_path(str(self.last_checkpoint))}, is intact"
            failure = err.message if isinstance(err, SxError) else f"{type(err).__name__}: {err}"
            with contextlib.suppress(SxError):  # the log may be what failed (a full disk): the first error is the one to report
                events.write("end", status="interrupted" if isinstance(err, KeyboardInterrupt) else "failed",
                             step=step, seconds=time.perf_counter() - run_started, message=failure)
            events.close()
            raise
        seconds = time.perf_counter() - run_started
        mean_rate = throughput.tokens_per_second()
        events.write("end", status=status, step=step, seconds=seconds, message=message, train_loss=train_loss,
                     eval=last_evals, tokens_per_s=mean_rate)
        events.close()
        result = RunResult(status, step, self.out_dir, message, train_loss, last_evals, mean_rate)
        reporter.summary(self.summary_lines(result, seconds, throughput))
        return result

    def summary_lines(self, result: RunResult, seconds: float, throughput: Throughput) -> list[tuple[str, Any]]:
        lines: list[tuple[str, Any]] = [
            ("status", f"{result.status} at step {result.step}/{self.plan.steps} in {format_seconds(seconds)}"
                       + (f" ({result.message})" if result.message and result.status != "done" else "")),
        ]
        if result.train_loss is not None:
            lines.append(("train loss", f"{result.train_loss:.4f}"))
        for name, metrics in result.evaluations.items():
            lines.append((name, format_metrics(metrics)))
        entropy = unigram_entropy(self.train_loader)
        if entropy is not None:
            lines.append(("unigram entropy", f"{entropy:.4f} nats (of the training tokens; a model that "
                                             "learns nothing but frequencies reaches this)"))
        lines.append(("throughput", throughput.describe()))
        lines.append(("record", f"{display_path(str(self.out_dir))}/events.jsonl"))
        lines.append(("plot", f"sexpgpu plot {display_path(str(self.out_dir))}"))
        return lines


def experiment_fingerprint(module: Operation) -> str:
    """SHA-256 of the experiment's IR after the training pipeline, without locations, the selection line or
    derived graphs.

    Equal iff the same computation: a comment, a moved file or a knob set
    to its default value changes nothing that runs. The graphs the run
    pipeline derives or rewrites for the driver follow from these (the
    stacking variants from the device, the working copies' reads and writes
    from the precision), so a checkpoint resumes on any device and `sample`
    (which compiles no run graphs) recognises it.
    """
    from ..dialects.printer import print_op

    text = "\n".join(print_op(op) for op in module.body.ops if not (op.name == "graph.func" and is_derived(op)))
    lines = [line for line in text.splitlines() if not line.startswith("exp.selection ")]
    return hashlib.sha256(_LOCATION.sub("", "\n".join(lines)).encode()).hexdigest()


def unigram_entropy(loader: Loader, limit: int = 1 << 24) -> float | None:
    """Entropy in nats of the token frequencies of a token source (its first `limit` tokens)."""
    if loader.tokens is None:
        return None
    counts = np.bincount(np.asarray(loader.tokens[:limit], dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def default_out_dir(path: str) -> Path:
    return Path("runs") / f"{Path(path).stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def refuse_existing_record(out_dir: Path) -> None:
    """A new run never writes into a run record: an error naming `--resume` where one is there."""
    if (out_dir / "events.jsonl").exists():
        raise SxError(f"{display_path(str(out_dir))} already holds a run record; continue it with "
                      f"--resume {display_path(str(out_dir))}, or choose another --out")


def set_flags(sets: dict[str, Any] | list[str] | None) -> list[str]:
    """`--set` flags from the Python API's `{knob: value}` (or flags as they are)."""
    if sets is None:
        return []
    if isinstance(sets, list):
        return list(sets)
    flags = []
    for name, value in sets.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        flags.append(f"{name}={text}")
    return flags


def train(path: str, variant: str | None = None, sets: dict[str, Any] | list[str] | None = None,
          out: str | Path | None = None,
          resume: str | Path | None = None, device: str = "cpu", stream: Any = None,
          interactive: bool | None = None, lowering_text: LoweringText | None = None,
          world: Communicator | None = None, threads: int | None = None) -> RunResult:
    """Train an experiment file; what `sexpgpu run` and `sexpgpu.train` do: as one of the data-parallel
    ranks of `world` where given (docs/distributed.md). `lowering_text` renders what the executor lowered,
    for the run to print before its first step and record (`sexpgpu.train` passes the report's renderer);
    without it the run prints and records no lowering report. `threads` sets the `cpu-c` device's threads
    (OpenMP and BLAS; by default `$OMP_NUM_THREADS`, else every core)."""
    if threads is not None and device != "cpu-c":
        raise UsageError(f"--threads sets the threads of --device cpu-c, not of --device {device}")
    world = world if world is not None else SingleProcess()
    executor = open_device(device, "run", **({"threads": threads} if threads is not None else {}))
    plan = TrainingPlan.compile(path, variant, sets, stacking=executor.stacks_microbatches)
    resume_path = Path(resume) if resume is not None else None
    if out is not None:
        out_dir = Path(out)
    elif resume_path is not None:
        checkpoint = resolve_checkpoint(resume_path)
        out_dir = checkpoint.parent.parent
    else:
        out_dir = default_out_dir(path)
    # Rank 0's (a default names the time, which the ranks may read a second apart).
    out_dir = world.broadcast(out_dir)
    if world.is_root and resume_path is None:
        refuse_existing_record(out_dir)
    try:
        return Trainer(plan, out_dir, resume_path, stream, interactive, executor, lowering_text, world).run()
    except MemoryError as err:
        raise ran_out(err, plan.run_op.loc) from None
