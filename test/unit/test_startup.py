"""Start-up: what a command imports, the lazy pass registry, and the tables that spare the imports.

`sexpgpu check` is what an editor runs on every save: it must not import what it does not use (numpy,
ml_dtypes, lark, a backend, the CUDA renderer, the lowering passes). These tests assert on the modules a
fresh process holds, never on time (benchmarks/startup.py prints the times).
"""

from __future__ import annotations

import importlib
import json
import math
import pkgutil
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import sexpgpu.passes
from sexpgpu.frontend.reader import GRAMMAR_TABLE_PATH, grammar_table_source
from sexpgpu.passes.canonicalize import _exact_bf16_cast
from sexpgpu.passes.manager import PASS_MODULES, PASSES, CompilationUnit, pass_class, run_pipeline
from sexpgpu.passes.pipelines import CHECK_PIPELINE, TRAINING_PIPELINE

from sexpgpu.diagnostics import DiagnosticSink

ROOT = Path(__file__).resolve().parents[2]

#: What no `check` of a file needs: a target's renderer and backends, the lowering passes and reports,
#: numpy (and bf16 support, ml_dtypes), and lark (the reader's terminals are generated).
NOT_FOR_CHECK = ("numpy", "ml_dtypes", "lark", "sexpgpu.backends", "sexpgpu.report", "sexpgpu.passes.fuse",
                 "sexpgpu.passes.match_patterns", "sexpgpu.passes.patterns", "sexpgpu.passes.explain")


def modules_after(code: str) -> list[str]:
    """The modules a fresh interpreter holds after running `code` (from the repository's root)."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def imported(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_check_of_a_bf16_model_imports_no_backend_numpy_or_lark() -> None:
    modules = modules_after("from sexpgpu.tools.main import main\n"
                            "assert main(['check', 'examples/gpt2-small.sx']) == 0")
    assert "sexpgpu.passes.build_updates" in modules  # it did run the check pipeline
    assert imported(modules, NOT_FOR_CHECK) == []


def test_version_imports_no_compiler() -> None:
    modules = modules_after("from sexpgpu.tools.main import main\n"
                            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass")
    assert imported(modules, ("sexpgpu.dialects", "sexpgpu.frontend", "sexpgpu.passes", "numpy")) == []


def test_a_pipeline_imports_only_the_passes_it_names() -> None:
    modules = modules_after("from sexpgpu.targets import register_targets\n"
                            "from sexpgpu.passes.manager import parse_pipeline\n"
                            "register_targets()\n"
                            "parse_pipeline('canonicalize,cse,dce')")
    passes = {m for m in modules if m.startswith("sexpgpu.passes.")}
    assert passes == {"sexpgpu.passes.manager", "sexpgpu.passes.targets", "sexpgpu.passes.canonicalize",
                      "sexpgpu.passes.cse", "sexpgpu.passes.dce"}
    assert imported(modules, ("numpy", "sexpgpu.backends")) == []


def test_a_target_pass_imports_its_target_on_first_use() -> None:
    modules = modules_after("from sexpgpu.targets import register_targets\n"
                            "from sexpgpu.passes.manager import parse_pipeline\n"
                            "from sexpgpu.passes.targets import TARGETS\n"
                            "register_targets()\n"
                            "parse_pipeline('emit-cuda')\n"
                            "assert 'cuda' in TARGETS")
    assert "sexpgpu.backends.cuda.target" in modules


def test_the_registry_names_every_pass_with_its_module() -> None:
    """Every `register_pass` under passes/ is in `PASS_MODULES`, with the module that defines it."""
    for info in pkgutil.walk_packages(sexpgpu.passes.__path__, "sexpgpu.passes."):
        importlib.import_module(info.name)
    builtin = {name: cls for name, cls in PASSES.items() if cls.__module__.startswith("sexpgpu.passes.")}
    listed = {name for name, module in PASS_MODULES.items() if module.startswith(".")}
    assert set(builtin) == listed
    for name in listed:
        assert builtin[name].__module__ == "sexpgpu.passes" + PASS_MODULES[name]
        assert pass_class(name) is builtin[name]


def test_an_unknown_pass_is_named_with_a_hint_without_importing_every_pass() -> None:
    from sexpgpu.diagnostics import UsageError

    with pytest.raises(UsageError, match="unknown pass 'canonicalise'; did you mean 'canonicalize'"):
        pass_class("canonicalise")


def test_the_grammar_table_is_generated_from_the_grammar() -> None:
    assert GRAMMAR_TABLE_PATH.read_text(encoding="utf-8") == grammar_table_source(), (
        "frontend/grammar_table.py is out of date: run "
        "python -c 'from sexpgpu.frontend.reader import write_grammar_table; write_grammar_table()'")


def test_the_pure_python_bf16_cast_rounds_as_ml_dtypes() -> None:
    np = pytest.importorskip("numpy")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = random.Random(16)
    edges = [(high << 16) | low for high in range(0, 0x10000, 97) for low in (0, 0x7FFF, 0x8000, 0x8001, 0xFFFF)]
    bit_patterns = edges + [rng.getrandbits(32) for _ in range(20_000)] + [0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000]
    for bits in bit_patterns:
        value = struct.unpack("<f", struct.pack("<I", bits))[0]
        mine = _exact_bf16_cast(value)
        if math.isnan(value):
            assert mine is None
            continue
        expected = float(np.float32(value).astype(ml_dtypes.bfloat16))
        assert mine == expected and math.copysign(1, mine) == math.copysign(1, expected), hex(bits)



#: Experiments `check` must judge as the whole training pipeline would: the examples under selections
#: that add graphs (accumulation, clipping, bf16 casts), and the two chunks of a file that warns.
CHECKED_AS_TRAINED = [
    ("examples/gpt2-small.sx", 0, None, []),
    ("examples/gpt.sx", 0, "smoke", []),
    ("examples/mlp-classifier.sx", 0, "deep", []),
    ("examples/tiny-gpt.sx", 0, "smoke", ["precision=bf16", "microbatches=2"]),
    ("test/lit/ir/sx-verify-warnings.sx", 0, None, []),
    ("test/lit/ir/sx-verify-warnings.sx", 1, None, []),
]


def checked_facts(path: str, chunk: int, variant: str | None, sets: list[str], pipeline: str) -> tuple[list, list, list]:
    """What `check` can tell of chunk `chunk` of a file after `pipeline`: each graph's name and inputs,
    the parameters, and the diagnostics raised."""
    text = (ROOT / path).read_text(encoding="utf-8").split(";; -----")[chunk]
    unit = CompilationUnit(path=str(ROOT / path), text=text, variant=variant, sets=sets,
                           diagnostics=DiagnosticSink(echo=False))
    run_pipeline(unit, pipeline)
    unit.module.verify()
    graphs = []
    for func in unit.module.body.ops:
        if func.name == "graph.func":
            inputs = [(op.attributes["name"], str(op.result.type)) for op in func.body.ops if op.name == "graph.input"]
            graphs.append((func.attributes["sym_name"], inputs))
    params = sorted((name, p.numel) for name, p in unit.facts.experiment.params.items())
    return graphs, params, [(d.severity, d.message, str(d.loc)) for d in unit.diagnostics.diagnostics]


@pytest.mark.parametrize(("path", "chunk", "variant", "sets"), CHECKED_AS_TRAINED)
def test_check_reports_what_the_training_pipeline_would(path: str, chunk: int, variant: str | None, sets: list[str]) -> None:
    """`check` stops where the training pipeline's passes stop reporting (`CHECK_PIPELINE`): the graphs
    (names and inputs), parameters and diagnostics are those of the whole pipeline."""
    assert TRAINING_PIPELINE.startswith(CHECK_PIPELINE + ",")
    facts = checked_facts(path, chunk, variant, sets, CHECK_PIPELINE)
    assert facts[0] and facts == checked_facts(path, chunk, variant, sets, TRAINING_PIPELINE)


@pytest.mark.parametrize(("words", "status", "stdout", "stderr"), [
    (["examples/tiny-gpt.sx", "--variant", "smoke"], 0, "examples/tiny-gpt.sx: ok (", ""),
    (["test/lit/experiment/error-missing-defrun.sx"], 1, "", "error-missing-defrun.sx:"),
    (["examples/tiny-gpt.sx", "--variant", "smok"], 2, "", "error: unknown variant 'smok'"),
])
def test_a_one_shot_verb_ends_its_process_flushed_without_teardown(words: list[str], status: int, stdout: str, stderr: str) -> None:
    """`sexpgpu check` run as the process ends with its status and its output written, and without
    the interpreter's teardown (an exit handler would print)."""
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('torn down', file=sys.stderr))\n"
            "from sexpgpu.tools.main import main\n"
            f"sys.argv = {['sexpgpu', 'check', *words]!r}\n"
            "sys.exit(main())\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == status, done.stderr
    assert done.stdout.startswith(stdout) and done.stdout.endswith("\n" if stdout else "")
    assert stderr in done.stderr and "torn down" not in done.stderr
