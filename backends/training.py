"""The training driver behind `sexpgpu run --device cpu` and `sexpgpu.train`.

One step of a run, on the numpy interpreter:

1. `microbatches` batches from the run's loader: the first through `train`
   (or `train_diagnosed` on a diagnostic step), the rest through
   `train_accumulating`, which adds into the gradients so far; the summed
   gradients are then divided by the number of microbatches, so the step's
   gradient is that of the mean loss;
2. the clip graphs, if any, then one update graph per parameter (param, grad,
   states, step → new param and states);
3. metrics averaged and counters summed over the microbatches, a `step`
   event; evaluations whose cadence divides the step (and the last step) run
   over their whole loader; diagnostics whose cadence divides the step reduce
   their tensors; checkpoints at their cadence and at the end.

Everything is fixed by the run seed: the initial parameters, the loaders'
draws (keyed by position) and the graphs. Two runs, or a run and its resumed
continuation, give bit-identical losses.

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
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from attrs import frozen

from ..devices import require_available
from ..diagnostics import SxError, display_path, source_digest
from ..dialects.exp import CLIP_EPS
from ..version import __version__
from .checkpoint import (
    read_checkpoint,
    remove_incomplete,
    resolve_checkpoint,
    write_checkpoint,
)
from .events import EventLog, finite_or_none
from .flat_updates import flat_clip, flat_update_graph
from .interpreter import CompiledGraph, compile_graph
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


class Experiment:
    """The experiment compiled through the training pipeline, as the driver needs it: ops and graphs."""

    def __init__(self, path: str, variant: str | None, sets: list[str]) -> None:
        from ..api import Experiment as CompiledExperiment

        self.path = path
        self.compiled = CompiledExperiment(path, variant, sets)
        module = self.compiled.module
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
        return [op for op in self.graphs.values() if op.attributes.get("kind") == kind]

    @property
    def parameter_count(self) -> int:
        return sum(op.attributes["type"].numel for op in self.param_ops)

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the experiment's IR without locations or the selection line.

        Equal iff the same computation: a comment, a moved file or a knob set
        to its default value changes nothing that runs.
        """
        from ..dialects.printer import print_module

        lines = [line for line in print_module(self.module).splitlines() if not line.startswith("exp.selection ")]
        return hashlib.sha256(_LOCATION.sub("", "\n".join(lines)).encode()).hexdigest()

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


class Trainer:
    """Runs one experiment's training loop and records it."""

    def __init__(self, experiment: Experiment, out_dir: Path, resume: Path | None,
                 reporter_stream: Any = None, interactive: bool | None = None) -> None:
        self.exp = experiment
        self.out_dir = out_dir
        check_training_tensors_fit(list(experiment.module.body.ops))
        self.loaders = {name: Loader.from_op(op) for name, op in experiment.loader_ops.items()}
        if experiment.train_loader_name not in self.loaders:
            raise SxError(f"defrun names loader {experiment.train_loader_name}, which is not defined",
                          experiment.run_op.loc)
        self.train_loader = self.loaders[experiment.train_loader_name]
        self._compile_graphs()
        self._check_vocabularies()
        self.params = {path: np.array(v, dtype=np.float32, order="C")
                       for path, v in experiment.compiled.init_params().items()}
        self.states = {f"{path}/{state}": np.zeros(shape, np.float32)
                       for path, (_, states) in self.updates.items() for state, shape in states.items()}
        self._lay_out_flat_groups()
        self.start_step = 0
        self.resumed_from: Path | None = None
        if resume is not None:
            self._resume(resume)
        self.reporter_stream = reporter_stream
        self.interactive = interactive

    # -- setup ---------------------------------------------------------------------------------

    def _compile_graphs(self) -> None:
        exp = self.exp
        self.train = compile_graph(exp.graph("train"))
        self.train_accumulating = compile_graph(exp.graph("train_accumulating")) if exp.microbatches > 1 else None
        self.train_diagnosed = compile_graph(exp.graph("train_diagnosed")) if exp.diagnostic_ops else None
        self.evaluations = [
            (op, compile_graph(exp.graph(_symbol(op.attributes["graph"])))) for op in exp.evaluation_ops
        ]
        #: param path → (its update graph, state name → shape)
        self.updates: dict[str, tuple[CompiledGraph, dict[str, tuple[int, ...]]]] = {}
        for func in exp.graphs_of_kind("update"):
            compiled = compile_graph(func)
            states = {spec.name: spec.type.shape for spec in compiled.inputs if spec.role == "state"}
            self.updates[str(func.attributes["param"])] = (compiled, states)
        missing = [op.attributes["path"] for op in exp.param_ops if op.attributes["path"] not in self.updates]
        if missing:
            raise SxError(f"no update graph for parameter {missing[0]}", exp.run_op.loc)
        self.clips = [compile_graph(func) for func in exp.graphs_of_kind("clip")]
        self.clip_norms = [float(func.attributes["max_norm"]) for func in exp.graphs_of_kind("clip")]
        #: Groups updated as one: (the group's update graph over flat [N] arrays, its member paths).
        self.flat_groups: list[tuple[CompiledGraph, list[str]]] = []
        members: dict[str, list[Any]] = {}
        for func in exp.graphs_of_kind("update"):
            members.setdefault(str(func.attributes.get("group")), []).append(func)
        sizes = {op.attributes["path"]: op.attributes["type"].numel for op in exp.param_ops}
        for funcs in members.values():
            paths = [str(func.attributes["param"]) for func in funcs]
            flat = flat_update_graph(funcs, sum(sizes[path] for path in paths)) if len(funcs) > 1 else None
            if flat is not None:
                self.flat_groups.append((compile_graph(flat), paths))

    def _lay_out_flat_groups(self) -> None:
        """The parameters, gradients and states of each flat group as views into flat arrays.

        One float32 array of every parameter of the flat groups, one alike for
        their gradients (the train graph's are copied in), and per group one
        per state; `self.params` and `self.states` hold views into them, in the
        members' shapes, so everything else (graph inputs, checkpoints, resume)
        sees the same arrays as before.
        """
        #: param path → its (start, end) in the flat arrays
        self.flat_bounds: dict[str, tuple[int, int]] = {}
        end = 0
        for _, paths in self.flat_groups:
            for path in paths:
                self.flat_bounds[path] = (end, end + self.params[path].size)
                end += self.params[path].size
        self.flat_params = np.zeros(end, np.float32)
        self.flat_grads = np.zeros(end, np.float32)
        self.flat_grad_views: dict[str, np.ndarray] = {}
        for path, (a, b) in self.flat_bounds.items():
            shape = self.params[path].shape
            view = self.flat_params[a:b].reshape(shape)
            np.copyto(view, self.params[path])
            self.params[path] = view
            self.flat_grad_views[f"grad/{path}"] = self.flat_grads[a:b].reshape(shape)
        #: per flat group: (its update graph, its span, state name → flat array)
        self.flat_updates: list[tuple[CompiledGraph, slice, dict[str, np.ndarray]]] = []
        for graph, paths in self.flat_groups:
            start, stop = self.flat_bounds[paths[0]][0], self.flat_bounds[paths[-1]][1]
            states: dict[str, np.ndarray] = {}
            for state in self.updates[paths[0]][1]:
                states[state] = np.zeros(stop - start, np.float32)
                for path in paths:
                    a, b = self.flat_bounds[path]
                    self.states[f"{path}/{state}"] = states[state][a - start:b - start].reshape(self.params[path].shape)
            self.flat_updates.append((graph, slice(start, stop), states))

    def _check_vocabularies(self) -> None:
        bounds: dict[str, dict[str, int]] = {}

        def merge(loader: str, graph: Any) -> None:
            for field, bound in vocabulary_bounds(graph).items():
                current = bounds.setdefault(loader, {})
                current[field] = min(bound, current.get(field, bound))

        merge(self.exp.train_loader_name, self.exp.graph("train"))
        for op in self.exp.evaluation_ops:
            merge(str(op.attributes["loader"]), self.exp.graph(_symbol(op.attributes["graph"])))
        for name, loader_bounds in bounds.items():
            if name in self.loaders:
                self.loaders[name].check_vocabulary(loader_bounds)

    def _resume(self, resume: Path) -> None:
        checkpoint = read_checkpoint(resolve_checkpoint(resume))
        manifest = checkpoint.manifest
        if manifest.get("fingerprint") != self.exp.fingerprint:
            raise SxError(self._difference(manifest, checkpoint.path))
        checkpoint.check_matches(self.params, self.states)
        for path, value in self.params.items():
            np.copyto(value, checkpoint.params[path])
        for name, value in self.states.items():
            np.copyto(value, checkpoint.states[name])
        for name, state in manifest.get("loaders", {}).items():
            if name in self.loaders:
                self.loaders[name].restore(state)
        self.start_step = checkpoint.step
        self.resumed_from = checkpoint.path

    def _difference(self, manifest: dict[str, Any], path: Path) -> str:
        """Why a checkpoint belongs to another experiment, as precisely as the manifest tells."""
        head = f"cannot resume from {path}: it was written by a different experiment"
        theirs = manifest.get("selection", {})
        ours = {"variant": self.exp.selection.get("variant"), "knobs": self.exp.knobs()}
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
        here = {op.attributes["path"]: tuple(op.attributes["type"].shape) for op in self.exp.param_ops}
        for name in sorted(set(shapes) | set(here)):
            if shapes.get(name) != here.get(name):
                reasons.append(f"parameter {name} is {list(shapes[name]) if name in shapes else 'absent'} there, "
                               f"{list(here[name]) if name in here else 'absent'} here")
        if not reasons:
            sources = manifest.get("sources", {})
            changed = [f for f, h in self.exp.source_hashes.items() if sources.get(f) not in (None, h)]
            reasons.append(f"source changed: {', '.join(changed)}" if changed else "the graphs differ")
        return f"{head}: " + "; ".join(reasons)

    # -- one step ------------------------------------------------------------------------------

    def _inputs(self, graph: CompiledGraph, batch: dict[str, np.ndarray],
                grads: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        inputs: dict[str, np.ndarray] = {}
        for spec in graph.inputs:
            if spec.role == "param":
                inputs[spec.name] = self.params[spec.name]
            elif spec.role == "batch":
                inputs[spec.name] = batch[spec.name]
            elif spec.role == "grad" and grads is not None:
                # `train_accumulating` names its gradient inputs like the outputs they continue.
                inputs[spec.name] = grads[spec.name]
        return inputs

    def _microbatch_graph(self, index: int, diagnosed: bool) -> CompiledGraph:
        if index > 0:
            assert self.train_accumulating is not None
            return self.train_accumulating
        return self.train_diagnosed if diagnosed and self.train_diagnosed is not None else self.train

    def train_step(self, step: int) -> tuple[float, dict[str, float], dict[str, int | float], dict[str, np.ndarray]]:
        """One optimizer step; returns the loss, metrics, counters and the observations."""
        diagnosed = any(step % int(op.attributes["every"]) == 0 for op in self.exp.diagnostic_ops)
        grads: dict[str, np.ndarray] | None = None
        loss_sum = 0.0
        metric_sums: dict[str, float] = {}
        counter_sums: dict[str, int | float] = {}
        observed: dict[str, np.ndarray] = {}
        for index in range(self.exp.microbatches):
            graph = self._microbatch_graph(index, diagnosed)
            # The gradients of the flat groups go straight into the flat gradient array.
            result = graph(self._inputs(graph, self.train_loader.next_batch(), grads), self.flat_grad_views)
            loss_sum += float(result.outputs["loss"])
            grads = {name: value for name, value in result.outputs.items() if name.startswith("grad/")}
            for name, value in result.metrics.items():
                metric_sums[name] = metric_sums.get(name, 0.0) + float(value)
            for name, value in result.counters.items():
                counter_sums[name] = counter_sums.get(name, 0) + np.sum(value).item()
            observed.update(result.observed)
        assert grads is not None
        if self.exp.microbatches > 1:
            scale = np.float32(1.0 / self.exp.microbatches)
            # One multiply over the flat gradient array (the same float32 product per element) and one
            # per gradient outside it.
            self.flat_grads *= scale
            for name, value in grads.items():
                if name.removeprefix("grad/") not in self.flat_bounds:
                    value *= scale
        for clip, max_norm in zip(self.clips, self.clip_norms):
            paths = [spec.name.removeprefix("grad/") for spec in clip.inputs]
            if all(path in self.flat_bounds for path in paths):
                flat_clip(self.flat_grads, [self.flat_bounds[path] for path in paths], max_norm, CLIP_EPS)
                continue
            clipped = clip({spec.name: grads[spec.name] for spec in clip.inputs}).outputs
            for name, value in clipped.items():
                if name in grads:
                    np.copyto(grads[name], value)
        step_input = np.asarray(step, dtype=np.float32)
        for update, span, states in self.flat_updates:
            inputs = {"param": self.flat_params[span], "grad": self.flat_grads[span], "step": step_input, **states}
            # In place: the new parameters and states are written over the old.
            update(inputs, {"param": inputs["param"], **states})
        for path, (update, states) in self.updates.items():
            if path in self.flat_bounds:
                continue
            inputs = {"param": self.params[path], "grad": grads[f"grad/{path}"], "step": step_input}
            inputs.update({state: self.states[f"{path}/{state}"] for state in states})
            # In place: the parameter and state buffers live for the whole run.
            update(inputs, {name: inputs[name] for name in ("param", *states)})
        count = self.exp.microbatches
        metrics = {name: total / count for name, total in metric_sums.items()}
        return loss_sum / count, metrics, counter_sums, observed

    def evaluate(self, op: Any, graph: CompiledGraph) -> tuple[dict[str, float], int]:
        loader = self.loaders[str(op.attributes["loader"])]
        sums: dict[str, float] = {}
        batches = 0
        for batch in loader.whole():
            for name, value in graph(self._inputs(graph, batch)).metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            batches += 1
        return {name: total / batches for name, total in sums.items()}, batches

    @staticmethod
    def diagnose(op: Any, observed: dict[str, np.ndarray]) -> dict[str, float]:
        """A diagnostic's values: the scalars `train_diagnosed` observed as `<diagnostic>:<tensor>`."""
        prefix = f"{op.attributes['name']}:"
        return {name.removeprefix(prefix): float(value) for name, value in observed.items() if name.startswith(prefix)}

    # -- the run -------------------------------------------------------------------------------

    def tokens_per_step(self) -> int:
        record = self.train_loader.fields[0].shape
        return self.exp.microbatches * self.train_loader.batch * int(np.prod(record, dtype=np.int64))

    def counted(self) -> tuple[str, int]:
        """What the progress and the summary count, and how many a step processes: tokens of a token
        source, else records."""
        if self.train_loader.tokens is not None:
            return "tokens", self.tokens_per_step()
        return "records", self.exp.microbatches * self.train_loader.batch

    def manifest(self, step: int) -> dict[str, Any]:
        return {
            "selection": {"variant": self.exp.selection.get("variant"), "knobs": self.exp.knobs()},
            "loaders": {name: loader.state() for name, loader in self.loaders.items()},
            "rng": {"seed": self.exp.seed, "loader_draws": "keyed by (loader seed, position)"},
            "sources": self.exp.source_hashes,
            "fingerprint": self.exp.fingerprint,
            "parameters": {op.attributes["path"]: list(op.attributes["type"].shape) for op in self.exp.param_ops},
            "sexpgpu_version": __version__,
        }

    def checkpoint(self, events: EventLog, reporter: ProgressReporter, step: int) -> None:
        started = time.perf_counter()
        path = write_checkpoint(self.out_dir, step, self.params, self.states, self.manifest(step))
        events.write("checkpoint", step=step, path=str(path), seconds=time.perf_counter() - started)
        reporter.say(f"checkpoint {display_path(str(path))}")

    def run(self, device: str) -> RunResult:
        exp = self.exp
        events = EventLog(self.out_dir / "events.jsonl")
        remove_incomplete(self.out_dir)
        events.write(
            "start",
            file=display_path(exp.path),
            selection={"variant": exp.selection.get("variant"), "knobs": exp.knobs()},
            manifest={
                "steps": exp.steps, "start_step": self.start_step, "microbatches": exp.microbatches,
                "batch": self.train_loader.batch, "precision": exp.precision, "seed": exp.seed,
                "device": device, "tokens_per_step": self.tokens_per_step(), "sources": exp.source_hashes,
                "fingerprint": exp.fingerprint, "version": __version__,
                "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            },
            parameters=exp.parameter_count,
        )
        unit, per_step = self.counted()
        reporter = ProgressReporter(exp.steps, self.start_step, self.reporter_stream, self.interactive,
                                    unit="tok" if unit == "tokens" else "rec")
        throughput = Throughput(unit)
        run_started = time.perf_counter()
        step = self.start_step
        status, message = "done", None
        train_loss: float | None = None
        last_evals: dict[str, dict[str, float | None]] = {}
        try:
            with _Interrupt() as interrupt:
                while step < exp.steps:
                    if interrupt.requested:
                        status, message = "interrupted", f"interrupted after step {step}"
                        break
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
                                  elapsed / (step - self.start_step) * (exp.steps - step))
                    for op in exp.diagnostic_ops:
                        if step % int(op.attributes["every"]) == 0:
                            events.write("diagnostic", step=step, name=str(op.attributes["name"]),
                                         reducer=str(op.attributes["reducer"]), values=self.diagnose(op, observed))
                    for op, graph in self.evaluations:
                        if step % int(op.attributes["every"]) == 0 or step == exp.steps:
                            eval_started = time.perf_counter()
                            results, batches = self.evaluate(op, graph)
                            name = str(op.attributes["name"])
                            last_evals[name] = {k: finite_or_none(v) for k, v in results.items()}
                            events.write("eval", step=step, name=name, metrics=results, batches=batches,
                                         seconds=time.perf_counter() - eval_started)
                            reporter.say(f"step {step} {name}: {format_metrics(last_evals[name])}")
                    if exp.checkpoint_every and (step % exp.checkpoint_every == 0 or step == exp.steps):
                        self.checkpoint(events, reporter, step)
                if status == "interrupted":
                    self.checkpoint(events, reporter, step)
        except BaseException as err:
            reporter.close()
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
            ("status", f"{result.status} at step {result.step}/{self.exp.steps} in {format_seconds(seconds)}"
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


def unigram_entropy(loader: Loader, limit: int = 1 << 24) -> float | None:
    """Entropy in nats of the token frequencies of a token source (its first `limit` tokens)."""
    if loader.tokens is None:
        return None
    counts = np.bincount(np.asarray(loader.tokens[:limit], dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def default_out_dir(path: str) -> Path:
    return Path("runs") / f"{Path(path).stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


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
          interactive: bool | None = None) -> RunResult:
    """Train an experiment file; what `sexpgpu run` and `sexpgpu.train` do."""
    require_available(device, "run")
    experiment = Experiment(path, variant, set_flags(sets))
    resume_path = Path(resume) if resume is not None else None
    if out is not None:
        out_dir = Path(out)
    elif resume_path is not None:
        checkpoint = resolve_checkpoint(resume_path)
        out_dir = checkpoint.parent.parent
    else:
        out_dir = default_out_dir(path)
    if resume_path is None and (out_dir / "events.jsonl").exists():
        raise SxError(f"{display_path(str(out_dir))} already holds a run record; continue it with "
                      f"--resume {display_path(str(out_dir))}, or choose another --out")
    try:
        return Trainer(experiment, out_dir, resume_path, stream, interactive).run(device)
    except MemoryError as err:
        raise ran_out(err, experiment.run_op.loc) from None
