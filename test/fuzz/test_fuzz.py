"""Fuzzing in CI: a fixed, seeded sample of mutated examples and lit inputs through every verb.

No input may make sexpgpu exit 3, print a traceback, hang, or exit 1 without a
`file:line:col: error:` location. The sample runs in children forked from
this process (the compiler imported once); a few hand-made inputs run as real
commands to check exit codes and stderr end to end. `benchmarks/fuzz_campaign.py`
runs the same generator for as long as one likes.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import sxfuzz

#: The sample: this many cases of the generator seeded with SEED, nesting added up to MAX_DEPTH
#: (about 30 s on two cores); `benchmarks/fuzz_campaign.py` runs as many more as one likes.
SEED = "ci"
CASES = 600
MAX_DEPTH = 20000
#: A case slower than this is a hang (a compile of the largest example takes about a second).
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def workspace():
    with sxfuzz.Workspace(slots=min(2, os.cpu_count() or 1)) as ws:
        yield ws


@pytest.fixture(scope="module")
def outcomes(workspace) -> list[sxfuzz.Outcome]:
    cases = sxfuzz.make_cases(sxfuzz.load_seeds(), CASES, seed=SEED, max_depth=MAX_DEPTH)
    return list(sxfuzz.Runner(workspace, timeout=TIMEOUT).run(cases))


def report(bad: list[sxfuzz.Outcome], folder: Path) -> str:
    lines = [f"{len(bad)} fuzz cases broke the contract (reproducers in {folder}):"]
    for outcome in bad:
        where = sxfuzz.save_reproducer(outcome, folder)
        tail = "\n      ".join(outcome.stderr.strip().splitlines()[-4:])
        lines.append(f"  case {outcome.case.number} [{outcome.kind}] {outcome.case.describe()}\n"
                     f"    mutations: {'; '.join(outcome.case.mutations)}\n    saved: {where}\n      {tail}")
    return "\n".join(lines)


def test_no_input_breaks_the_contract(outcomes, tmp_path_factory):
    bad = [o for o in outcomes if o.bad]
    assert not bad, report(bad, tmp_path_factory.mktemp("fuzz-reproducers"))


def test_the_sample_exercises_every_verb_and_outcome(outcomes):
    """The sample is only worth its time if it reaches the verbs and gets past the reader sometimes."""
    kinds = Counter(o.kind for o in outcomes)
    assert kinds["exit 0"] >= CASES // 20 and kinds["located 1"] >= CASES // 2, kinds
    verbs = Counter(o.case.program if o.case.program == "sexpgpu-opt" else o.case.argv[0] for o in outcomes)
    for verb in ("check", "explain", "diff", "eval", "sexpgpu-opt"):
        assert verbs[verb] >= 5, verbs
    mutations = Counter(m.split(" ")[0].split("@")[0] for o in outcomes for m in o.case.mutations)
    for mutation in ("delete-token", "swap-tokens", "extreme-number", "shape-edit", "deep-nesting", "bad-bytes",
                     "byte-order-mark", "latin-1"):
        assert mutations[mutation] >= 2, mutations


def test_cases_are_determined_by_seed_and_number():
    seeds = sxfuzz.load_seeds()
    first = list(sxfuzz.make_cases(seeds, 5, seed="x", start=40))
    again = list(sxfuzz.make_cases(seeds, 1, seed="x", start=42))
    assert (first[2].data, first[2].argv, first[2].mutations) == (again[0].data, again[0].argv, again[0].mutations)


@pytest.mark.parametrize(
    ("returncode", "stderr", "timed_out", "kind"),
    [
        (1, "a.sx:3:5: error: bad\n  (x)\n  ^\n", False, "located 1"),
        (1, "warning: w\nerror: cannot read 'a.sx'\n", False, "unlocated 1"),
        (1, "a.sx:0:0: error: somewhere\n", False, "unlocated 1"),
        (3, "internal error: ...\nTraceback (most recent call last):\n", False, "exit 3"),
        (1, "Traceback (most recent call last):\n", False, "traceback"),
        (None, "", True, "hang"),
        (-11, "", False, "signal"),
        (0, "", False, "exit 0"),
        (2, "error: unknown variant", False, "exit 2"),
    ],
)
def test_outcome_classes(returncode, stderr, timed_out, kind):
    assert sxfuzz.classify(returncode, stderr, timed_out) == kind


def hand_made(seed_rel: str, data: bytes, argv: list[str], program: str = "sexpgpu") -> sxfuzz.Case:
    seed = next(s for s in sxfuzz.load_seeds() if s.rel == seed_rel)
    return sxfuzz.Case(-1, seed, data, ["hand-made"], argv, program)


GPT = (Path(sxfuzz.ROOT) / "examples" / "gpt.sx").read_bytes()


@pytest.mark.parametrize(
    ("case", "returncode", "first_line"),
    [
        pytest.param(hand_made("examples/gpt.sx", b"\xef\xbb\xbf" + GPT, ["check", "{file}", "--variant", "smoke"]),
                     0, "", id="byte-order-mark"),
        pytest.param(hand_made("examples/gpt.sx", GPT.replace(b"peak learning rate", b"peak l\xe9arning rate"),
                               ["explain", "{file}"]),
                     1, "examples/gpt.sx:5:21: error: the file is not UTF-8 text: byte 0xe9", id="latin-1"),
        pytest.param(hand_made("examples/lib/model.sx", (Path(sxfuzz.ROOT) / "examples/lib/model.sx").read_bytes()
                               + b"(def big " + b"7" * 5000 + b")\n", ["diff", "{seed}", "{file}"]),
                     1, "examples/lib/model.sx:36:10: error: integer literal of 5000 digits is too long", id="huge-int"),
        pytest.param(hand_made("examples/gpt.sx", b"(def x " + b"[" * 2000 + b"1" + b"]" * 2000 + b")\nx\n",
                               ["eval", "{file}"]),
                     0, "", id="deep-vectors"),
        pytest.param(hand_made("test/lit/ir/print-locations.sxir",
                               b'graph.func @f {\n  %0 = graph.input {name = "x", role = "batch"} : () -> '
                               b'tensor<4xf32> loc("/etc/passwd":1:1)\n  %1 = graph.exp %0, %0 : (tensor<4xf32>, '
                               b'tensor<4xf32>) -> tensor<4xf32> loc("/etc/passwd":1:1)\n  graph.return %1 {names = ["y"]} : '
                               b'(tensor<4xf32>) -> ()\n}\n', ["{file}"], "sexpgpu-opt"),
                     1, "/etc/passwd:1:1: error: 'graph.exp' expects 1 operands, got 2", id="loc-names-a-file"),
    ],
)
def test_hand_made_inputs_end_to_end(workspace, case, returncode, first_line):
    outcome = sxfuzz.run_subprocess(case, workspace)
    assert outcome.returncode == returncode, outcome.stderr
    lines = outcome.stderr.splitlines()
    assert (lines[0] if lines else "") .startswith(first_line), outcome.stderr
    assert "root:" not in outcome.stderr and "Traceback" not in outcome.stderr


def test_a_sample_of_mutants_end_to_end(workspace):
    """A few generated cases as real commands: the entry points classify as the forked runs do."""
    cases = list(sxfuzz.make_cases(sxfuzz.load_seeds(), 4, seed=SEED + "-subprocess", max_depth=MAX_DEPTH))
    outcomes = [sxfuzz.run_subprocess(case, workspace) for case in cases]
    bad = [o for o in outcomes if o.bad]
    assert not bad, "\n".join(f"{o.case.describe()}: {o.kind}\n{o.stderr}" for o in bad)
