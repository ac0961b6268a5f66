"""Generating from a trained run: what `sexpgpu sample` does (docs/verbs/sample.md).

A run directory's record (`events.jsonl`: the experiment file and its
selection) and one of its checkpoints (the parameters, and the fingerprint and
source hashes of the experiment that wrote them) are all it reads:

1. the experiment is compiled again under the run's selection, through the
   training pipeline with `evaluate{inference=true}`, which also traces the
   model's forward for one sequence into `graph.func @sample` (inputs: the
   parameters and `tokens` `[1, seq]`; output `logits` `[1, seq, vocab]`);
   the training module's fingerprint must be the checkpoint's, unless forced;
2. `@sample`, in a module of its own, is compiled by the device's executor
   and the checkpoint's parameters uploaded once;
3. each new token runs the graph on the last `seq` tokens (the window slides
   once the text is longer), padded at the end; the logits at the last real
   position give the next token: greedy at temperature 0, else nanoGPT's
   rule (divide by the temperature, keep the `top_k` largest, softmax, draw),
   among the ids the model takes as input and the tokenizer can decode.
   The draws come from a generator keyed by (seed, sample index), so a seed
   fixes the text; greedy tokens depend on no draw and are the same on every
   device.

Padding is sound only for a causal model (position i sees positions ≤ i):
the first call checks it, running the window with two different paddings.
The whole window is recomputed for every token; a key-value cache derived by
the compiler is not built yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from attrs import frozen

from ..diagnostics import SxError, display_path
from ..dialects.core import Operation, Region
from ..passes.manager import CompilationUnit, run_pipeline
from ..passes.pipelines import SAMPLING_PIPELINE
from .checkpoint import MANIFEST_FILE, Checkpoint, list_checkpoints, read_checkpoint
from .events import read_events
from .executor import Executor
from .loaders import FIELD_DTYPES, vocabulary_bounds
from .tokenizers import Tokenizer, TokenizerError, source_tokenizer, tokenizer_named
from .training import TrainingPlan, set_flags

#: The name of the inference graph `evaluate{inference=true}` traces, and of its token input.
SAMPLE_GRAPH = "sample"
TOKENS_INPUT = "tokens"


@frozen
class RunSource:
    """What a sample starts from: the run directory, its experiment file and selection, the checkpoint."""

    run_dir: Path
    file: Path
    variant: str | None
    sets: list[str]
    checkpoint: Path


def locate_run(path: str | Path, checkpoint: str | None = None) -> RunSource:
    """The run and checkpoint `path` names: a run directory (its latest checkpoint, or `checkpoint`,
    `step-N`) or one of its `checkpoints/step-N` directories."""
    given = Path(path)
    shown = display_path(str(given))
    if not given.exists():
        raise SxError(f"cannot sample from {shown}: no such directory")
    if not given.is_dir():
        raise SxError(f"cannot sample from {shown}: it is not a directory (give a run record or one of its "
                      "checkpoints/step-N)")
    chosen: Path | None = None
    run_dir = given
    if (given / MANIFEST_FILE).exists() or given.parent.name == "checkpoints":
        chosen, run_dir = given, given.parent.parent
    log = run_dir / "events.jsonl"
    if not log.is_file():
        raise SxError(f"{display_path(str(run_dir))} is not a run record: it has no events.jsonl (give the --out "
                      "directory of sexpgpu run, or one of its checkpoints/step-N)")
    starts = [event for event in read_events(log) if event.get("type") == "start"]
    if not starts:
        raise SxError(f"{display_path(str(log))} records no run start: it is not a run's record")
    start = starts[-1]
    found = {p.name: p for _, p in list_checkpoints(run_dir)}
    if checkpoint is not None:
        chosen = found.get(Path(checkpoint).name)
        if chosen is None:
            have = ", ".join(found) or "none"
            raise SxError(f"{display_path(str(run_dir))} has no checkpoint {checkpoint} (it has: {have})")
    elif chosen is None:
        if not found:
            raise SxError(f"{display_path(str(run_dir))} holds no checkpoint to sample from (its defrun writes "
                          "them with :checkpoints (every N); a run also writes one when it ends)")
        chosen = list(found.values())[-1]
    selection = start.get("selection") or {}
    knobs = selection.get("knobs") or {}
    sets = set_flags({name: value for name, (value, source) in knobs.items() if source == "set"})
    return RunSource(run_dir, _experiment_file(str(start.get("file")), run_dir), selection.get("variant"), sets,
                     chosen)


def _experiment_file(recorded: str, run_dir: Path) -> Path:
    """The run's experiment file: as recorded (relative to where the run started: here, or the directory
    holding `runs/`)."""
    for candidate in (Path(recorded), run_dir.parent.parent / recorded):
        if candidate.is_file():
            return candidate
    raise SxError(f"the experiment file of {display_path(str(run_dir))}, {recorded}, is not there (run sample from "
                  "the directory the run started in)")


class Sampler:
    """The model of a run on an executor: the next token's log-probabilities for a context."""

    def __init__(self, source: RunSource, executor: Executor, force: bool = False) -> None:
        self.source = source
        self.executor = executor
        self.checkpoint = read_checkpoint(source.checkpoint, use="sampled from")
        unit = run_pipeline(CompilationUnit(path=str(source.file), variant=source.variant, sets=source.sets),
                            SAMPLING_PIPELINE)
        func = _detach(unit.module, SAMPLE_GRAPH)
        plan = TrainingPlan(unit.module, str(source.file))
        if not force:
            _check_same_experiment(plan, self.checkpoint)
        loader = plan.loader_ops[plan.train_loader_name]
        self.tokenizer_name = source_tokenizer(dict(loader.attributes["source"]))
        self.tokenizer: Tokenizer = tokenizer_named(self.tokenizer_name)
        self.graph = executor.compile(func)
        tokens_type = next(spec.type for spec in self.graph.inputs if spec.name == TOKENS_INPUT)
        self.window = int(tokens_type.shape[1])
        self.vocab = vocabulary_bounds(func).get(TOKENS_INPUT, self.tokenizer.vocab_size or 1 << 31)
        #: The ids a new token may be: ones the model takes back as input and the tokenizer can decode
        #: (a padded vocabulary's extra logits, GPT-2's 50304 for 50257 ids, are never drawn).
        self.drawable = min(self.vocab, self.tokenizer.vocab_size or self.vocab)
        self.inputs = self._upload_params(func)
        self.tokens = executor.zeros(tuple(tokens_type.shape), tokens_type.dtype)
        self.tokens_dtype = FIELD_DTYPES[tokens_type.dtype]
        self.inputs[TOKENS_INPUT] = self.tokens
        self._causal_checked = False

    def _upload_params(self, func: Operation) -> dict[str, Any]:
        params = self.checkpoint.params
        uploaded = {}
        for spec in self.graph.inputs:
            if spec.role != "param":
                continue
            value = params.get(spec.name)
            if value is None:
                raise SxError(f"checkpoint {display_path(str(self.checkpoint.path))} holds no parameter {spec.name}, "
                              "which the model has")
            if tuple(value.shape) != tuple(spec.type.shape):
                raise SxError(f"parameter {spec.name} is {list(value.shape)} in checkpoint "
                              f"{display_path(str(self.checkpoint.path))}, {list(spec.type.shape)} in the model")
            uploaded[spec.name] = self.executor.upload(value.astype(np.float32, copy=False))
        return uploaded

    def encode_prompt(self, text: str) -> list[int]:
        """The prompt's ids: every one must be an id the model takes, and they must fit its window."""
        try:
            tokens = self.tokenizer.encode(text)
        except TokenizerError as err:
            raise SxError(f"the prompt cannot be encoded: {err.message}") from None
        if not tokens:
            raise SxError(f"the prompt encodes to no tokens ({self.tokenizer_name}); give at least one character")
        for position, token in enumerate(tokens):
            if not 0 <= token < self.vocab:
                raise SxError(f"the prompt cannot be encoded for this model: {self._describe(text, tokens, position)} is "
                              f"id {token}, outside the model's vocabulary of {self.vocab} (ids 0 to {self.vocab - 1})")
        if len(tokens) > self.window:
            raise SxError(f"the prompt is {len(tokens)} tokens, longer than the model's window of {self.window} "
                          "tokens; shorten it")
        return tokens

    def _describe(self, text: str, tokens: list[int], position: int) -> str:
        """Token `position` of the prompt `text`, with the character it comes from."""
        if self.tokenizer_name == "none":
            return f"its token {position + 1}"
        # The text before the token, less a character the token completes (decoded as U+FFFD so far).
        offset = len(self.tokenizer.decode(tokens[:position]).rstrip("\ufffd"))
        return f"its token {position + 1}, from the character {text[offset]!r} at offset {offset},"

    def _logits(self, context: list[int], pad: int) -> np.ndarray:
        window = np.full((1, self.window), pad, dtype=self.tokens_dtype)
        window[0, : len(context)] = context
        self.executor.write(self.tokens, window)
        result = self.graph(self.inputs)
        return np.asarray(self.executor.download(result.outputs["logits"])[0, len(context) - 1], dtype=np.float64)

    def log_probs(self, context: list[int]) -> np.ndarray:
        """log P(next token | the last `window` tokens of `context`), over the model's vocabulary."""
        context = context[-self.window :]
        logits = self._logits(context, 0)
        if not self._causal_checked and len(context) < self.window:
            self._causal_checked = True
            other = self._logits(context, min(1, self.vocab - 1))
            if not np.allclose(logits, other, rtol=1e-4, atol=1e-4):
                raise SxError("sample needs a causal model (the logits at a position depend only on the tokens up "
                              "to it): this model's changed when tokens after the prompt changed")
        return _log_softmax(logits)

    def generate(self, prompt: list[int], count: int, temperature: float = 1.0, top_k: int | None = None,
                 seed: int = 0, index: int = 0) -> Iterator[tuple[int, float]]:
        """`count` new tokens after `prompt`, each with its log-probability under the model; see the
        module docstring for the rule."""
        rng = np.random.default_rng([seed, index])
        context = list(prompt)
        for _ in range(count):
            log_probs = self.log_probs(context)
            token = pick(log_probs[: self.drawable], temperature, top_k, rng)
            context.append(token)
            yield token, float(log_probs[token])


#: What follows each sample in streamed text (nanoGPT's sample.py prints the same line).
SEPARATOR = "---------------"


def sample(run: str | Path, prompt: str = "\n", tokens: int = 200, temperature: float = 0.8, top_k: int | None = 200,
           seed: int = 1337, samples: int = 1, device: str = "cpu", checkpoint: str | None = None,
           force: bool = False, on_text: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Generate from a run as `sexpgpu sample` does; returns the `--json` document
    (`sexpgpu/schemas/sample.schema.json`). `on_text` receives the text as it is made: each sample's
    prompt, its new tokens' text, then a newline and `SEPARATOR`."""
    from .devices import open_device

    source = locate_run(run, checkpoint)
    sampler = Sampler(source, open_device(device, "sample"), force=force)
    prompt_ids = sampler.encode_prompt(prompt)
    top_k = top_k if temperature > 0 else None
    emit = on_text or (lambda text: None)
    made = []
    for index in range(samples):
        stream = sampler.tokenizer.streamer()
        emit("".join(stream(token) for token in prompt_ids))
        new, log_probs = [], []
        for token, log_prob in sampler.generate(prompt_ids, tokens, temperature, top_k, seed, index):
            new.append(token)
            log_probs.append(log_prob)
            emit(stream(token))
        emit(f"\n{SEPARATOR}\n")
        made.append({"tokens": new, "logprobs": log_probs, "text": sampler.tokenizer.decode(new)})
    return {
        "run": display_path(str(source.run_dir)),
        "checkpoint": display_path(str(sampler.checkpoint.path)),
        "step": sampler.checkpoint.step,
        "device": device,
        "tokenizer": sampler.tokenizer_name,
        "window": sampler.window,
        "settings": {"tokens": tokens, "temperature": temperature, "top_k": top_k, "seed": seed},
        "prompt": {"text": sampler.tokenizer.decode(prompt_ids), "tokens": prompt_ids},
        "samples": made,
    }


def pick(log_probs: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> int:
    """The next token: the most likely at temperature 0; else drawn as nanoGPT draws it."""
    if temperature == 0:
        return int(np.argmax(log_probs))
    scaled = log_probs / temperature
    if top_k is not None and top_k < len(scaled):
        threshold = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled < threshold, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    cumulative = np.cumsum(probs)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(probs) - 1))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def _detach(module: Operation, name: str) -> Operation:
    """Move the graph `name` out of `module` into a module of its own (a device lowers that module alone)."""
    func = next(op for op in module.body.ops if op.name == "graph.func" and str(op.attributes["sym_name"]) == name)
    module.body.detach(func)
    alone = Operation.create("builtin.module", regions=[Region.with_block()])
    alone.body.append(func)
    return func


def _check_same_experiment(plan: TrainingPlan, checkpoint: Checkpoint) -> None:
    """The checkpoint must come from the experiment compiled now (same fingerprint)."""
    manifest = checkpoint.manifest
    if manifest.get("fingerprint") == plan.fingerprint:
        return
    recorded = manifest.get("sources") or {}
    changed = [f for f, digest in plan.source_hashes.items() if recorded.get(f) not in (None, digest)]
    why = (f"source changed since it was trained: {', '.join(changed)}" if changed
           else "the experiment compiles to different graphs now")
    raise SxError(f"checkpoint {display_path(str(checkpoint.path))} does not match {display_path(plan.path)}: {why}; "
                  "sample with --force to use its parameters anyway")
