"""The liveness analysis and the buffer plans on it: views, escapes, exact and arena reuse."""

from __future__ import annotations

from _graph_helpers import make_func
from sexpgpu.dialects.liveness import ArenaPlan, Liveness, StorageLiveness


def chain():
    """x [8 8] → exp (1) → transposed view (2) → neg of the view (3) → tanh (4) → add (5),
    returned, with a sum (6) emitted as a metric (7)."""

    def body(g):
        e = g.exp(g.inputs["x"])
        view = g.transpose(e, perm=[1, 0])
        n = g.neg(view)
        t = g.tanh(n)
        out = g.add(t, n)
        g.create("graph.metric", [g.sum(out, axes=[0, 1], keep=False)], {"name": "total"})
        return {"out": out}

    return make_func({"x": ((8, 8), "f32")}, body)


def ops_by_name(func):
    return {op.name.removeprefix("graph."): op for op in func.body.ops}


def test_views_keep_their_source_alive_and_outputs_escape():
    func = chain()
    ops = ops_by_name(func)
    live = StorageLiveness(func.body)
    e, view, n, out = (ops[name].result for name in ("exp", "transpose", "neg", "add"))
    assert live.root[view] is e and live.is_view(view) and not live.is_view(e)
    assert live.last_use[e] == live.defined[ops["transpose"].result]
    assert live.storage_end[e] == live.defined[n]  # read through the view
    assert live.last_use[n] == live.defined[out]
    assert live.escaping == {out, ops["sum"].result}
    assert live.fixed == {ops["input"].result}
    assert live.last_use[out] == len(live.ops) - 1  # read by the return: live to the end


def test_peak_live_bytes_counts_every_value_in_its_own_storage():
    func = chain()
    live = Liveness(func.body)
    values = [r for op in live.ops for r in op.results]
    # At the add (point 5): t and n (its operands), out; n is live from 3, e died at 2 and its view too.
    assert live.peak_live_bytes(values) == 3 * 64 * 4
    assert live.peak_live_bytes([]) == 0


def assign_in_order(func, plan, in_place_ops=("exp", "neg", "tanh", "add")):
    buffers = {}
    for op in func.body.ops:
        name = op.name.removeprefix("graph.")
        if name in ("exp", "neg", "tanh", "add", "sum"):
            buffers[name] = plan.assign(op.result, in_place=name in in_place_ops)
    return buffers


def test_exact_plan_reuses_dying_storage_in_place_for_elementwise_ops_only():
    func = chain()
    buffers = assign_in_order(func, ArenaPlan(StorageLiveness(func.body)))
    # neg reads the view of exp's result for the last time: it may write over it.
    assert buffers["neg"].index == buffers["exp"].index
    assert buffers["tanh"].index != buffers["neg"].index  # neg is still read by the add
    assert buffers["add"] is None and buffers["sum"] is None  # escaping: returned, emitted
    not_in_place = ArenaPlan(StorageLiveness(func.body))
    buffers = assign_in_order(func, not_in_place, in_place_ops=())
    assert buffers["neg"].index != buffers["exp"].index  # a reduction or matmul must not overwrite its operand
    assert buffers["tanh"].index == buffers["exp"].index  # free once neg has read it
    assert not_in_place.size == 2 * 64 * 4


def test_exact_plan_reuses_only_buffers_of_the_same_key():
    def body(g):
        a = g.exp(g.inputs["x"])
        b = g.sum(a, axes=[0], keep=False)  # a dies here; b is [8], a different key
        c = g.exp(g.inputs["x"])  # [8 8]: takes a's buffer
        return {"y": g.mul(c, g.broadcast(b, shape=[8, 8]))}

    func = make_func({"x": ((8, 8), "f32")}, body)
    plan = ArenaPlan(StorageLiveness(func.body))
    exps = [op for op in func.body.ops if op.name == "graph.exp"]
    first = plan.assign(exps[0].result, in_place=True)
    total = plan.assign(next(op for op in func.body.ops if op.name == "graph.sum").result, in_place=False)
    second = plan.assign(exps[1].result, in_place=True)
    assert second.index == first.index and total.index != first.index
    assert (plan.size, len(plan.buffers)) == (8 * 8 * 4 + 8 * 4, 3)


def test_arena_plan_aligns_splits_and_merges_free_ranges():
    def body(g):
        x = g.inputs["x"]
        small = g.exp(g.slice(x, axis=0, start=0, end=10))  # 40 bytes -> 256
        big = g.exp(x)  # 400 bytes -> 512
        last = g.add(g.sum(small, axes=[0], keep=False), g.sum(big, axes=[0], keep=False))  # both die at their sums
        again = g.tanh(x)  # 512 fits where small and big were, merged
        return {"y": g.mul(g.broadcast(last, shape=[100]), again)}

    func = make_func({"x": ((100,), "f32")}, body)
    plan = ArenaPlan(StorageLiveness(func.body), alignment=256, exact=False)
    ops = list(func.body.ops)
    placed = {}
    for op in ops:
        name = op.name.removeprefix("graph.")
        if name in ("exp", "sum", "add", "tanh"):
            placed.setdefault(name, []).append(plan.assign(op.result, in_place=name != "sum"))
    small, big = placed["exp"]
    assert (small.offset, small.nbytes, big.offset, big.nbytes) == (0, 256, 256, 512)
    sums = placed["sum"]
    assert all(b.offset % 256 == 0 and b.nbytes == 256 for b in sums)
    assert sums[0].offset == 768  # small is still read by nothing but its sum: not yet free
    (tanh,) = placed["tanh"]
    # At the add the sums die (in place: before it is placed) and the free ranges merge into one
    # [0, 1024): the add takes its first 256 bytes, tanh the next 512; the arena never grew past
    # small, big and a sum live together.
    assert placed["add"][0].offset == 0
    assert (tanh.offset, tanh.nbytes) == (256, 512)
    assert plan.size == 1024
