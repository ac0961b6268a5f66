"""match-patterns recognises the math however it is written: spellings generated at random, and non-matches.

Each test writes a family — softmax, log-softmax, layernorm, rmsnorm, the
cross-entropy tail — in a spelling drawn from algebraic rewrites (commuted
operands, a division as a product with the reciprocal, a mean as a sum over
a count or times its reciprocal, the reduced axis kept or reshaped back, the
shift by the row maximum present, absent or by the log-sum-exp, the negation
per row or after the reduction, rsqrt or one over sqrt or a power), compiles
a small experiment through autodiff and match-patterns, and checks that the
family fired forward and backward, with the form the spelling implies. Then
the regions that must not be taken: a softmax along another axis, a
"layernorm" whose eps is not where the formula has it (a different
function), a cross-entropy whose log-probabilities are observed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from sexpgpu.passes.manager import CompilationUnit, PassManager, parse_pipeline

PIPELINE = "evaluate,autodiff,canonicalize,cse,dce,match-patterns"
SPELLINGS = 8
WIDTH = 24


class Spelling:
    """Random algebraic spellings of the same math over a tensor of shape [2 5 WIDTH], rows along the last axis."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.forms: set[str] = set()

    def pick(self, *options: str) -> str:
        return self.rng.choice(options)

    def mul(self, a: str, b: str) -> str:
        return self.pick(f"(* {a} {b})", f"(* {b} {a})")

    def add(self, a: str, b: str) -> str:
        return self.pick(f"(+ {a} {b})", f"(+ {b} {a})")

    def sub(self, a: str, b: str) -> str:
        return self.pick(f"(- {a} {b})", f"(+ {a} (neg {b}))", f"(+ (neg {b}) {a})")

    def div(self, a: str, b: str) -> str:
        return self.pick(f"(/ {a} {b})", f"(* {a} (recip {b}))", f"(* (recip {b}) {a})")

    def row(self, op: str, x: str) -> str:
        """A reduction along the rows, its axis kept or put back."""
        return self.pick(f"({op} {x} -1 :keep true)", f"(expand-dims ({op} {x} -1) -1)",
                         f"(reshape ({op} {x} -1) [(dim {x} 0) (dim {x} 1) 1])")

    def mean(self, x: str) -> str:
        choice = self.pick("prelude", "divide", "reciprocal")
        if choice == "prelude":
            return self.pick(f"(mean {x} -1 :keep true)", f"(expand-dims (mean {x} -1) -1)")
        total = self.row("sum", x)
        if choice == "divide":
            self.forms.add("mean written as sum and divide")
            return f"(/ {total} {WIDTH}.0)"
        return self.mul(total, f"(/ 1.0 {WIDTH}.0)")

    def inverse_root(self, v: str) -> tuple[str, bool]:
        """1/sqrt(v), and whether it is to be divided by (sqrt) rather than multiplied."""
        choice = self.pick("rsqrt", "recip", "pow", "divide")
        if choice == "divide":
            self.forms.add("division by the square root")
            return f"(sqrt {v})", True
        if choice == "pow":
            self.forms.add("normalizer as a power of -1/2")
            return f"(pow {v} -0.5)", False
        if choice == "recip":
            self.forms.add("normalizer as 1/sqrt")
            return self.pick(f"(recip (sqrt {v}))", f"(/ 1.0 (sqrt {v}))"), False
        return f"(rsqrt {v})", False

    def exponentials(self, x: str) -> str:
        """exp of x shifted per row: by the maximum (the prelude), not at all, or by something else."""
        choice = self.pick("max", "max", "none", "mean")
        if choice == "max":
            return f"(exp {self.sub(x, self.row('max', x))})"
        if choice == "none":
            self.forms.add("without the max shift, computed stably")
            return f"(exp {x})"
        self.forms.add("exponentials shifted by another per-row value")
        return f"(exp {self.sub(x, self.mean(x))})"

    def softmax(self, x: str) -> str:
        if self.rng.random() < 0.25:
            self.forms.add("exp of x minus its log-sum-exp")
            return f"(exp {self.sub(x, self.lse(x))})"
        e = self.exponentials(x)
        return f"(let ((e {e})) {self.div('e', self.row('sum', 'e'))})"

    def lse(self, x: str) -> str:
        top = self.row("max", x)
        return self.add(top, f"(log {self.row('sum', f'(exp {self.sub(x, top)})')})")

    def log_softmax(self, x: str) -> str:
        choice = self.pick("shifted", "shifted", "unshifted", "lse", "log")
        if choice == "log":
            self.forms.add("log of softmax")
            return f"(log {self.softmax(x)})"
        if choice == "unshifted":
            self.forms.add("without the max shift, computed stably")
            return self.sub(x, f"(log {self.row('sum', f'(exp {x})')})")
        if choice == "lse":
            return self.sub(x, self.lse(x))
        return f"(let ((s {self.sub(x, self.row('max', x))})) {self.sub('s', self.row_log_sum_exp('s'))})"

    def row_log_sum_exp(self, s: str) -> str:
        return f"(log {self.row('sum', f'(exp {s})')})"

    def layernorm(self, x: str, eps: str) -> str:
        centred = self.sub(x, "m")
        if self.rng.random() < 0.35:
            self.forms.add("variance as mean of squares minus squared mean")
            variance = self.sub(self.mean(self.mul(x, x)), self.mul("m", "m"))
        else:
            variance = self.mean(self.pick("(* c c)", "(pow c 2.0)"))
        root, divide = self.inverse_root(self.add("v", eps))
        normed = f"(/ c {root})" if divide else self.mul("c", root)
        body = self.affine(normed, bias=True)
        return f"(let* ((m {self.mean(x)}) (c {centred}) (v {variance})) {body})"

    def rmsnorm(self, x: str, eps: str) -> str:
        root, divide = self.inverse_root(self.add(self.mean(self.mul(x, x)), eps))
        normed = f"(/ {x} {root})" if divide else self.mul(x, root)
        return self.affine(normed, bias=False)

    def affine(self, normed: str, bias: bool) -> str:
        weighted = self.rng.random() < 0.7
        biased = bias and self.rng.random() < 0.7
        out = self.mul(normed, "w") if weighted else normed
        out = self.add(out, "b") if biased else out
        absent = [name for name, present in (("weight", weighted), ("bias", biased if bias else True)) if not present]
        if absent:
            self.forms.add("without " + " and ".join(absent))
        return out

    def cross_entropy(self, logits: str) -> tuple[str, str]:
        """A loss from logits [2 5 W] and targets t [2 5], and the form it must be read as."""
        count = 10
        gather = self.rng.random() < 0.6
        source = self.pick("log-probabilities", "log-probabilities", "shifted logits", "logits")
        if source == "log-probabilities":
            row, per_row_rest = self.log_softmax(logits), None
        elif source == "shifted logits":
            row = "s"
            per_row_rest = self.row_log_sum_exp("s")
        else:
            row, per_row_rest = logits, self.lse(logits)
        if gather:
            picked = "(take-along r (expand-dims t -1) -1)"
        else:
            picked = self.row("sum", self.mul(f"(one-hot t {WIDTH})", "r"))
        log_p = picked if per_row_rest is None else self.sub(picked, per_row_rest)
        negate_per_row = self.rng.random() < 0.5
        total_of = f"(neg {log_p})" if negate_per_row else log_p
        choice = self.pick("mean", "divide", "reciprocal")
        if choice == "mean":
            total = f"(mean {total_of})"
        elif choice == "divide":
            self.forms.add("mean written as sum and divide")
            total = f"(/ (sum {total_of}) {count}.0)"
        else:
            total = self.mul(f"(sum {total_of})", f"(/ 1.0 {count}.0)")
        loss = total if negate_per_row else f"(neg {total})"
        shifted = f"(s {self.sub(logits, self.row('max', logits))})" if source == "shifted logits" else ""
        body = f"(let* ({shifted} (r {row})) {loss})"
        form = (f"{'gather' if gather else 'one-hot sum'} of {source}, "
                f"{'negated per row' if negate_per_row else 'negated after the reduction'}")
        return body, form


EXPERIMENT = """(defloader data
  :source (npy-file "points.npy")
  :fields ((x [5 {width}] f32) (t [5] i32))
  :batch 2)

(defmodule net ()
  (let ((lin (sub lin (linear {width} {width})))
        (w (param w [{width}] :init (normal 1.0)))
        (b (param b [{width}] :init (normal 1.0))))
    (fn (x)
      (let ((x (lin x)))
        {model}))))

(defmodel model (net))
(defn objective (batch)
  (let ((y (model (get batch :x))) (t (get batch :t)))
    {objective}))
(defoptimizer opt (adamw :lr 0.001))
(defrun :steps 1 :loader data :objective objective :optimizer opt)
"""
#: A loss whose gradient reaches every element of y differently (so a backward is not a special case).
SQUARES = "(sum (* y y (+ y 2.0)))"


def compile_facts(tmp_path: Path, model: str, objective: str) -> dict:
    path = tmp_path / "experiment.sx"
    path.write_text(EXPERIMENT.format(width=WIDTH, model=model, objective=objective))
    unit = CompilationUnit(path=str(path))
    PassManager(parse_pipeline(PIPELINE)).run(unit)
    return unit.facts.lowering.patterns["train"]


def fired(facts: dict, family: str) -> int:
    return facts.get(family, {}).get("fired", 0)


def forms(facts: dict, family: str) -> set[str]:
    return set(facts.get(family, {}).get("as", []))


@pytest.mark.parametrize("seed", range(SPELLINGS))
def test_softmax_spellings(tmp_path: Path, seed: int) -> None:
    spelling = Spelling(seed)
    facts = compile_facts(tmp_path, spelling.softmax("x"), SQUARES)
    assert fired(facts, "softmax") == 1 and fired(facts, "softmax_backward") == 1, facts
    assert forms(facts, "softmax") == spelling.forms, facts


@pytest.mark.parametrize("seed", range(SPELLINGS))
def test_log_softmax_spellings(tmp_path: Path, seed: int) -> None:
    spelling = Spelling(100 + seed)
    facts = compile_facts(tmp_path, spelling.log_softmax("x"), SQUARES)
    assert fired(facts, "log_softmax") == 1 and fired(facts, "log_softmax_backward") == 1, facts


@pytest.mark.parametrize("seed", range(SPELLINGS))
def test_layernorm_spellings(tmp_path: Path, seed: int) -> None:
    spelling = Spelling(200 + seed)
    eps = spelling.pick("1e-5", "0.001")
    facts = compile_facts(tmp_path, spelling.layernorm("x", eps), SQUARES)
    assert fired(facts, "layernorm") == 1 and fired(facts, "layernorm_backward") == 1, facts
    assert forms(facts, "layernorm") == spelling.forms, facts


@pytest.mark.parametrize("seed", range(SPELLINGS))
def test_rmsnorm_spellings(tmp_path: Path, seed: int) -> None:
    spelling = Spelling(300 + seed)
    facts = compile_facts(tmp_path, spelling.rmsnorm("x", "1e-6"), SQUARES)
    assert fired(facts, "rmsnorm") == 1 and fired(facts, "rmsnorm_backward") == 1, facts
    assert forms(facts, "rmsnorm") == spelling.forms, facts


@pytest.mark.parametrize("seed", range(SPELLINGS))
def test_cross_entropy_spellings(tmp_path: Path, seed: int) -> None:
    spelling = Spelling(400 + seed)
    loss, form = spelling.cross_entropy("y")
    facts = compile_facts(tmp_path, "x", loss)
    assert fired(facts, "cross_entropy_forward") == 1 and fired(facts, "cross_entropy_backward") == 1, facts
    expected = {form} | (spelling.forms & {"mean written as sum and divide"})
    assert forms(facts, "cross_entropy_forward") == expected, facts


def test_softmax_along_another_axis_falls_back(tmp_path: Path) -> None:
    facts = compile_facts(tmp_path, "(softmax x 1)", SQUARES)
    assert fired(facts, "softmax") == 0
    (entry,) = facts["softmax"]["fell_back"]
    assert entry["reason"] == "rows along axis 1 of 3, not the last"


def test_layernorm_with_eps_outside_the_root_is_not_one(tmp_path: Path) -> None:
    wrong = "(let* ((m (mean x -1 :keep true)) (c (- x m))) (/ c (+ (sqrt (mean (* c c) -1 :keep true)) 1e-5)))"
    facts = compile_facts(tmp_path, wrong, SQUARES)
    assert "layernorm" not in facts and "rmsnorm" not in facts, facts


def test_observed_log_probabilities_make_the_loss_fall_back(tmp_path: Path) -> None:
    loss = "(let ((logp (log-softmax y -1))) (observe logp logp) (neg (mean (take-along logp (expand-dims t -1) -1))))"
    facts = compile_facts(tmp_path, "x", loss)
    assert fired(facts, "cross_entropy_forward") == 0
    (entry,) = facts["cross_entropy_forward"]["fell_back"]
    assert entry["reason"] == "an observation (model.logp) reads a value inside the region" or \
        entry["reason"].startswith("an observation (")
