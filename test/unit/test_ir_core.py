"""The IR core: use-def chains, replacing and erasing, insertion, builder type inference."""

import pytest
import sexpgpu.dialects  # noqa: F401  (registers every op)
from sexpgpu.dialects.core import Builder, Operation, Region, TensorType, Value, VerifyError
from sexpgpu.dialects.graph import ShapeError

from sexpgpu.diagnostics import Location

F4 = TensorType((4,), "f32")


def make_func():
    func = Operation.create("graph.func", attributes={"sym_name": "f"}, regions=[Region.with_block()])
    b = Builder(func.body)
    x = b.create("graph.input", attributes={"name": "x", "role": "batch"}, result_types=[F4]).result
    return func, b, x


def test_uses_track_every_operand_slot():
    _, b, x = make_func()
    add = b.create("graph.add", [x, x])
    assert len(x.uses) == 2
    assert {(u.op, u.index) for u in x.uses} == {(add, 0), (add, 1)}
    assert list(x.users()) == [add]


def test_replace_all_uses_with_moves_every_use():
    _, b, x = make_func()
    y = b.value("graph.exp", x)
    z = b.value("graph.neg", x)
    user = b.create("graph.add", [y, y])
    y.replace_all_uses_with(z)
    assert user.operands == [z, z]
    assert not y.uses
    assert {u.index for u in z.uses} == {0, 1}


def test_set_operand_updates_both_use_lists():
    _, b, x = make_func()
    y = b.value("graph.exp", x)
    neg = b.create("graph.neg", [x])
    neg.set_operand(0, y)
    assert not x.uses or all(u.op is not neg for u in x.uses)
    assert [u.op for u in y.uses] == [neg]


def test_erase_unlinks_operands_and_refuses_used_results():
    func, b, x = make_func()
    y = b.create("graph.exp", [x])
    z = b.create("graph.neg", [y.result])
    with pytest.raises(ValueError, match="still has uses"):
        y.erase()
    z.erase()
    y.erase()
    assert not x.uses
    assert len(func.body) == 1
    assert [op.name for op in func.body.ops] == ["graph.input"]


def test_insert_before_after_and_order():
    func, b, x = make_func()
    last = b.create("graph.exp", [x])
    first = Operation.create("graph.neg", [x], [F4])
    func.body.insert_before(first, last)
    after = Operation.create("graph.abs", [x], [F4])
    func.body.insert_after(after, last)
    assert [op.name for op in func.body.ops] == ["graph.input", "graph.neg", "graph.exp", "graph.abs"]
    assert [op.name for op in func.body.reversed_ops()] == ["graph.abs", "graph.exp", "graph.neg", "graph.input"]
    assert first.prev_op is func.body.first_op and after is func.body.last_op
    with pytest.raises(ValueError, match="already in a block"):
        func.body.append(first)


def test_builder_inserts_before_anchor():
    func, b, x = make_func()
    anchor = b.create("graph.exp", [x])
    Builder(func.body, anchor=anchor).create("graph.neg", [x])
    assert [op.name for op in func.body.ops] == ["graph.input", "graph.neg", "graph.exp"]


def test_builder_infers_result_types():
    _, b, x = make_func()
    m = b.create("graph.reshape", [x], {"shape": [2, 2]})
    assert m.result.type == TensorType((2, 2), "f32")
    c = b.create("graph.lt", [x, x])
    assert c.result.type.dtype == "i1"


def test_builder_inference_error_names_shapes_and_location():
    _, b, x = make_func()
    b.loc = Location("model.sx", 3, 7)
    with pytest.raises(ShapeError, match=r"cannot reshape \[4\] to \[3\]") as err:
        b.create("graph.reshape", [x], {"shape": [3]})
    assert err.value.loc == Location("model.sx", 3, 7)
    y = b.value("graph.reshape", x, shape=[2, 2])
    with pytest.raises(ShapeError, match=r"operands have shapes \[4\] and \[2, 2\]"):
        b.create("graph.add", [x, y])


def test_builder_rejects_unknown_ops_and_free_results():
    _, b, _ = make_func()
    with pytest.raises(ValueError, match="unknown op"):
        b.create("graph.nope")
    with pytest.raises(ValueError, match="explicit result types"):
        b.create("graph.const", attributes={"value": 1.0})


def test_verify_locates_shape_errors_at_the_op():
    func, b, x = make_func()
    bad = Operation.create("graph.exp", [x], [TensorType((5,), "f32")], loc=Location("m.sx", 2, 1))
    func.body.append(bad)
    with pytest.raises(VerifyError, match="does not match the inferred") as err:
        bad.verify_one()
    assert err.value.op is bad and err.value.loc == Location("m.sx", 2, 1)


def test_verify_reports_malformed_attributes_as_user_errors():
    _, b, x = make_func()
    op = b.create("graph.sum", [x], {"axes": 0, "keep": False}, result_types=[TensorType((), "f32")])
    with pytest.raises(VerifyError, match="malformed attributes"):
        op.verify_one()


def test_walk_is_preorder():
    func, b, x = make_func()
    b.create("graph.exp", [x])
    assert [op.name for op in func.walk()] == ["graph.func", "graph.input", "graph.exp"]


def _module_holding(func: Operation) -> Operation:
    module = Operation.create("builtin.module", regions=[Region.with_block()])
    module.body.append(func)
    return module


def test_clone_copies_nested_regions_and_maps_values_inside_the_copy():
    from sexpgpu.dialects.printer import print_op

    func, b, x = make_func()
    doubled = b.value("graph.add", x, x)
    b.create("graph.return", [doubled], {"names": ["y"]})
    module = _module_holding(func)
    copy = module.clone()
    assert print_op(copy) == print_op(module)
    (func_copy,) = copy.body.ops
    assert func_copy is not func and func_copy.parent is copy.body and copy.parent is None
    x_copy, add_copy, ret_copy = func_copy.body.ops
    assert add_copy.operands == [x_copy.result, x_copy.result]  # inside the copy, the copy's values
    assert ret_copy.operands[0] is add_copy.result
    assert len(x.uses) == 2 and len(x_copy.result.uses) == 2  # the original's uses are untouched


def test_clone_maps_operands_through_the_value_map_and_records_each_copy():
    func, b, x = make_func()
    y = b.create("graph.input", attributes={"name": "y", "role": "batch"}, result_types=[F4]).result
    add = b.create("graph.add", [x, y])
    other = Value(F4)
    values = {x: other}
    copy = add.clone(values)
    assert copy.operands == [other, y]  # mapped, and kept where absent
    assert values[add.result] is copy.result
    assert copy.parent is None and add.parent is func.body


def test_clone_keeps_locations_and_name_hints():
    loc = Location("model.sx", 3, 7)
    func, b, x = make_func()
    x.name_hint = "tokens"
    x.op.loc = loc
    x.op.text_loc = Location("model.sxir", 2, 1)
    copy = func.clone()
    x_copy = copy.body.first_op
    assert x_copy.loc == loc and x_copy.text_loc == Location("model.sxir", 2, 1)
    assert x_copy.result.name_hint == "tokens"


def test_clone_copies_mutable_attributes_and_shares_immutable_ones():
    func, b, x = make_func()
    op = b.create("graph.sum", [x], {"axes": [0], "keep": False, "extra": {"members": [{"path": "a"}]}})
    copy = op.clone()
    assert copy.attributes == op.attributes
    copy.attributes["axes"].append(1)
    copy.attributes["extra"]["members"][0]["path"] = "b"
    copy.attributes["keep"] = True
    assert op.attributes == {"axes": [0], "keep": False, "extra": {"members": [{"path": "a"}]}}
    assert copy.results[0].type is op.results[0].type  # types are immutable: shared
