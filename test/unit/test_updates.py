"""build-updates and fold-constants: graph structure, and torch.optim numerics through the interpreter."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from sexpgpu.backends.interpreter import compile_graph
from sexpgpu.dialects import exp, graph  # noqa: F401  (registers the ops)
from sexpgpu.dialects.core import Builder, Operation, Region, TensorType
from sexpgpu.passes.manager import CompilationUnit, run_pipeline
from sexpgpu.passes.schedules import SCALAR, build_schedule

from sexpgpu.diagnostics import Location, SxError

LOC = Location("run.sx", 12, 3)
SHAPES = {"model.w": (3, 4), "model.b": (4,)}
STEPS = 10


def make_module(groups: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]] = SHAPES) -> Operation:
    module = Operation.create("builtin.module", regions=[Region.with_block()])
    for path, shape in shapes.items():
        attrs = {
            "path": path,
            "type": TensorType(shape, "f32"),
            "init": {"kind": "zeros"},
            "group": "default",
        }
        module.body.append(Operation.create("exp.param", attributes=attrs))
    for i, group in enumerate(groups):
        module.body.append(Operation.create("exp.group", attributes=group, loc=Location("run.sx", 12 + i, 3)))
    return module


def adamw_group(**hyper: Any) -> dict[str, Any]:
    base = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    return {
        "name": "default",
        "optimizer": "adamw",
        "members": list(SHAPES),
        "hyper": {**base, **hyper},
        "clip": None,
    }


def build(module: Operation, pipeline: str = "build-updates") -> dict[str, Operation]:
    run_pipeline(CompilationUnit(module=module), pipeline)
    module.verify()
    return {op.attributes["sym_name"]: op for op in module.body.ops if op.name == "graph.func"}


def inputs_of(func: Operation) -> list[tuple[str, str, TensorType]]:
    return [
        (op.attributes["name"], op.attributes["role"], op.result.type)
        for op in func.body.ops
        if op.name == "graph.input"
    ]


# -- schedules ---------------------------------------------------------------------------------


def reference_lr(spec: dict[str, Any] | float, s: int) -> float:
    """The documented schedules, directly (nanoGPT's get_lr at it = s for warmup-cosine)."""
    if not isinstance(spec, dict):
        return spec
    kind = spec["kind"]
    if kind == "constant":
        return spec["value"]
    if kind == "linear-warmup":
        return spec["peak"] * min(s, spec["warmup"]) / spec["warmup"]
    peak, warmup, steps = spec["peak"], spec.get("warmup", 0), spec["steps"]
    low = spec.get("floor", 0.0) * peak
    if s <= warmup:
        return peak * s / warmup
    if s > steps:
        return low
    ratio = (s - warmup) / (steps - warmup)
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - low)


SCHEDULES = [
    0.03,
    {"kind": "constant", "value": 0.02},
    {"kind": "linear-warmup", "peak": 0.01, "warmup": 4},
    {"kind": "cosine", "peak": 0.01, "steps": 7, "floor": 0.0},
    {"kind": "warmup-cosine", "peak": 0.01, "warmup": 3, "steps": 8, "floor": 0.1},
]


@pytest.mark.parametrize("spec", SCHEDULES, ids=lambda s: s["kind"] if isinstance(s, dict) else "float")
def test_schedule_matches_formula_every_step(spec: Any) -> None:
    func = Operation.create("graph.func", attributes={"sym_name": "lr"}, regions=[Region.with_block()])
    b = Builder(func.body, loc=LOC)
    step = b.create("graph.input", (), {"name": "step", "role": "step"}, result_types=[SCALAR]).result
    b.create("graph.return", [build_schedule(b, step, spec)], {"names": ["lr"]})
    func.verify()
    compiled = compile_graph(func)
    for s in range(1, 13):
        got = float(compiled({"step": np.array(s, np.float32)}).outputs["lr"])
        assert got == pytest.approx(reference_lr(spec, s), rel=1e-6, abs=1e-12), s


def test_warmup_cosine_needs_steps_after_warmup() -> None:
    module = make_module([adamw_group(lr={"kind": "warmup-cosine", "peak": 1.0, "warmup": 5, "steps": 5})])
    with pytest.raises(SxError, match="steps"):
        build(module)


# -- structure ---------------------------------------------------------------------------------


def test_adamw_graph_per_param_with_inputs_outputs_and_states() -> None:
    module = make_module([adamw_group()])
    funcs = build(module)
    assert sorted(funcs) == ["update/default/model.b", "update/default/model.w"]
    func = funcs["update/default/model.w"]
    assert func.attributes == {
        "sym_name": "update/default/model.w",
        "kind": "update",
        "group": "default",
        "param": "model.w",
    }
    t = TensorType((3, 4), "f32")
    assert inputs_of(func) == [
        ("param", "param", t),
        ("grad", "grad", t),
        ("m", "state", t),
        ("v", "state", t),
        ("step", "step", SCALAR),
    ]
    ret = func.body.last_op
    assert ret.attributes["names"] == ["param", "m", "v"]
    assert [v.type for v in ret.operands] == [t, t, t]
    assert func.loc == LOC and all(op.loc == LOC for op in func.body.ops)
    group = next(op for op in module.body.ops if op.name == "exp.group")
    assert group.attributes["states"] == {"m": 16, "v": 16}


def test_sgd_states_follow_momentum() -> None:
    groups = [
        {"name": "fast", "optimizer": "sgd", "members": ["model.w"], "hyper": {"lr": 0.1, "momentum": 0.9}},
        {"name": "plain", "optimizer": "sgd", "members": ["model.b"], "hyper": {"lr": 0.1}},
    ]
    module = make_module(groups)
    funcs = build(module)
    assert funcs["update/fast/model.w"].body.last_op.attributes["names"] == ["param", "momentum"]
    assert funcs["update/plain/model.b"].body.last_op.attributes["names"] == ["param"]
    assert [n for n, _, _ in inputs_of(funcs["update/plain/model.b"])] == ["param", "grad", "step"]
    states = [op.attributes["states"] for op in module.body.ops if op.name == "exp.group"]
    assert states == [{"momentum": 12}, {}]


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
        ({"members": ["model.nope"]}, "model.nope"),
        ({"hyper": {}}, "no learning rate"),
    ],
)
def test_bad_groups_are_located_errors(group: dict[str, Any], message: str) -> None:
    module = make_module([{**adamw_group(), **group}])
    with pytest.raises(SxError, match=message) as err:
        build(module)
    assert err.value.loc == LOC


def test_running_twice_is_an_error() -> None:
    module = make_module([adamw_group()])
    build(module)
    with pytest.raises(SxError, match="already exists"):
        build(module)


def test_clip_graph_global_when_all_groups_share_the_value() -> None:
    groups = [
        {**adamw_group(), "name": "a", "members": ["model.w"], "clip": 1.0},
        {**adamw_group(), "name": "b", "members": ["model.b"], "clip": 1.0},
    ]
    funcs = build(make_module(groups))
    clip = funcs["clip/all"]
    assert clip.attributes == {"sym_name": "clip/all", "kind": "clip", "groups": ["a", "b"], "max_norm": 1.0}
    assert [n for n, _, _ in inputs_of(clip)] == ["grad/model.w", "grad/model.b"]
    assert clip.body.last_op.attributes["names"] == ["grad/model.w", "grad/model.b", "norm"]


def test_clip_graph_per_group_when_values_differ() -> None:
    groups = [
        {**adamw_group(), "name": "a", "members": ["model.w"], "clip": 1.0},
        {**adamw_group(), "name": "b", "members": ["model.b"], "clip": None},
    ]
    funcs = build(make_module(groups))
    assert "clip/a" in funcs and "clip/all" not in funcs and "clip/b" not in funcs
    assert funcs["clip/a"].attributes["groups"] == ["a"]


# -- fold-constants ----------------------------------------------------------------------------


def test_fold_leaves_no_constant_only_op_and_lists_constants() -> None:
    group = {
        "name": "default",
        "optimizer": "sgd",
        "members": ["model.b"],
        "hyper": {
            "lr": {"kind": "linear-warmup", "peak": 0.5, "warmup": 4},
            "momentum": 0.9,
            "weight_decay": 0.2,
        },
    }
    module = make_module([group], {"model.b": (4,)})
    func = build(module, "build-updates,fold-constants")["update/default/model.b"]
    for op in func.body.ops:
        assert not op.operands or any(v.op.name != "graph.const" for v in op.operands), op.name
    # lr = min(s, 4) * (0.5 / 4); g + 0.2 p; buf * 0.9 + g; p - lr * buf
    group_op = next(op for op in module.body.ops if op.name == "exp.group")
    assert group_op.attributes["constants"] == [0.125, 0.2, 0.9, 4.0]


def test_adamw_constants_are_folded_hyperparameter_arithmetic() -> None:
    group = {**adamw_group(betas=[0.8, 0.99], eps=1e-10), "members": ["model.b"]}
    module = make_module([group], {"model.b": (4,)})
    build(module, "build-updates,fold-constants")
    group = next(op for op in module.body.ops if op.name == "exp.group")
    # 1 - lr*wd with lr = 0.01, wd = 0.1 folds to 0.999; 1 - b1, 1 - b2 to 0.2, 0.01
    assert group.attributes["constants"] == [1e-10, 0.01, 0.2, 0.8, 0.99, 0.999, 1.0]


# -- numerics against torch.optim --------------------------------------------------------------


def run_updates(
    funcs: dict[str, Operation], group: str, grads: list[dict[str, np.ndarray]], params: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Train `params` over the grads of each step with the graphs of one group (clipping first if built)."""
    compiled = {name: compile_graph(f) for name, f in funcs.items()}
    clip = next((c for name, c in compiled.items() if name.startswith("clip/")), None)
    params = {k: v.copy() for k, v in params.items()}
    states: dict[str, dict[str, np.ndarray]] = {}
    for s, step_grads in enumerate(grads, start=1):
        if clip is not None:
            out = clip({f"grad/{k}": g for k, g in step_grads.items()}).outputs
            step_grads = {k: out[f"grad/{k}"] for k in step_grads}
        for path, g in step_grads.items():
            update = compiled[f"update/{group}/{path}"]
            state_names = [n for n in update.output_names if n != "param"]
            st = states.setdefault(path, {n: np.zeros_like(g) for n in state_names})
            out = update({"param": params[path], "grad": g, "step": np.array(s, np.float32), **st}).outputs
            params[path] = out["param"]
            states[path] = {n: out[n] for n in state_names}
    return params


def torch_run(
    make_opt: Any,
    grads: list[dict[str, np.ndarray]],
    params: dict[str, np.ndarray],
    clip: float | None,
    lr_lambda: Any = None,
) -> dict[str, np.ndarray]:
    torch = pytest.importorskip("torch")
    tensors = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in params.items()}
    opt = make_opt(list(tensors.values()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    for step_grads in grads:
        for k, t in tensors.items():
            t.grad = torch.tensor(step_grads[k])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(tensors.values()), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return {k: t.detach().numpy() for k, t in tensors.items()}


def random_problem(
    seed: int, scale: float = 1.0
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [
        {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
        for _ in range(STEPS)
    ]
    return params, grads


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("pipeline", ["build-updates", "build-updates,fold-constants"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_adamw_matches_torch_with_warmup_cosine(pipeline: str, clip: float | None) -> None:
    torch = pytest.importorskip("torch")
    spec = {"kind": "warmup-cosine", "peak": 1e-2, "warmup": 3, "steps": 8, "floor": 0.1}
    funcs = build(make_module([{**adamw_group(lr=spec), "clip": clip}]), pipeline)
    params, grads = random_problem(0, scale=3.0)

    def make(ps: list[Any]) -> Any:
        return torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    want = torch_run(make, grads, params, clip, lambda e: reference_lr(spec, e + 1) / 1e-2)
    assert_close(run_updates(funcs, "default", grads, params), want)


@pytest.mark.parametrize(
    "hyper",
    [
        {"momentum": 0.9, "nesterov": False, "weight_decay": 0.0},
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.05},
        {"momentum": 0.0, "nesterov": False, "weight_decay": 0.01},
    ],
    ids=["momentum", "nesterov-wd", "plain-wd"],
)
def test_sgd_matches_torch(hyper: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    spec = {"kind": "linear-warmup", "peak": 0.05, "warmup": 4}
    group = {"name": "default", "optimizer": "sgd", "members": list(SHAPES), "hyper": {"lr": spec, **hyper}}
    funcs = build(make_module([group]), "build-updates,fold-constants")
    params, grads = random_problem(1)

    def make(ps: list[Any]) -> Any:
        return torch.optim.SGD(ps, lr=0.05, **hyper)

    want = torch_run(make, grads, params, None, lambda e: reference_lr(spec, e + 1) / 0.05)
    assert_close(run_updates(funcs, "default", grads, params), want)


def test_clip_matches_clip_grad_norm() -> None:
    torch = pytest.importorskip("torch")
    funcs = build(make_module([{**adamw_group(), "clip": 0.5}]))
    compiled = compile_graph(funcs["clip/all"])
    _, grads = random_problem(2, scale=2.0)
    for step_grads in grads[:3]:
        tensors = [torch.zeros(SHAPES[k], requires_grad=True) for k in SHAPES]
        for t, k in zip(tensors, SHAPES):
            t.grad = torch.tensor(step_grads[k])
        norm = torch.nn.utils.clip_grad_norm_(tensors, 0.5)
        out = compiled({f"grad/{k}": g for k, g in step_grads.items()}).outputs
        assert float(out["norm"]) == pytest.approx(float(norm), rel=1e-6)
        for t, k in zip(tensors, SHAPES):
            np.testing.assert_allclose(out[f"grad/{k}"], t.grad.numpy(), rtol=1e-6, atol=1e-8)
