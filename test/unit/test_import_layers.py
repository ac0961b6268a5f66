"""The package's imports follow its layers and form no cycle.

Layers, lowest first: `base` (diagnostics, version, float text, where a Ctrl-C goes) ← `dialects`
← `frontend` (which feeds the dialects) ← `passes` ← `backends` ← `top` (the
Python API and the tools). A module may import its own layer and the layers
its layer lists below; a backend never imports the frontend. Every import
counts, those inside functions too (they run as surely as the others); only
imports under `if TYPE_CHECKING:` are left out. A failure names both files.

One home per target: the CUDA renderer is `backends/cuda/render/` (no
`passes/emit_cuda/`); no pass reaches a backend, even through another module
(the passes ask a registered kernel target, `passes/targets.py`); the GPU
runtime (runtime, lowering, the drivers, NVRTC) never reaches `sim/`.
Beside the layers, `NEVERS` lists imports the layers allow but the design
does not, each with its reason; a failure names the never it breaks.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Folder in the repository -> the package it holds (pyproject.toml's package-dir).
PACKAGE_DIRS = {
    "sexpgpu": "sexpgpu",
    "frontend": "sexpgpu.frontend",
    "dialects": "sexpgpu.dialects",
    "passes": "sexpgpu.passes",
    "backends": "sexpgpu.backends",
    "tools": "sexpgpu.tools",
}
#: Module-name prefixes -> layer; the longest prefix wins.
LAYER_OF = {
    "sexpgpu": "top",
    "sexpgpu.api": "top",
    "sexpgpu.tools": "top",
    "sexpgpu.version": "base",
    "sexpgpu.diagnostics": "base",
    "sexpgpu.float_text": "base",
    "sexpgpu.byte_text": "base",
    "sexpgpu.interruption": "base",
    "sexpgpu.dialects": "dialects",
    "sexpgpu.frontend": "frontend",
    "sexpgpu.passes": "passes",
    "sexpgpu.report": "passes",
    "sexpgpu.backends": "backends",
}
#: Layer -> the layers its modules may import.
MAY_IMPORT = {
    "base": {"base"},
    "dialects": {"base", "dialects"},
    "frontend": {"base", "dialects", "frontend"},
    "passes": {"base", "dialects", "frontend", "passes"},
    "backends": {"base", "dialects", "passes", "backends"},
    "top": {"base", "dialects", "frontend", "passes", "backends", "top"},
}




def _in_report(module: str) -> bool:
    return module == "sexpgpu.report" or module.startswith("sexpgpu.report.")


#: (the never, the importing modules it is about, the imported modules it forbids them).
NEVERS: list[tuple[str, Callable[[str], bool], Callable[[str], bool]]] = [
    ("no backend imports the report: an executor returns facts (passes/lowering_report.py's LoweringFacts), "
     "the layer above the executors renders them",
     lambda module: layer(module) == "backends", _in_report),
    ("nothing below the top imports the top: the devices a verb opens are backends/devices.py, below the "
     "training driver, which reaches up for nothing",
     lambda module: layer(module) != "top", lambda target: layer(target) == "top"),
]


def package_modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def layer(module: str) -> str:
    prefix = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[prefix]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """The package modules `module` imports, with the line of each import."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "sexpgpu":
                        found.append((alias.name, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = here[: len(here) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] != "sexpgpu":
                    continue
                for alias in child.names:
                    submodule = f"{target}.{alias.name}"
                    found.append((submodule if submodule in modules else target, child.lineno))
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    first_line: dict[str, int] = {}
    for target, line in found:
        if target in modules and target != module:
            first_line.setdefault(target, line)
    return list(first_line.items())


def import_graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int]]]]:
    modules = package_modules()
    return modules, {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_imports_follow_the_layers() -> None:
    modules, graph = import_graph()
    wrong = []
    for module, targets in graph.items():
        for target, line in targets:
            if layer(target) not in MAY_IMPORT[layer(module)]:
                wrong.append(
                    f"{modules[module].relative_to(ROOT)}:{line} ({layer(module)}) imports "
                    f"{modules[target].relative_to(ROOT)} ({layer(target)})"
                )
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def broken_nevers(graph: dict[str, list[tuple[str, int]]]) -> dict[str, list[tuple[str, str, int]]]:
    """Each never some import breaks, with those imports (module, target, line)."""
    broken: dict[str, list[tuple[str, str, int]]] = {}
    for never, importer, forbidden in NEVERS:
        for module, targets in graph.items():
            for target, line in targets:
                if importer(module) and forbidden(target):
                    broken.setdefault(never, []).append((module, target, line))
    return broken


def test_no_import_breaks_a_never() -> None:
    modules, graph = import_graph()
    failures = [
        f"never: {never}\n" + "\n".join(f"  {modules[m].relative_to(ROOT)}:{line} imports {modules[t].relative_to(ROOT)}"
                                        for m, t, line in imports)
        for never, imports in broken_nevers(graph).items()
    ]
    assert not failures, "\n".join(failures)


def strongly_connected(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        # Iterative, so a long import chain cannot exhaust Python's recursion limit.
        work = [(v, iter(graph[v]))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            for target, _ in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return components


def test_no_import_cycle() -> None:
    modules, graph = import_graph()
    cycles = []
    for component in strongly_connected(graph):
        members = set(component)
        edges = [
            f"  {modules[m].relative_to(ROOT)}:{line} imports {modules[t].relative_to(ROOT)}"
            for m in component
            for t, line in graph[m]
            if t in members
        ]
        cycles.append("cycle among " + ", ".join(component) + ":\n" + "\n".join(edges))
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_a_violation_and_a_cycle() -> None:
    graph = {"sexpgpu.dialects.a": [("sexpgpu.passes.b", 3)], "sexpgpu.passes.b": [("sexpgpu.dialects.a", 7)]}
    assert strongly_connected(graph) == [["sexpgpu.dialects.a", "sexpgpu.passes.b"]]
    assert layer("sexpgpu.passes.b") not in MAY_IMPORT[layer("sexpgpu.dialects.a")]
    assert layer("sexpgpu.frontend.x") not in MAY_IMPORT[layer("sexpgpu.backends.y")]
    graph = {"sexpgpu.backends.executor": [("sexpgpu.report.lowering_text", 31)],
             "sexpgpu.backends.training": [("sexpgpu.devices", 58)],
             "sexpgpu.tools.run_cmd": [("sexpgpu.report.lowering_text", 9)]}
    broken = broken_nevers(graph)
    assert [imports for never, imports in broken.items() if never.startswith("no backend imports the report")] == [
        [("sexpgpu.backends.executor", "sexpgpu.report.lowering_text", 31)]]
    assert [imports for never, imports in broken.items() if never.startswith("nothing below the top")] == [
        [("sexpgpu.backends.training", "sexpgpu.devices", 58)]]


# -- one home per target -------------------------------------------------------------------------

#: The CUDA target's modules that run on a GPU; none may reach the simulator, even through another module.
REAL_CUDA_RUNTIME = ("sexpgpu.backends.cuda.runtime", "sexpgpu.backends.cuda.lowering", "sexpgpu.backends.cuda.driver_cuda",
                     "sexpgpu.backends.cuda.driver_pycuda", "sexpgpu.backends.cuda.nvrtc", "sexpgpu.backends.cuda.compiler")


def reachable(graph: dict[str, list[tuple[str, int]]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    work = [start]
    while work:
        for target, _ in graph[work.pop()]:
            if target not in seen:
                seen.add(target)
                work.append(target)
    return seen


def test_the_cuda_renderer_lives_in_its_backend() -> None:
    assert not (ROOT / "passes" / "emit_cuda").exists(), "passes/emit_cuda/ is back: the renderer is backends/cuda/render/"
    assert (ROOT / "backends" / "cuda" / "render" / "prelude.cuh").is_file()
    assert not list((ROOT / "backends" / "cuda" / "sim").glob("*.cuh")), "the source both compilers read is render/'s"


def test_passes_never_import_the_cuda_renderer() -> None:
    modules, graph = import_graph()
    wrong = [f"{modules[m].relative_to(ROOT)} reaches {t}" for m in graph if layer(m) == "passes"
             for t in reachable(graph, m) if t.startswith("sexpgpu.backends.")]
    assert not wrong, "a pass imports a backend (ask the kernel target, passes/targets.py):\n" + "\n".join(wrong)


def test_the_real_cuda_runtime_never_imports_the_simulator() -> None:
    modules, graph = import_graph()
    wrong = [f"{modules[m].relative_to(ROOT)} reaches {t}" for m in REAL_CUDA_RUNTIME
             for t in reachable(graph, m) if t == "sexpgpu.backends.cuda.sim" or t.startswith("sexpgpu.backends.cuda.sim.")]
    assert not wrong, "the GPU runtime imports cuda-sim:\n" + "\n".join(wrong)


def test_the_nevers_see_a_violation() -> None:
    graph = {"sexpgpu.backends.cuda.runtime": [("sexpgpu.backends.cuda.bf16", 3)],
             "sexpgpu.backends.cuda.bf16": [("sexpgpu.backends.cuda.sim.device", 5)], "sexpgpu.backends.cuda.sim.device": []}
    assert "sexpgpu.backends.cuda.sim.device" in reachable(graph, "sexpgpu.backends.cuda.runtime")
