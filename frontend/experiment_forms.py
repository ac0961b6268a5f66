"""The experiment forms (language.md §3): `defknobs`, `defvariant`, `defloader`, `defoptimizer`,
`defevaluation`, `defdiagnostic`, `defrun`, the emits, and the builtins they take as values.

Each evaluator session gets an `ExperimentDefinition` (see `install`, run for
every new `Evaluator`): the forms below check their options and fill it with
the records of `experiment_definitions` as the file is evaluated; the
`evaluate` pass then lowers it (`experiment_lowering`).

What the forms print under `sexpgpu eval`: `defknobs`, a variant's name,
`name = #<loader 1 fields, batch 4>`, `name = #<optimizer adamw>`, an
evaluation's or a diagnostic's name, `defrun = #<run 300 steps>`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ..diagnostics import Location, SxError, nearest
from ..dialects.exp import OPTIMIZER_DEFAULTS, PRECISIONS, REDUCERS, TOKEN_FILE_FORMATS, TOKENIZERS
from ..dialects.inits import Init
from . import modules
from .analysis import OPERAND_LOCATED, Env, register_special_form
from .calls import Builtin, BuiltinError, Closure, argument_error, register_builtin
from .data import Keyword, SxList, Symbol, element_loc
from .evaluator import Defined
from .experiment_definitions import (
    Checkpoints,
    DiagnosticDef,
    DiagnosticSource,
    EvaluationDef,
    ExperimentDefinition,
    FieldDef,
    GroupSpec,
    LoaderDef,
    OptimizerSpec,
    RunDef,
    Schedule,
    Source,
)
from .limits import MAX_COUNT
from .modules import Shown, symbol_arg
from .printing import described, short_int, show
from .selection import Knob, Selection, Variant
from .tracer import EMITS, active_trace, check_shape, dtype_name

PRELUDE_PATH = str(Path(__file__).with_name("prelude.sx"))


def experiment_of(env: Env) -> ExperimentDefinition:
    return env.evaluator.experiment  # type: ignore[attr-defined]


#: The names a token source's options take (`:tokenizer gpt2`, `:format llmc`), bound to their symbols
#: as the dtype names are (`none` is one of those).
SOURCE_OPTION_NAMES = tuple(name for name in (*TOKENIZERS, *TOKEN_FILE_FORMATS) if name != "none")


def install(evaluator: Any) -> None:
    """Session hook: a fresh experiment, the model tree, the initializers, the source option names, then
    the prelude."""
    modules.install(evaluator)
    evaluator.globals.update({name: Symbol(name) for name in SOURCE_OPTION_NAMES})
    evaluator.experiment = ExperimentDefinition(Selection(evaluator.variant, list(evaluator.sets)), evaluator.model_tree)
    evaluator.load_prelude(PRELUDE_PATH)


# -- option parsing ----------------------------------------------------------------------------


def _options(
    env: Env, args: list, start: int, spec: dict[str, bool], what: str, raw: frozenset[str] = frozenset()
) -> tuple[dict[str, Any], dict[str, Location | None]]:
    """The `:key value` pairs of `args[start:]`, evaluated except the keys in `raw`.

    `spec` maps each allowed key to whether it is required.
    """
    values: dict[str, Any] = {}
    locs: dict[str, Location | None] = {}
    i = start
    while i < len(args):
        key = args[i]
        if not isinstance(key, Keyword):
            raise SxError(f"{what}: expected an option (:name value), got {show(key)}", env.loc_of_arg(i))
        if key.name not in spec:
            hint = nearest(key.name, spec)
            raise SxError(
                f"{what}: unknown option :{key.name}" + (f"; did you mean :{hint}?" if hint else f" (options: {' '.join(':' + k for k in spec)})"),
                env.loc_of_arg(i),
            )
        if i + 1 >= len(args):
            raise SxError(f"{what}: option :{key.name} has no value", env.loc_of_arg(i))
        if key.name in values:
            raise SxError(f"{what}: option :{key.name} is given twice", env.loc_of_arg(i))
        locs[key.name] = env.loc_of_arg(i + 1)
        values[key.name] = args[i + 1] if key.name in raw else env.eval(args[i + 1], env.loc_of_arg(i + 1))
        i += 2
    for key, required in spec.items():
        if required and key not in values:
            raise SxError(f"{what} needs :{key}", env.form.loc)
    return values, locs


def _error(message: str, loc: Location | None, operand: int | str | None) -> SxError:
    """An error at `loc`; at the argument `operand` of a builtin's call when given (see `argument_error`)."""
    return SxError(message, loc) if operand is None else argument_error(message, loc, operand)


def _int(value: Any, what: str, loc: Location | None, minimum: int = 1, operand: int | str | None = None) -> int:
    """An int from `minimum` to `MAX_COUNT` (a step count, a size, a seed)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _error(f"{what} must be an int ≥ {minimum}, got {show(value)}", loc, operand)
    if value > MAX_COUNT:
        raise _error(f"{what} must be at most {MAX_COUNT}, got {short_int(value)}", loc, operand)
    return value


def _float(value: Any, what: str, loc: Location | None, operand: int | str | None = None) -> float:
    """A finite number, as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _error(f"{what} must be a number, got {show(value)}", loc, operand)
    try:
        number = float(value)
    except OverflowError:
        raise _error(f"{what} must be a finite number, got {short_int(value)} (too large for a float)", loc, operand) from None
    if not math.isfinite(number):
        raise _error(f"{what} must be a finite number, got {show(value)}", loc, operand)
    return number


def _in_range(value: Any, what: str, loc: Location | None, operand: int | str | None, key: str) -> float:
    """A finite number in the range `_RANGES[key]` allows."""
    number = _float(value, what, loc, operand)
    test, expected = _RANGES[key]
    if not test(number):
        raise _error(f"{what} must be {expected}, got {show(value)}", loc, operand)
    return number


#: The ranges of the hyperparameters, as a test and as words.
_RANGES: dict[str, tuple[Any, str]] = {
    "lr": (lambda x: x >= 0, "≥ 0"),
    "peak": (lambda x: x >= 0, "≥ 0"),
    "beta": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "eps": (lambda x: x > 0, "> 0"),
    "weight_decay": (lambda x: x >= 0, "≥ 0"),
    "momentum": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "floor": (lambda x: 0 <= x <= 1, "in [0, 1] (a fraction of the peak)"),
}


def _kind(value: Any, cls: type, what: str, expected: str, loc: Location | None) -> Any:
    if not isinstance(value, cls):
        raise SxError(f"{what} must be {expected}, got {show(value)}", loc)
    return value


def _not_traced(what: str, loc: Location | None) -> None:
    """An error when an experiment definition runs while a graph is traced: it belongs at top level."""
    trace = active_trace()
    if trace is not None:
        raise SxError(
            f"{what} cannot appear in code that runs while graph '{trace.name}' is traced (prepare, the "
            "objective, an evaluation or a module's forward function): define it at top level",
            loc,
        )


def _definition(name: str, form: Any) -> Any:
    """The experiment form `form`, refused while a graph is traced."""

    def checked(env: Env, args: list, loc: Location | None) -> Any:
        _not_traced(name, loc)
        return form(env, args, loc)

    return checked


# -- knobs and variants ------------------------------------------------------------------------


def _defknobs(env: Env, args: list, loc: Location | None) -> Shown:
    """`(defknobs (name default "doc") …)`: declare the knobs and bind each to its selected value."""
    exp = experiment_of(env)
    knobs = []
    for i, clause in enumerate(args):
        cloc = env.loc_of_arg(i)
        if not isinstance(clause, SxList) or not clause or not isinstance(clause[0], Symbol) or len(clause) > 3:
            raise SxError(f'expected a knob (name default "doc"), got {show(clause)}', cloc)
        if len(clause) < 2:
            raise SxError(f"knob {clause[0].name} needs a default value", cloc)
        default = env.eval(clause[1], cloc)
        doc = clause[2] if len(clause) == 3 else None
        if doc is not None and not isinstance(doc, str):
            raise SxError(f"the doc of knob {clause[0].name} must be a string", cloc)
        knobs.append(Knob(clause[0].name, default, doc, cloc))
    for variant in _variants_of(env, loc):
        exp.selection.add_variant(variant)
    values = exp.selection.select(knobs, loc)
    for variant in exp.selection.variants.values():
        exp.selection.check_variant(variant)
    for name, value in values.items():
        env.bind_global(name, value)
    return Shown("defknobs")


def _variants_of(env: Env, loc: Location | None) -> list[Variant]:
    """The `defvariant` forms at the top level of the file being evaluated and of the one defining the knobs.

    They are read ahead of evaluation because the selection is fixed when `defknobs` runs.
    """
    files = [f for f in dict.fromkeys([*env.evaluator.loading[:1], os.path.abspath(loc.file) if loc else None]) if f]
    out = []
    for path in files:
        forms = env.evaluator.read_source(path)
        for form, floc in zip(forms, forms.locs):
            if isinstance(form, SxList) and form and form[0] == Symbol("defvariant"):
                out.append(_parse_variant(env, form, floc))
    return out


def _parse_variant(env: Env, form: SxList, loc: Location | None) -> Variant:
    if len(form) < 2 or not isinstance(form[1], Symbol):
        raise SxError("expected (defvariant name :knob value …)", loc)
    name = form[1].name
    values: dict[str, Any] = {}
    locs: dict[str, Location | None] = {}
    items = form[2:]
    if len(items) % 2:
        raise SxError(f"variant {name}: expected :knob value pairs", loc)
    for i in range(0, len(items), 2):
        key, kloc = items[i], element_loc(form, i + 2)
        if not isinstance(key, Keyword):
            raise SxError(f"variant {name}: expected :knob, got {show(key)}", kloc)
        locs[key.name] = kloc
        values[key.name] = env.eval(items[i + 1], element_loc(form, i + 3))
    return Variant(name, values, loc, locs)


def _defvariant(env: Env, args: list, loc: Location | None) -> Shown:
    """Checked and applied by `defknobs` (which reads variants ahead); here it only prints its name."""
    exp = experiment_of(env)
    name = symbol_arg(args, 0, env, "(defvariant name :knob value …)")
    if not exp.selection.knobs:
        raise SxError(f"variant {name} comes before defknobs: declare the knobs first", loc)
    if name not in exp.selection.variants:
        raise SxError(f"variant {name} is not at the top level of the file that declares the knobs", loc)
    return Shown(name)


# -- loaders -----------------------------------------------------------------------------------


def _file_source(kind: str):
    def make(loc: Location | None, path: Any) -> Source:
        if not isinstance(path, str):
            raise SxError(f'({kind} "path") needs a path string, got {show(path)}', loc)
        return Source(kind, {"path": path})

    return make


def _choice(value: Any, choices: tuple[str, ...], what: str, loc: Location | None, operand: str) -> str:
    """A symbol (or string) among `choices`, as its name."""
    name = value.name if isinstance(value, Symbol) else value
    if name not in choices:
        raise argument_error(f"{what} must be {', '.join(choices[:-1])} or {choices[-1]}, got {described(value)}",
                             loc, operand)
    return name


def _token_file(loc: Location | None, path: Any, *, dtype: Any = None, format: Any = None,  # noqa: A002
                tokenizer: Any = None) -> Source:
    """`(token-file "x.bin" :dtype u16|u32 :format auto|llmc|nanogpt :tokenizer bytes|gpt2|none)`: little-endian
    token ids, after llm.c's header when there is one. Options left out are not recorded (the loader's defaults)."""
    source = _file_source("token-file")(loc, path)
    if dtype is not None:
        source.options["dtype"] = _choice(dtype, ("u16", "u32"), "token-file :dtype", loc, "dtype")
    if format is not None:
        source.options["format"] = _choice(format, TOKEN_FILE_FORMATS, "token-file :format", loc, "format")
    if tokenizer is not None:
        source.options["tokenizer"] = _choice(tokenizer, TOKENIZERS, "token-file :tokenizer", loc, "tokenizer")
    return source


def _synthetic_tokens(loc: Location | None, *, vocab: Any, count: Any, seed: Any = 0, branch: Any = 4) -> Source:
    return Source("synthetic-tokens", {
        "vocab": _int(vocab, "synthetic-tokens :vocab", loc, 2, "vocab"),
        "count": _int(count, "synthetic-tokens :count", loc, 1, "count"),
        "seed": _int(seed, "synthetic-tokens :seed", loc, 0, "seed"),
        "branch": _int(branch, "synthetic-tokens :branch", loc, 1, "branch"),
    })  # fmt: skip


def _defloader(env: Env, args: list, loc: Location | None) -> Defined:
    """`(defloader name :source src :fields ((name [dims] dtype) …) :batch n :shuffle b :seed s)`."""
    exp = experiment_of(env)
    name = symbol_arg(args, 0, env, "(defloader name :source … :fields … :batch …)")
    what = f"loader {name}"
    opts, locs = _options(env, args, 1, {"source": True, "fields": True, "batch": True, "shuffle": False, "seed": False}, what, raw=frozenset({"fields"}))
    source = _kind(opts["source"], Source, f"{what} :source", "(token-file …), (text-file …), (npy-file …) or (synthetic-tokens …)", locs["source"])
    fields_form = opts["fields"]
    if not isinstance(fields_form, list) or not fields_form:
        raise SxError(f"{what}: :fields must be a list of (name [dims] dtype)", locs["fields"])
    fields = []
    for f in fields_form:
        floc = getattr(f, "loc", None) or locs["fields"]
        if not isinstance(f, SxList) or len(f) != 3 or not isinstance(f[0], Symbol):
            raise SxError(f"{what}: a field is (name [dims] dtype), got {show(f)}", floc)
        shape = env.eval(f[1], floc)
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise SxError(f"{what}: field {f[0].name} needs a vector of positive ints as its shape, got {show(shape)}", floc)
        fields.append(FieldDef(f[0].name, tuple(shape), dtype_name(env.eval(f[2], floc), f"{what} field {f[0].name}", floc)))
    batch = _int(opts["batch"], f"{what} :batch", locs["batch"])
    for f, form in zip(fields, fields_form):
        check_shape((batch, *f.shape), f"{what} field {f.name}", getattr(form, "loc", None) or locs["fields"])
    seed = opts.get("seed")
    if seed is not None:
        seed = _int(seed, f"{what} :seed", locs["seed"], 0)
    if name in exp.loaders:
        raise SxError(f"loader {name} is defined twice (first at {exp.loaders[name].loc})", loc)
    loader = exp.loaders[name] = LoaderDef(name, source, fields, batch, bool(opts.get("shuffle", False)), seed, loc)
    env.bind_global(name, loader)
    return Defined(name, loader)


# -- optimizers --------------------------------------------------------------------------------

_HYPER_KEYS = {kind: tuple(defaults) for kind, defaults in OPTIMIZER_DEFAULTS.items()}


def _hyper(loc: Location | None, kind: str, options: dict[str, Any], what: str) -> dict[str, Any]:
    """The hyperparameters among `options`, each checked; an error points at the offending one."""
    hyper: dict[str, Any] = {}
    for key, value in options.items():
        shown = ":" + key.replace("_", "-")
        if key == "lr":
            hyper["lr"] = _learning_rate(value, f"{what} :lr", loc)
        elif key == "betas":
            if not isinstance(value, list) or len(value) != 2:
                raise argument_error(f"{what} :betas must be [b1 b2], got {show(value)}", loc, key)
            hyper["betas"] = [_in_range(b, f"{what} :betas", loc, key, "beta") for b in value]
        elif key == "nesterov":
            if not isinstance(value, bool):
                raise argument_error(f"{what} :nesterov must be true or false, got {described(value)}", loc, key)
            hyper["nesterov"] = value
        elif key in ("eps", "weight_decay", "momentum"):
            hyper[key] = _in_range(value, f"{what} {shown}", loc, key, key)
        else:
            hint = nearest(key, ["lr", *_HYPER_KEYS.get(kind, ("betas", "eps", "weight_decay", "momentum", "nesterov"))])
            raise SxError(
                f"{what}: {kind} has no option {shown}" + (f"; did you mean :{hint.replace('_', '-')}?" if hint else ""),
                loc,
            )
    return hyper


def _learning_rate(value: Any, what: str, loc: Location | None) -> Any:
    """A learning rate: a number ≥ 0, a schedule (checked when it was made) or (constant v)."""
    if isinstance(value, Schedule):
        return value
    if isinstance(value, Init) and value.kind == "constant":
        _in_range(value.args["value"], what, loc, "lr", "lr")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise argument_error(f"{what} must be a number or a schedule, got {show(value)}", loc, "lr")
    return _in_range(value, what, loc, "lr", "lr")


def _optimizer(kind: str):
    def make(loc: Location | None, *, lr: Any = None, clip: Any = None, groups: Any = None, **options: Any) -> OptimizerSpec:
        if lr is None:
            raise SxError(f"({kind} …) needs :lr (a number or a schedule)", loc)
        allowed = {"lr", *_HYPER_KEYS[kind]}
        for key in options:
            if key not in allowed:
                raise SxError(f"{kind} has no option :{key.replace('_', '-')} (options: :lr :clip :groups {' '.join(':' + k.replace('_', '-') for k in _HYPER_KEYS[kind])})", loc)
        hyper = _hyper(loc, kind, {"lr": lr, **options}, kind)
        if groups is not None and not isinstance(groups, list):
            raise argument_error(f'{kind} :groups must be a vector of (group "glob" :lr …), got {described(groups)}', loc, "groups")
        group_list = list(groups or [])
        for g in group_list:
            if not isinstance(g, GroupSpec):
                raise argument_error(f'{kind} :groups must be a vector of (group "glob" :lr …), got {described(g)} in it', loc, "groups")
            for key in g.hyper:
                if key not in allowed:
                    raise SxError(f"group \"{g.glob}\": {kind} has no option :{key.replace('_', '-')}", g.loc)
        clip_value = None
        if clip is not None:
            clip_value = _float(clip, f"{kind} :clip", loc, "clip")
            if not clip_value > 0:
                raise argument_error(f"{kind} :clip is the largest global gradient norm, a number > 0; got {show(clip)}", loc, "clip")
        return OptimizerSpec(kind, hyper, clip_value, group_list, loc)

    return make


def _group(loc: Location | None, glob: Any, **options: Any) -> GroupSpec:
    if not isinstance(glob, str):
        raise argument_error(f'(group "glob" …) needs a glob string, got {show(glob)}', loc, 0)
    return GroupSpec(glob, _hyper(loc, "group", options, f'group "{glob}"'), loc)


def _schedule(kind: str, keys: tuple[str, ...], required: tuple[str, ...]):
    def make(loc: Location | None, peak: Any, **options: Any) -> Schedule:
        values: dict[str, float] = {"peak": _in_range(peak, f"({kind} peak …) peak", loc, 0, "peak")}
        for key in required:
            if key not in options:
                raise SxError(f"({kind} …) needs :{key}", loc)
        for key, value in options.items():
            if key not in keys:
                raise SxError(f"({kind} …) has no option :{key} (options: {' '.join(':' + k for k in keys)})", loc)
            if key in ("warmup", "steps"):
                values[key] = _int(value, f"({kind} …) :{key}", loc, 0 if key == "warmup" else 1, key)
            else:
                values[key] = _in_range(value, f"({kind} …) :{key}", loc, key, key)
        if kind != "linear-warmup":
            values.setdefault("floor", 0.0)
        warmup = values.get("warmup", 0)
        if "steps" in values and values["steps"] <= warmup:
            # The cosine runs from the end of the warmup to `steps`: it needs at least one step.
            raise SxError(f"({kind} …) needs :steps ({values['steps']}) > :warmup ({warmup})", loc)
        return Schedule(kind, values)

    return make


def _defoptimizer(env: Env, args: list, loc: Location | None) -> Defined:
    """`(defoptimizer name (adamw …))`."""
    exp = experiment_of(env)
    name = symbol_arg(args, 0, env, "(defoptimizer name (adamw …))")
    if len(args) != 2:
        raise SxError("expected (defoptimizer name (adamw …) )", loc)
    spec = _kind(env.eval(args[1], env.loc_of_arg(1)), OptimizerSpec, f"optimizer {name}", "(adamw …) or (sgd …)", env.loc_of_arg(1))
    spec.name = name
    exp.optimizers[name] = spec
    env.bind_global(name, spec)
    return Defined(name, spec)


# -- evaluations, diagnostics ------------------------------------------------------------------


def _defevaluation(env: Env, args: list, loc: Location | None) -> Shown:
    """`(defevaluation name :loader loader :every n :fn f)`."""
    exp = experiment_of(env)
    name = symbol_arg(args, 0, env, "(defevaluation name :loader … :every … :fn …)")
    what = f"evaluation {name}"
    opts, locs = _options(env, args, 1, {"loader": True, "every": True, "fn": True}, what)
    loader = _kind(opts["loader"], LoaderDef, f"{what} :loader", "a loader (defined with defloader)", locs["loader"])
    every = _int(opts["every"], f"{what} :every", locs["every"])
    if name in exp.evaluations:
        raise SxError(f"evaluation {name} is defined twice", loc)
    ev = exp.evaluations[name] = EvaluationDef(name, loader, every, opts["fn"], loc)
    env.bind_global(name, ev)
    return Shown(name)


def _diagnostic_source(kind: str):
    def make(glob: Any) -> DiagnosticSource:
        if not isinstance(glob, str):
            raise BuiltinError(f'({kind} "glob") needs a glob string, got {show(glob)}')
        return DiagnosticSource(kind, glob)

    return make


def _defdiagnostic(env: Env, args: list, loc: Location | None) -> Shown:
    """`(defdiagnostic name :of (grads GLOB) :reducer rms :every n :when expr)`."""
    exp = experiment_of(env)
    name = symbol_arg(args, 0, env, "(defdiagnostic name :of … :reducer … :every …)")
    what = f"diagnostic {name}"
    opts, locs = _options(env, args, 1, {"of": True, "reducer": True, "every": True, "when": False}, what, raw=frozenset({"reducer"}))
    of = _kind(opts["of"], DiagnosticSource, f"{what} :of", '(grads "glob"), (params "glob") or (observed "glob")', locs["of"])
    reducer = opts["reducer"]
    if not isinstance(reducer, Symbol) or reducer.name not in REDUCERS:
        raise SxError(f"{what}: :reducer must be one of {', '.join(REDUCERS)}, got {show(reducer)}", locs["reducer"])
    every = _int(opts["every"], f"{what} :every", locs["every"])
    if name in exp.diagnostics:
        raise SxError(f"diagnostic {name} is defined twice", loc)
    when = opts.get("when", True)
    if when is not None and not isinstance(when, bool):
        raise SxError(f"{what}: :when must be true or false (a knob expression), got {show(when)}", locs["when"])
    diag = exp.diagnostics[name] = DiagnosticDef(name, of, reducer.name, every, bool(when), loc)
    env.bind_global(name, diag)
    return Shown(name)


# -- the run -----------------------------------------------------------------------------------


def _every(n: Any) -> Checkpoints:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BuiltinError(f"(every N) needs an int ≥ 1, got {show(n)}")
    return Checkpoints(n)


_RUN_OPTIONS = {
    "steps": True, "loader": True, "microbatches": False, "prepare": False, "objective": True,
    "optimizer": True, "evaluations": False, "diagnostics": False, "checkpoints": False,
    "precision": False, "seed": False, "zero-stage": False,
}  # fmt: skip


def _defrun(env: Env, args: list, loc: Location | None) -> Defined:
    """`(defrun :steps … :loader … :objective … :optimizer … …)`: required, once per experiment."""
    exp = experiment_of(env)
    if exp.run is not None:
        raise SxError(f"defrun appears twice (first at {exp.run.loc}): an experiment has one run", loc)
    opts, locs = _options(env, args, 0, _RUN_OPTIONS, "defrun")
    loader = _kind(opts["loader"], LoaderDef, "defrun :loader", "a loader (defined with defloader)", locs["loader"])
    optimizer = _kind(opts["optimizer"], OptimizerSpec, "defrun :optimizer", "an optimizer (defined with defoptimizer)", locs["optimizer"])
    for key in ("objective", "prepare"):
        if opts.get(key) is not None and not isinstance(opts[key], (Closure, Builtin)):
            raise SxError(f"defrun :{key} must be a function, got {show(opts[key])}", locs[key])
    evaluations = [_kind(e, EvaluationDef, "defrun :evaluations", "a vector of evaluations (defevaluation)", locs["evaluations"]) for e in opts.get("evaluations") or []]
    diagnostics = [_kind(d, DiagnosticDef, "defrun :diagnostics", "a vector of diagnostics (defdiagnostic)", locs["diagnostics"]) for d in opts.get("diagnostics") or []]
    checkpoints = opts.get("checkpoints")
    if isinstance(checkpoints, Symbol) and checkpoints.name == "none" or checkpoints is None:
        every = None
    elif isinstance(checkpoints, Checkpoints):
        every = checkpoints.every
    else:
        raise SxError(f"defrun :checkpoints must be none or (every N), got {show(checkpoints)}", locs["checkpoints"])
    precision = opts.get("precision", Symbol("f32"))
    if not isinstance(precision, Symbol) or precision.name not in PRECISIONS:
        raise SxError(f"defrun :precision must be {' or '.join(PRECISIONS)}, got {show(precision)}", locs.get("precision"))
    zero_stage = opts.get("zero-stage")
    if zero_stage is not None and (isinstance(zero_stage, bool) or zero_stage not in (0, 1)):
        raise SxError(f"defrun :zero-stage must be 0 (every rank keeps every optimizer state) or 1 (each rank "
                      f"keeps its shard of them, the default), got {show(zero_stage)}", locs["zero-stage"])
    run = exp.run = RunDef(
        steps=_int(opts["steps"], "defrun :steps", locs["steps"]),
        loader=loader,
        microbatches=_int(opts.get("microbatches", 1), "defrun :microbatches", locs.get("microbatches")),
        prepare=opts.get("prepare"),
        objective=opts["objective"],
        optimizer=optimizer,
        evaluations=evaluations,
        diagnostics=diagnostics,
        checkpoints=every,
        precision=precision.name,
        seed=_int(opts.get("seed", 0), "defrun :seed", locs.get("seed"), 0),
        loc=loc,
        option_locs=locs,
        zero_stage=zero_stage,
    )
    return Defined("defrun", run)


# -- emits -------------------------------------------------------------------------------------


def _emit_form(kind: str):
    def form(env: Env, args: list, loc: Location | None) -> Any:
        if len(args) != 2 or not isinstance(args[0], Symbol):
            raise SxError(f"expected ({kind} name value) with an unevaluated name", loc)
        return EMITS[kind](loc, args[0].name, env.eval(args[1], env.loc_of_arg(1)))

    return form


# -- registration ------------------------------------------------------------------------------

for _name, _form in {
    "defknobs": _defknobs, "defvariant": _defvariant, "defloader": _defloader, "defoptimizer": _defoptimizer,
    "defevaluation": _defevaluation, "defdiagnostic": _defdiagnostic, "defrun": _defrun,
}.items():  # fmt: skip
    register_special_form(_name, _definition(_name, _form))
for _kind_name in ("metric", "counter", "observe"):
    register_special_form(_kind_name, _emit_form(_kind_name))

register_builtin("token-file", _token_file, loc=True, kwargs=True)
register_builtin("text-file", _file_source("text-file"), loc=True)
register_builtin("npy-file", _file_source("npy-file"), loc=True)
register_builtin("synthetic-tokens", _synthetic_tokens, loc=True, kwargs=True)
register_builtin("sgd", _optimizer("sgd"), loc=True, kwargs=True)
register_builtin("adamw", _optimizer("adamw"), loc=True, kwargs=True)
register_builtin("group", _group, loc=True, kwargs=True)
register_builtin("linear-warmup", _schedule("linear-warmup", ("warmup",), ("warmup",)), loc=True, kwargs=True)
register_builtin("cosine", _schedule("cosine", ("steps", "floor"), ("steps",)), loc=True, kwargs=True)
register_builtin("warmup-cosine", _schedule("warmup-cosine", ("warmup", "steps", "floor"), ("warmup", "steps")), loc=True, kwargs=True)
for _kind_name in ("grads", "params", "observed"):
    register_builtin(_kind_name, _diagnostic_source(_kind_name))
register_builtin("every", _every)
#: Their errors about one argument put the caret under it.
OPERAND_LOCATED.update(
    ("sgd", "adamw", "group", "linear-warmup", "cosine", "warmup-cosine", "synthetic-tokens", "token-file")
)
