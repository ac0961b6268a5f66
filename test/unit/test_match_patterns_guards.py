"""A guard is never dropped: regions with clamps at random constants, in random places and spellings.

Each example writes a layernorm, an rmsnorm or a cross-entropy tail with a
guard that matters for some input — the variance or mean square floored at a
positive constant (a row of zeros reaches it), log-probabilities floored at a
negative one or probabilities at a positive one before their log (logits of
large scale reach them) — spelled as `maximum` either way round or as a
`where` against a comparison. Whatever the family's recognition decides, the
guard must survive it: it is either computed as written outside every kernel
(its op is still in the lowered train graph) or the region is refused with a
`fell back` line that names it. The same region with the guard's constant
written as an eps added (the families' own form) is still recognised.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from sexpgpu.passes.manager import CompilationUnit, PassManager, parse_pipeline
from test_match_patterns_spellings import EXPERIMENT, PIPELINE, SQUARES, WIDTH, Spelling, fired

GUARDS = ("graph.maximum", "graph.minimum", "graph.where")


def floored(value: str, constant: str, spelling: str) -> str:
    """`value` floored at `constant`."""
    return {"max": f"(maximum {value} {constant})", "max swapped": f"(maximum {constant} {value})",
            "where": f"(where (< {value} {constant}) {constant} {value})"}[spelling]


def guarded_norm(spelling: Spelling, family: str, constant: str, how: str) -> str:
    if family == "layernorm":
        root, divide = spelling.inverse_root(floored("v", constant, how))
        normed = f"(/ c {root})" if divide else spelling.mul("c", root)
        return (f"(let* ((m {spelling.mean('x')}) (c {spelling.sub('x', 'm')}) (v {spelling.mean('(* c c)')})) "
                f"{spelling.affine(normed, bias=True)})")
    root, divide = spelling.inverse_root(floored(spelling.mean("(* x x)"), constant, how))
    return spelling.affine(f"(/ x {root})" if divide else spelling.mul("x", root), bias=False)


def guarded_loss(spelling: Spelling, constant: str, how: str, on_probabilities: bool) -> str:
    picked = "(take-along logp (expand-dims t -1) -1)"
    if on_probabilities:
        logp = f"(log {floored('(softmax y -1)', constant, how)})"
    else:
        logp = floored(spelling.log_softmax("y"), constant, how)
    return f"(let ((logp {logp})) (neg (mean {picked})))"


def lowered(tmp_path: Path, model: str, objective: str) -> CompilationUnit:
    path = tmp_path / "experiment.sx"
    path.write_text(EXPERIMENT.format(width=WIDTH, model=model, objective=objective))
    unit = CompilationUnit(path=str(path))
    PassManager(parse_pipeline(PIPELINE)).run(unit)
    return unit


def assert_guard_kept(unit: CompilationUnit, family: str) -> None:
    """The guard is an op of the lowered train graph, or the family fell back naming a guard."""
    train = next(op for op in unit.module.body.ops if op.name == "graph.func" and op.attributes["sym_name"] == "train")
    kept = [op for op in train.regions[0].blocks[0].ops if op.name in GUARDS]
    facts = unit.facts.lowering.patterns["train"].get(family, {})
    reasons = [entry["reason"] for entry in facts.get("fell_back", [])]
    assert kept or any("guard" in reason for reason in reasons), (facts, [op.name for op in train.regions[0].blocks[0].ops])
    if fired(unit.facts.lowering.patterns["train"], family):
        assert kept, "a guarded region became a kernel and its guard is gone"


@settings(max_examples=10, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate))
@given(seed=st.integers(0, 10_000), family=st.sampled_from(["layernorm", "rmsnorm"]),
       exponent=st.integers(-8, 0), how=st.sampled_from(["max", "max swapped", "where"]))
def test_a_floored_norm_keeps_its_floor(tmp_path_factory, seed: int, family: str, exponent: int, how: str) -> None:
    tmp_path = tmp_path_factory.mktemp("guard")
    constant = f"1e{exponent}"
    unit = lowered(tmp_path, guarded_norm(Spelling(seed), family, constant, how), SQUARES)
    assert_guard_kept(unit, family)


@settings(max_examples=10, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate))
@given(seed=st.integers(0, 10_000), floor=st.integers(1, 60), how=st.sampled_from(["max", "max swapped", "where"]),
       on_probabilities=st.booleans())
def test_a_floored_loss_keeps_its_floor(tmp_path_factory, seed: int, floor: int, how: str,
                                       on_probabilities: bool) -> None:
    tmp_path = tmp_path_factory.mktemp("guard")
    constant = f"1e-{floor}" if on_probabilities else f"-{floor}.0"
    unit = lowered(tmp_path, "x", guarded_loss(Spelling(seed), constant, how, on_probabilities))
    assert_guard_kept(unit, "cross_entropy_forward")


def test_an_eps_added_is_still_the_family(tmp_path) -> None:
    spelling = Spelling(7)
    model = (f"(let* ((m {spelling.mean('x')}) (c (- x m)) (v (mean (* c c) -1 :keep true))) "
             "(+ (* (* c (rsqrt (+ v 1e-3))) w) b))")
    facts = lowered(tmp_path, model, SQUARES).facts.lowering.patterns["train"]
    assert fired(facts, "layernorm") == 1 and fired(facts, "layernorm_backward") == 1, facts
