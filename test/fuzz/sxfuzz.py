"""A grammar-aware fuzzer for sexpgpu: mutated `.sx` (and `.sxir`) files through every verb.

The contract (docs/verbs, the spec's verbs.md) is that no input makes sexpgpu
exit 3, print a Python traceback, hang, or exit 1 without a
`file:line:col: error:` location. This module makes the inputs and judges the
outcomes; `test_fuzz.py` runs a fixed, seeded sample of cases in CI and
`benchmarks/fuzz_campaign.py` runs as many as one asks for.

- **Seeds** are the project's examples (`examples/*.sx`, `examples/lib/*.sx`)
  and lit inputs (`test/lit/**/*.sx`, and `*.sxir` for `sexpgpu-opt`'s parser).
  They are copied into a scratch tree, so a mutant sits where its seed was and
  its `require`s and data paths still resolve; a mutated library is run through
  the file that requires it.
- **Mutations** work on the tokens of the text (the reader's token classes:
  brackets, prefixes, strings, numbers, symbols, keywords, comments) and on its
  bytes: token deletion, duplication and swaps, unbalanced brackets, extreme
  numbers, shape edits, deep nesting, form deletion and splicing (also across
  seeds), symbol replacement, dropped keyword arguments, calls with an argument
  more or fewer, arguments of another type, string damage, bad bytes, a
  byte-order mark, non-UTF-8 text, truncation. A case stacks one to
  three of them, all drawn from a `random.Random(seed)`, so a case number
  always makes the same input.
- **Verbs**: the seed's own lit RUN lines when it has them, else one of
  `check`, `explain` (text or `--json`), `diff SEED MUTANT`, `eval`, `knobs`,
  `ir`, or `sexpgpu-opt` with a pipeline; with the seed's variants and knobs,
  and sometimes hostile `--set` values, as selection flags.
- **Running**: each case runs in a child forked from this process (the
  compiler is imported once, so a case costs its compilation, not an
  interpreter start), with its stdout discarded, its stderr kept, an
  address-space limit and a wall-clock bound; `run_subprocess` runs a case as
  a real command instead.
"""

from __future__ import annotations

import os
import random
import re
import resource
import shlex
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Outcome classes, in the order reports list them; the last four are bugs.
OUTCOMES = ("exit 0", "located 1", "exit 2", "exit 130", "exit 3", "traceback", "hang", "unlocated 1", "signal", "other")
BAD_OUTCOMES = frozenset({"exit 3", "traceback", "hang", "unlocated 1", "signal", "other"})

_LOCATED = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): error: ")

# -- the seeds --------------------------------------------------------------------------------


@dataclass
class Seed:
    """A seed file: where it is (relative to the scratch tree), its bytes and how to run it."""

    rel: str
    data: bytes
    #: The file the verbs are given: the seed itself, or the file that requires it.
    entry: str
    #: Command lines from the seed's lit RUN lines, with `%s` for the file.
    runs: list[list[str]] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)
    knobs: list[str] = field(default_factory=list)

    @property
    def is_sx(self) -> bool:
        return self.rel.endswith(".sx")


_REQUIRE = re.compile(rb'\(require\s+"([^"]+)"')
_VARIANT = re.compile(rb"\(defvariant\s+([^\s()\[\]{}]+)")
_KNOBS_FORM = re.compile(rb"\(defknobs\b(.*?)(?=^\(|\Z)", re.S | re.M)
_KNOB = re.compile(rb"\(\s*([A-Za-z][\w\-]*)\s+[^\s()\[\]{}\"]+\s*(?:\"[^\"]*\")?\s*\)")
_RUN_LINE = re.compile(r"(?://|;+)\s*RUN:\s*(.*)$")


def seed_paths(root: Path = ROOT) -> list[Path]:
    """Every seed file, sorted, below `root`: examples and lit inputs (not lit's `Output`)."""
    found = sorted((root / "examples").glob("*.sx")) + sorted((root / "examples" / "lib").glob("*.sx"))
    for path in sorted((root / "test" / "lit").rglob("*")):
        if path.suffix in (".sx", ".sxir") and "Output" not in path.parts and path.is_file():
            found.append(path)
    return found


def _run_commands(text: str) -> list[list[str]]:
    """The sexpgpu/sexpgpu-opt command lines of a file's RUN lines, `%s` kept, pipes and redirections cut."""
    commands = []
    for line in text.splitlines():
        m = _RUN_LINE.search(line)
        if m is None:
            continue
        command = re.split(r"\||2>&1|>|<", m.group(1))[0]
        try:
            words = shlex.split(command)
        except ValueError:
            continue
        if words[:1] == ["not"]:
            words = words[1:]
        if not words or words[0] not in ("sexpgpu", "sexpgpu-opt") or "%s" not in words:
            continue
        if any("%" in w and w != "%s" for w in words) or "--verify-diagnostics" in words:
            continue
        commands.append(words)
    return commands


def load_seeds(root: Path = ROOT) -> list[Seed]:
    paths = seed_paths(root)
    seeds = []
    required_by: dict[Path, Path] = {}
    for path in paths:
        if path.suffix == ".sx":
            for target in _REQUIRE.findall(path.read_bytes()):
                required_by.setdefault((path.parent / target.decode()).resolve(), path)
    for path in paths:
        data = path.read_bytes()
        rel = str(path.relative_to(root))
        entry_path = required_by.get(path.resolve(), path)
        entry = str(entry_path.relative_to(root))
        entry_data = entry_path.read_bytes()
        seeds.append(
            Seed(
                rel=rel,
                data=data,
                entry=entry,
                runs=_run_commands(entry_data.decode("utf-8", "replace")),
                variants=sorted({v.decode() for v in _VARIANT.findall(entry_data)}),
                knobs=sorted({k.decode() for form in _KNOBS_FORM.findall(entry_data) for k in _KNOB.findall(form)}),
            )
        )
    return seeds


def make_scratch_tree(root: Path = ROOT) -> Path:
    """A copy of `examples/` and `test/lit/` (without lit's outputs) to write mutants into."""
    scratch = Path(tempfile.mkdtemp(prefix="sxfuzz-"))
    shutil.copytree(root / "examples", scratch / "examples")
    shutil.copytree(root / "test" / "lit", scratch / "test" / "lit", ignore=shutil.ignore_patterns("Output", "*.pyc"))
    return scratch


# -- the mutator ------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""(?P<string>"(?:[^"\\]|\\.)*"?)
      | (?P<comment>;[^\n]*|\#\|.*?(?:\|\#|$))
      | (?P<open>[(\[{])
      | (?P<close>[)\]}])
      | (?P<prefix>,@|[',`]|\#_)
      | (?P<space>\s+)
      | (?P<atom>[^\s()\[\]{}"';,`]+)
      | (?P<other>.)""",
    re.X | re.S,
)
_NUMBER = re.compile(r"^[+-]?(?:\d[\d_]*\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|inf|nan)$")
_CLOSER = {"(": ")", "[": "]", "{": "}"}

#: Numbers a careless or hostile user writes: zero, negatives, the float limits, huge integers.
EXTREME_NUMBERS = (
    "0", "-1", "-3", "1", "2", "0.0", "-0.0", "1e308", "1e309", "-1e308", "5e-324", "1e-320", "nan", "inf",
    "-inf", "2147483648", "4294967296", "9223372036854775808", "-9223372036854775809", "1e30", "1e-30",
    "1000000000", "12345678901234567890", "0x10", "1_000", "1.5", "3.0", "100000",
    "1" + "0" * 400, "9" * 5000,
)  # fmt: skip

#: Symbols spliced in: special forms, built-ins, experiment forms, names no one defined.
SYMBOLS = (
    "let", "let*", "fn", "defn", "defmacro", "if", "cond", "do", "quote", "quasiquote", "loop", "recur",
    "get", "assoc", "contains?", "keys", "vals", "range", "iota", "map", "reduce", "apply", "concat", "nth",
    "sqrt", "pow", "max", "min", "exp", "log", "sum", "mean", "softmax", "matmul", "reshape", "transpose",
    "param", "defmodule", "defmodel", "defloader", "defrun", "defknobs", "defvariant", "defoptimizer",
    "defeval", "defdiagnostic", "require", "adamw", "sgd", "synthetic-tokens", "token-file", "npy-file",
    "causal-mask", "layer-norm", "cast", "f32", "bf16", "i32", "nil", "true", "false", "=", "+", "-", "*",
    "/", "macroexpand-1", "gensym", "print", "error", "str", "undefined-name", "&rest", "&key", "&optional",
)  # fmt: skip

#: Text inserted as bad bytes: NUL, stray UTF-8 lead and continuation bytes, controls, a bidi override.
BAD_BYTES = (
    b"\x00", b"\xff", b"\xfe", b"\xc3", b"\x80", b"\xbf", b"\xed\xa0\x80", b"\x1b[31m", b"\x7f", b"\x0c",
    b"\r", b"\r\n", b"\t", b"\xe2\x80\xae", b"\xef\xbb\xbf", b"\xc0\xaf", b"\xf4\x90\x80\x80",
)  # fmt: skip

#: Strings inserted whole: an unterminated one, bad escapes, a long one.
STRINGS = ('"', '"abc', '"\\q"', '"\\', '"\\u0041"', '"' + "x" * 5000 + '"', '""', '"\\n\\t\\\\"', '"#|"')


@dataclass
class Token:
    kind: str
    start: int
    end: int


class Mutant:
    """The text under mutation, as tokens; bytes-level edits go through `data`."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "surrogateescape")

    def set_text(self, text: str) -> None:
        self.data = text.encode("utf-8", "surrogateescape")

    def tokens(self) -> list[Token]:
        return [Token(m.lastgroup, m.start(), m.end()) for m in _TOKEN.finditer(self.text) if m.lastgroup != "space"]

    def forms(self) -> list[tuple[int, int]]:
        """Spans of balanced forms (atoms, strings and bracketed forms)."""
        text_tokens = self.tokens()
        spans, stack = [], []
        for tok in text_tokens:
            if tok.kind == "open":
                stack.append(tok.start)
            elif tok.kind == "close":
                if stack:
                    spans.append((stack.pop(), tok.end))
            elif tok.kind in ("atom", "string"):
                spans.append((tok.start, tok.end))
        return spans

    def replace(self, start: int, end: int, new: str) -> None:
        text = self.text
        self.set_text(text[:start] + new + text[end:])


def _pick(rng: random.Random, items: list) -> object | None:
    return rng.choice(items) if items else None


def _m_delete_token(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    tok = _pick(rng, m.tokens())
    if tok is None:
        return "delete-token (none)"
    m.replace(tok.start, tok.end, "")
    return f"delete-token {tok.kind}@{tok.start}"


def _m_duplicate_token(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    tok = _pick(rng, m.tokens())
    if tok is None:
        return "duplicate-token (none)"
    piece = m.text[tok.start : tok.end]
    m.replace(tok.end, tok.end, " " + piece)
    return f"duplicate-token {tok.kind}@{tok.start}"


def _m_swap_tokens(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    toks = m.tokens()
    if len(toks) < 2:
        return "swap-tokens (none)"
    i = rng.randrange(len(toks) - 1)
    j = i + 1 if rng.random() < 0.5 else rng.randrange(len(toks))
    a, b = sorted((toks[i], toks[j]), key=lambda t: t.start)
    if a.start == b.start:
        return "swap-tokens (same)"
    text = m.text
    m.set_text(text[: a.start] + text[b.start : b.end] + text[a.end : b.start] + text[a.start : a.end] + text[b.end :])
    return f"swap-tokens {a.kind}@{a.start} {b.kind}@{b.start}"


def _m_unbalance(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    toks = [t for t in m.tokens() if t.kind in ("open", "close")]
    if toks and rng.random() < 0.5:
        tok = rng.choice(toks)
        m.replace(tok.start, tok.end, "")
        return f"drop-bracket@{tok.start}"
    at = rng.randrange(len(m.text) + 1)
    bracket = rng.choice("()[]{}")
    m.replace(at, at, bracket)
    return f"insert-bracket {bracket}@{at}"


def _m_extreme_number(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    text = m.text
    numbers = [t for t in m.tokens() if t.kind == "atom" and _NUMBER.match(text[t.start : t.end])]
    value = rng.choice(EXTREME_NUMBERS)
    if not numbers:
        return "extreme-number (none)"
    tok = rng.choice(numbers)
    m.replace(tok.start, tok.end, value)
    return f"extreme-number {value[:24]}@{tok.start}"


_SHAPE = re.compile(r"\[(\s*[-+]?\d+(?:\s+[-+]?\d+)*\s*)\]")


def _m_shape_edit(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    text = m.text
    shapes = list(_SHAPE.finditer(text))
    if not shapes:
        return "shape-edit (none)"
    shape = rng.choice(shapes)
    dims = shape.group(1).split()
    how = rng.choice(("zero", "negative", "huge", "drop", "add", "empty", "float", "nest", "symbol"))
    i = rng.randrange(len(dims))
    if how == "zero":
        dims[i] = "0"
    elif how == "negative":
        dims[i] = rng.choice(("-1", "-3", "-65536"))
    elif how == "huge":
        dims[i] = rng.choice(("2147483648", "1000000000000", "99999999999999999999"))
    elif how == "drop":
        del dims[i]
    elif how == "add":
        dims.insert(i, rng.choice(("1", "2", "7", "0")))
    elif how == "empty":
        dims = []
    elif how == "float":
        dims[i] = "2.5"
    elif how == "nest":
        dims[i] = f"[{dims[i]}]"
    else:
        dims[i] = rng.choice(("width", "nil", ":k", '"4"'))
    m.replace(shape.start(), shape.end(), "[" + " ".join(dims) + "]")
    return f"shape-edit {how}@{shape.start()}"


def _m_deep_nesting(m: Mutant, rng: random.Random, donors: list[bytes], max_depth: int = 3000) -> str:
    forms = m.forms()
    if not forms:
        return "deep-nesting (none)"
    start, end = rng.choice(forms)
    depth = rng.choice((30, 200, 1000, max_depth))
    opener = rng.choice(("(", "[", "(do ", "(list ", "(let [] ", "'(", "`("))
    closer = ")" if opener.startswith(("(", "'(", "`(")) else "]"
    text = m.text
    m.set_text(text[:start] + opener * depth + text[start:end] + closer * depth + text[end:])
    return f"deep-nesting {opener.strip()}x{depth}@{start}"


def _m_delete_form(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    forms = m.forms()
    if not forms:
        return "delete-form (none)"
    start, end = rng.choice(forms)
    m.replace(start, end, "")
    return f"delete-form@{start}"


def _m_splice_form(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    donor = Mutant(rng.choice(donors)) if donors and rng.random() < 0.5 else m
    forms = donor.forms()
    if not forms:
        return "splice-form (none)"
    start, end = rng.choice(forms)
    piece = donor.text[start:end]
    targets = m.forms()
    if targets and rng.random() < 0.6:
        t_start, t_end = rng.choice(targets)
        m.replace(t_start, t_end, piece)
        return f"replace-form@{t_start} with {len(piece)} chars"
    at = rng.randrange(len(m.text) + 1)
    m.replace(at, at, " " + piece + " ")
    return f"insert-form@{at} {len(piece)} chars"


def _m_replace_symbol(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    text = m.text
    atoms = [t for t in m.tokens() if t.kind == "atom" and not _NUMBER.match(text[t.start : t.end])]
    if not atoms:
        return "replace-symbol (none)"
    tok = rng.choice(atoms)
    pool = [text[t.start : t.end] for t in atoms]
    new = rng.choice(SYMBOLS) if rng.random() < 0.6 else rng.choice(pool)
    m.replace(tok.start, tok.end, new)
    return f"replace-symbol {new}@{tok.start}"


#: Values of every type, spliced where a form was: the argument checks of built-ins and special forms.
TYPED_VALUES = (
    "[1 2]", "[]", "{:a 1}", "{[1 2] 3}", "{}", ":k", '"s"', "nil", "true", "-3", "0", "1.5", "(pow 10 400)",
    "1e308", "'sym", "(fn (x) x)", "(list)", "[[1 2] [3]]", "f32", "-inf", "(iota [-3] 0)", "(causal-mask -1)",
)  # fmt: skip


def _list_spans(m: Mutant) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Each `( … )` form: its span and its direct elements' spans."""
    text_tokens = m.tokens()
    out, stack = [], []
    for tok in text_tokens:
        if tok.kind == "open":
            stack.append((tok.start, m.text[tok.start], []))
        elif tok.kind == "close" and stack:
            start, opener, elements = stack.pop()
            if opener == "(":
                out.append((start, tok.end, elements))
            if stack:
                stack[-1][2].append((start, tok.end))
        elif tok.kind in ("atom", "string") and stack:
            stack[-1][2].append((tok.start, tok.end))
    return out


def _m_arity(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    """A call with one argument more, one fewer, or a stray keyword argument."""
    calls = [c for c in _list_spans(m) if len(c[2]) >= 2]
    if not calls:
        return "arity (none)"
    start, end, elements = rng.choice(calls)
    how = rng.choice(("extra", "fewer", "keyword"))
    text = m.text
    if how == "fewer":
        a, b = rng.choice(elements[1:])
        m.replace(a, b, "")
    elif how == "extra":
        a, b = rng.choice(elements[1:])
        m.replace(end - 1, end - 1, " " + text[a:b])
    else:
        m.replace(end - 1, end - 1, rng.choice((" :foo 1", " :foo", " :groups 1e-8", " :lr -1", " :betas [2 0.5]")))
    return f"arity {how}@{start}"


def _m_typed_value(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    """An argument replaced by a value of another type."""
    calls = [c for c in _list_spans(m) if len(c[2]) >= 2]
    if not calls:
        return "typed-value (none)"
    start, end, elements = rng.choice(calls)
    a, b = rng.choice(elements[1:])
    value = rng.choice(TYPED_VALUES)
    m.replace(a, b, value)
    return f"typed-value {value}@{a}"


def _m_drop_keyword_arg(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    text = m.text
    toks = m.tokens()
    keys = [i for i, t in enumerate(toks) if t.kind == "atom" and text[t.start] == ":" and i + 1 < len(toks)]
    if not keys:
        return "drop-keyword (none)"
    i = rng.choice(keys)
    value_end = next((end for start, end in m.forms() if start == toks[i + 1].start), toks[i + 1].end)
    m.replace(toks[i].start, value_end, "")
    return f"drop-keyword {text[toks[i].start : toks[i].end]}@{toks[i].start}"


def _m_string(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    piece = rng.choice(STRINGS)
    strings = [t for t in m.tokens() if t.kind == "string"]
    if strings and rng.random() < 0.5:
        tok = rng.choice(strings)
        m.replace(tok.start, tok.end, piece)
        return f"replace-string {piece[:10]!r}@{tok.start}"
    at = rng.randrange(len(m.text) + 1)
    m.replace(at, at, piece)
    return f"insert-string {piece[:10]!r}@{at}"


def _m_bad_bytes(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    piece = rng.choice(BAD_BYTES)
    at = rng.randrange(len(m.data) + 1)
    m.data = m.data[:at] + piece + m.data[at:]
    return f"bad-bytes {piece!r}@{at}"


def _m_bom(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    m.data = b"\xef\xbb\xbf" + m.data
    return "byte-order-mark"


def _m_latin1(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    """Re-encode a stretch of the text (or a comment's words) as Latin-1: not UTF-8 any more."""
    at = rng.randrange(len(m.data) + 1)
    m.data = m.data[:at] + rng.choice(("; café\n", "\"naïve\"", "é", "ü ")).encode("latin-1") + m.data[at:]
    return f"latin-1@{at}"


def _m_truncate(m: Mutant, rng: random.Random, donors: list[bytes]) -> str:
    at = rng.randrange(len(m.data) + 1)
    m.data = m.data[:at]
    return f"truncate@{at}"


MUTATIONS = {
    "delete-token": (_m_delete_token, 10),
    "duplicate-token": (_m_duplicate_token, 6),
    "swap-tokens": (_m_swap_tokens, 8),
    "unbalance": (_m_unbalance, 5),
    "extreme-number": (_m_extreme_number, 14),
    "shape-edit": (_m_shape_edit, 10),
    "deep-nesting": (_m_deep_nesting, 3),
    "delete-form": (_m_delete_form, 8),
    "splice-form": (_m_splice_form, 8),
    "replace-symbol": (_m_replace_symbol, 10),
    "drop-keyword": (_m_drop_keyword_arg, 6),
    "string": (_m_string, 3),
    "bad-bytes": (_m_bad_bytes, 3),
    "byte-order-mark": (_m_bom, 2),
    "latin-1": (_m_latin1, 2),
    "truncate": (_m_truncate, 2),
    "arity": (_m_arity, 8),
    "typed-value": (_m_typed_value, 8),
}


def mutate(data: bytes, rng: random.Random, donors: list[bytes], count: int | None = None,
           max_depth: int = 3000) -> tuple[bytes, list[str]]:
    """`data` after one to three mutations drawn from `rng`; returns the bytes and what was done."""
    names = list(MUTATIONS)
    weights = [MUTATIONS[n][1] for n in names]
    m = Mutant(data)
    done = []
    for name in rng.choices(names, weights, k=count or rng.choice((1, 1, 1, 2, 2, 3))):
        fn = MUTATIONS[name][0]
        done.append(_m_deep_nesting(m, rng, donors, max_depth) if fn is _m_deep_nesting else fn(m, rng, donors))
    return m.data, done


# -- the command lines ------------------------------------------------------------------------

#: `--set` values that stress a knob's parsing and the checks behind it.
HOSTILE_VALUES = ("nan", "inf", "-inf", "-1", "0", "1e308", "2147483648", "abc", "true", "1e-30", "-0.5", "f32", "")

#: sexpgpu-opt pipelines the fuzzer runs on `.sx` files.
SX_PIPELINES = (
    "read", "read,macro-expand", "evaluate", "print-values", "evaluate,autodiff,cse,dce",
    "evaluate,autodiff,diagnose,accumulate,build-updates,fold-constants,insert-casts,canonicalize,cse,dce,plan-memory",
    "evaluate,autodiff,diagnose,accumulate,stack,build-updates,fold-constants,insert-casts,canonicalize,cse,dce,"
    "plan-memory,explain",
    "evaluate,autodiff,build-updates,ir-json{compact=true}",
)  # fmt: skip
#: sexpgpu-opt pipelines for textual IR.
IR_PIPELINES = ("", "verify", "canonicalize,cse,dce", "autodiff,cse,dce", "canonicalize,fold-constants,plan-memory")

#: The share of cases mutating `.sx` seeds (the rest mutate textual IR).
SX_SHARE = 0.85

SX_VERBS = (
    ("check", 4), ("explain", 3), ("explain-json", 1), ("diff", 2), ("eval", 3), ("knobs", 1), ("ir", 1), ("opt", 4),
)  # fmt: skip


@dataclass
class Case:
    """One input and one command line: what a fuzz case runs."""

    number: int
    seed: Seed
    data: bytes
    mutations: list[str]
    #: argv after the program name; `{file}` stands for the mutant, `{seed}` for the unmutated entry.
    argv: list[str]
    program: str  # "sexpgpu" or "sexpgpu-opt"

    def describe(self) -> str:
        words = [self.program, *(w.replace("{file}", self.seed.entry).replace("{seed}", "PRISTINE/" + self.seed.entry)
                                 for w in self.argv)]
        return " ".join(shlex.quote(w) for w in words)


def _selection(seed: Seed, rng: random.Random) -> list[str]:
    words: list[str] = []
    if seed.variants and rng.random() < 0.5:
        words += ["--variant", rng.choice(seed.variants)]
    if rng.random() < 0.12:
        words += ["--variant", rng.choice(("nope", "smok", ""))]
    if seed.knobs and rng.random() < 0.25:
        words += ["--set", f"{rng.choice(seed.knobs)}={rng.choice(HOSTILE_VALUES)}"]
    elif rng.random() < 0.05:
        words += ["--set", f"no-such-knob={rng.choice(HOSTILE_VALUES)}"]
    return words


def command_line(seed: Seed, rng: random.Random) -> tuple[str, list[str]]:
    """A command line for a mutant of `seed`: one of its RUN lines, or a verb drawn from `rng`."""
    if not seed.is_sx:
        return "sexpgpu-opt", ["{file}", "-p", rng.choice(IR_PIPELINES)] + (["--split-input-file"] if rng.random() < 0.3 else [])
    if seed.runs and rng.random() < 0.35:
        words = rng.choice(seed.runs)
        return words[0], ["{file}" if w == "%s" else w for w in words[1:]]
    verbs = [v for v, _ in SX_VERBS]
    verb = rng.choices(verbs, [w for _, w in SX_VERBS])[0]
    selection = _selection(seed, rng)
    if verb == "opt":
        extra = ["--split-input-file"] if rng.random() < 0.15 else []
        return "sexpgpu-opt", ["{file}", "-p", rng.choice(SX_PIPELINES), *extra, *selection]
    if verb == "explain-json":
        return "sexpgpu", ["explain", "{file}", "--json", *selection]
    if verb == "diff":
        return "sexpgpu", ["diff", "{seed}", "{file}", *selection]
    if verb == "ir":
        return "sexpgpu", ["ir", "{file}", "--compact", *selection]
    return "sexpgpu", [verb, "{file}", *selection]


def make_cases(seeds: list[Seed], count: int, seed: str | int = 0, start: int = 0,
               max_depth: int = 3000) -> Iterator[Case]:
    """`count` cases numbered from `start`; case n depends only on (seed, n) and the seeds."""
    sx_seeds = [s for s in seeds if s.is_sx]
    ir_seeds = [s for s in seeds if not s.is_sx]
    donors = [s.data for s in sx_seeds]
    for number in range(start, start + count):
        rng = random.Random(f"{seed}:{number}")
        chosen = rng.choice(sx_seeds if rng.random() < SX_SHARE or not ir_seeds else ir_seeds)
        data, done = mutate(chosen.data, rng, donors if chosen.is_sx else [s.data for s in seeds if not s.is_sx],
                            max_depth=max_depth)
        program, argv = command_line(chosen, rng)
        yield Case(number, chosen, data, done, argv, program)


# -- running ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    case: Case
    kind: str
    returncode: int | None
    stderr: str
    seconds: float

    @property
    def bad(self) -> bool:
        return self.kind in BAD_OUTCOMES


def classify(returncode: int | None, stderr: str, timed_out: bool) -> str:
    """The outcome class of one run (see OUTCOMES)."""
    if timed_out:
        return "hang"
    if returncode is None or returncode < 0:
        return "signal"
    if "Traceback (most recent call last)" in stderr and returncode != 3:
        return "traceback"
    if returncode == 0:
        return "exit 0"
    if returncode == 3:
        return "exit 3"
    if returncode == 2:
        return "exit 2"
    if returncode == 130:
        return "exit 130"
    if returncode == 1:
        first = next((line for line in stderr.splitlines() if "error:" in line), "")
        m = _LOCATED.match(first)
        located = m is not None and int(m.group("line")) >= 1 and int(m.group("col")) >= 1
        return "located 1" if located else "unlocated 1"
    return "other"


class Workspace:
    """Scratch trees the cases write their mutants into: one per slot (cases run in parallel) and a
    pristine one, where `diff` finds the unmutated seed.

    A mutant is written over its seed's copy in its slot's tree (so a mutated library is seen
    by the file that requires it, and messages name the seed's file) and put back afterwards.
    """

    def __init__(self, slots: int = 1, root: Path = ROOT) -> None:
        self.base = make_scratch_tree(root)
        self.slots = [make_scratch_tree(root) for _ in range(slots)]

    def close(self) -> None:
        for tree in [self.base, *self.slots]:
            shutil.rmtree(tree, ignore_errors=True)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, case: Case, slot: int) -> list[str]:
        """Write the mutant into the slot's tree; returns the command line's words."""
        tree = self.slots[slot]
        (tree / case.seed.rel).write_bytes(case.data)
        return [w.replace("{file}", str(tree / case.seed.entry)).replace("{seed}", str(self.base / case.seed.entry))
                for w in case.argv]

    def restore(self, case: Case, slot: int) -> None:
        (self.slots[slot] / case.seed.rel).write_bytes(case.seed.data)


def _child(program: str, argv: list[str], stderr_path: str, memory_bytes: int) -> None:
    """In the forked child: limits, output files, then the tool's main; never returns."""
    code = 99
    try:
        if memory_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        devnull = os.open(os.devnull, os.O_RDWR)
        err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.dup2(err, 2)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import sys

        # The streams may be a test runner's captures (other descriptors): use the ones just set up.
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        sys.argv = [program, *argv]
        if program == "sexpgpu-opt":
            from sexpgpu.tools.opt import main
        else:
            from sexpgpu.tools.main import main
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 2
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 98
    finally:
        os._exit(code if isinstance(code, int) else 97)


def preload() -> None:
    """Import what every case needs once, before forking (so a case pays only for its own work)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from sexpgpu.passes import load_all
    from sexpgpu.tools import check_cmd, diff_cmd, eval_cmd, explain_cmd, ir_cmd, knobs_cmd, main, opt  # noqa: F401

    load_all()
    from sexpgpu.frontend.evaluator import Evaluator  # noqa: F401
    from sexpgpu.frontend.reader import read_text

    read_text("(warm)", "<warm>")  # builds the scanner


class Runner:
    """Runs cases in forked children, `jobs` at a time, each bounded by `timeout` seconds."""

    def __init__(self, workspace: Workspace, timeout: float = 20.0, memory_bytes: int = 6 << 30) -> None:
        self.workspace = workspace
        self.timeout = timeout
        self.memory_bytes = memory_bytes
        preload()

    def run(self, cases: Iterable[Case]) -> Iterator[Outcome]:
        """Every case's outcome, in completion order."""
        free_slots = list(range(len(self.workspace.slots)))
        running: dict[int, tuple[Case, int, float, str]] = {}
        pending = iter(cases)
        exhausted = False
        while True:
            while free_slots and not exhausted:
                case = next(pending, None)
                if case is None:
                    exhausted = True
                    break
                slot = free_slots.pop()
                argv = self.workspace.write(case, slot)
                stderr_path = str(self.workspace.slots[slot] / ".stderr")
                pid = os.fork()
                if pid == 0:
                    os.chdir(self.workspace.slots[slot])
                    _child(case.program, argv, stderr_path, self.memory_bytes)
                running[pid] = (case, slot, time.monotonic(), stderr_path)
            if not running:
                return
            time.sleep(0.002)
            for pid in list(running):
                case, slot, started, stderr_path = running[pid]
                done, status = os.waitpid(pid, os.WNOHANG)
                timed_out = False
                returncode: int | None = None
                if done == 0:
                    if time.monotonic() - started < self.timeout:
                        continue
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    timed_out = True
                else:
                    returncode = os.waitstatus_to_exitcode(status)
                del running[pid]
                seconds = time.monotonic() - started
                stderr = Path(stderr_path).read_text("utf-8", "replace") if os.path.exists(stderr_path) else ""
                self.workspace.restore(case, slot)
                free_slots.append(slot)
                yield Outcome(case, classify(returncode, stderr, timed_out), returncode, stderr, seconds)


def run_subprocess(case: Case, workspace: Workspace, timeout: float = 60.0) -> Outcome:
    """Run one case as a real command (the installed entry point), for exit codes and stderr end to end."""
    import subprocess
    import sys

    argv = workspace.write(case, 0)
    program = str(Path(sys.executable).with_name(case.program))
    started = time.monotonic()
    try:
        proc = subprocess.run([program, *argv], cwd=workspace.slots[0], capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        stderr = proc.stderr.decode("utf-8", "replace")
        outcome = Outcome(case, classify(proc.returncode, stderr, False), proc.returncode, stderr,
                          time.monotonic() - started)
    except subprocess.TimeoutExpired as e:
        stderr = (e.stderr or b"").decode("utf-8", "replace")
        outcome = Outcome(case, "hang", None, stderr, time.monotonic() - started)
    finally:
        workspace.restore(case, 0)
    return outcome


def save_reproducer(outcome: Outcome, folder: Path) -> Path:
    """Write a bad outcome's input, command line and stderr to `folder/<class>-<case>/`."""
    case = outcome.case
    where = folder / f"{outcome.kind.replace(' ', '-')}-{case.number}"
    where.mkdir(parents=True, exist_ok=True)
    name = Path(case.seed.rel).name
    (where / name).write_bytes(case.data)
    (where / "command").write_text(
        f"# seed {case.seed.rel} (entry {case.seed.entry}); mutations: {'; '.join(case.mutations)}\n"
        f"# run from a copy of the repository with {case.seed.rel} replaced by ./{name}\n"
        f"{case.describe()}\n"
    )
    (where / "stderr").write_text(outcome.stderr)
    return where


def signature(outcome: Outcome) -> str:
    """What groups bad outcomes of one cause: the class and the innermost frame of the trace or the message."""
    if outcome.kind in ("exit 3", "traceback"):
        frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', outcome.stderr)
        last = outcome.stderr.strip().splitlines()[-1] if outcome.stderr.strip() else ""
        where = f"{Path(frames[-1][0]).name}:{frames[-1][1]}" if frames else "?"
        return f"{outcome.kind}: {where}: {last.split(':')[0]}"
    if outcome.kind == "unlocated 1":
        first = next((line for line in outcome.stderr.splitlines() if "error:" in line), "")
        return "unlocated 1: " + re.sub(r"'[^']*'|\d+", "_", first)[:100]
    return outcome.kind
