"""The standard builtins of §2: scalars, lists, strings, maps, errors.

Scalars are Python ints and floats (never bools: `(+ 1 true)` is an error).
The arithmetic, math and comparison builtins named in `data.TENSOR_OVERLOADED`
hand the call to `data.TENSOR_OPS[name](loc, *args, **kwargs)` when any argument
is a `TensorLike`; on scalars they compute at once.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

from ..diagnostics import Location, SxError
from .analysis import truthy
from .calls import BuiltinError, builtin, invoke, signature_of
from .data import MAP_KEY_RULE, MAP_KEY_TYPES, TENSOR_OPS, SxList, SxMap, SxVector, TensorLike
from .evaluator import Values
from .limits import INT_LIMIT, MAX_INT_DIGITS, MAX_ITEMS, MAX_STRING_CHARS, int_in_range
from .printing import described, show

_NUMBERS = (int, float)


def _tensor_call(name: str, loc: Location | None, args: tuple, kwargs: dict) -> Any:
    impl = TENSOR_OPS.get(name)
    if impl is None:
        raise SxError(f"'{name}' is not defined on tensors here (tensors exist only while tracing)", loc)
    # The tensor implementation's own signature: (sqrt x) takes one tensor, (max x axis :keep b) an axis.
    signature_of(impl, 1, True).check(name, args, kwargs, loc)
    return impl(loc, *args, **kwargs)


def _has_tensor(args: tuple) -> bool:
    return any(isinstance(a, TensorLike) for a in args)


def _check_numbers(name: str, args: tuple) -> None:
    for a in args:
        if a.__class__ not in _NUMBERS:
            raise BuiltinError(f"expects numbers, got {described(a)}")


def _bounded(value: Any) -> Any:
    """`value`, unless it is an integer over the size bound."""
    if value.__class__ is int and not int_in_range(value):
        raise BuiltinError(f"the result has more than {MAX_INT_DIGITS} digits (integers have at most {MAX_INT_DIGITS})")
    return value


def _overloaded(name: str, scalar: Callable[..., Any], pair: Callable[[Any, Any], Any] | None = None,
                keywords: bool = False) -> None:  # fmt: skip
    """Register an arithmetic builtin: `pair` at once on two numbers, tensors to `TENSOR_OPS`, else `scalar` checked."""
    signature = signature_of(scalar)

    if keywords:

        def fn(loc: Location | None, *args: Any, **kwargs: Any) -> Any:
            if _has_tensor(args):
                return _tensor_call(name, loc, args, kwargs)
            if kwargs:
                raise BuiltinError(f"takes keyword arguments only on tensors, got :{next(iter(kwargs))}")
            _check_numbers(name, args)
            signature.check(name, args, None, loc)
            return scalar(*args)

        builtin(name, loc=True, kwargs=True)(fn)
        return

    def fn(loc: Location | None, *args: Any) -> Any:  # type: ignore[misc]
        if pair is not None and len(args) == 2:
            a, b = args
            if a.__class__ in _NUMBERS and b.__class__ in _NUMBERS:
                result = pair(a, b)
                if result.__class__ is int and not -INT_LIMIT < result < INT_LIMIT:
                    return _bounded(result)
                return result
        if _has_tensor(args):
            return _tensor_call(name, loc, args, {})
        _check_numbers(name, args)
        signature.check(name, args, None, loc)
        return _bounded(scalar(*args))

    builtin(name, loc=True)(fn)


def _variadic(op: Callable[[Any, Any], Any], unit: Any) -> Callable[..., Any]:
    def fold(*args: Any) -> Any:
        if not args:
            return unit
        acc = args[0]
        for a in args[1:]:
            acc = _bounded(op(acc, a))
        return acc

    return fold


def _subtract(*args: Any) -> Any:
    if not args:
        raise BuiltinError("expects at least 1 argument")
    if len(args) == 1:
        return -args[0]
    acc = args[0]
    for a in args[1:]:
        acc = _bounded(acc - a)
    return acc


def _divide2(a: Any, b: Any) -> Any:
    if b == 0:
        raise BuiltinError(f"division by zero: (/ {show(a)} {show(b)})")
    if a.__class__ is int and b.__class__ is int and a % b == 0:
        return a // b
    return a / b


def _divide(*args: Any) -> Any:
    if not args:
        raise BuiltinError("expects at least 1 argument")
    if len(args) == 1:
        return _divide2(1, args[0])
    acc = args[0]
    for a in args[1:]:
        acc = _divide2(acc, a)
    return acc


def _quot(a: Any, b: Any) -> Any:
    if b == 0:
        raise BuiltinError("division by zero")
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _mod(a: Any, b: Any) -> Any:
    if b == 0:
        raise BuiltinError("division by zero")
    return a % b


def _math(fn: Callable[[float], Any]) -> Callable[[Any], Any]:
    def checked(x: Any) -> Any:
        try:
            return fn(x)
        except (ValueError, OverflowError) as e:
            raise BuiltinError(f"{e} for {show(x)}") from None

    return checked


def _pow(a: Any, b: Any) -> Any:
    if a.__class__ is int and b.__class__ is int and abs(a) > 1 and (b > 4 * MAX_INT_DIGITS or b * math.log10(abs(a)) > MAX_INT_DIGITS):
        raise BuiltinError(f"(pow {show(a)} {show(b)}) has more than {MAX_INT_DIGITS} digits (integers have at most {MAX_INT_DIGITS})")
    try:
        result = a**b
    except ZeroDivisionError as e:
        raise BuiltinError(f"{e}: (pow {show(a)} {show(b)})") from None
    except OverflowError:
        raise BuiltinError(f"the result is too large for a float: (pow {show(a)} {show(b)})") from None
    if isinstance(result, complex):
        raise BuiltinError(f"(pow {show(a)} {show(b)}) is not a real number")
    return result


def _log(x: Any) -> Any:
    if x <= 0:
        raise BuiltinError(f"log of a non-positive number {show(x)}")
    return math.log(x)


def _extremum(pick: Callable) -> Callable[..., Any]:
    def fn(*args: Any) -> Any:
        if not args:
            raise BuiltinError("expects at least 1 argument")
        return pick(args)

    return fn


_overloaded("+", _variadic(operator.add, 0), operator.add)
_overloaded("*", _variadic(operator.mul, 1), operator.mul)
_overloaded("-", _subtract, operator.sub)
_overloaded("/", _divide, _divide2)
_overloaded("quot", _quot, _quot)
_overloaded("mod", _mod, _mod)
_overloaded("pow", _pow, _pow)
_overloaded("min", _extremum(min), keywords=True)
_overloaded("max", _extremum(max), keywords=True)
_overloaded("abs", abs)
_overloaded("sqrt", _math(math.sqrt))
_overloaded("exp", _math(math.exp))
_overloaded("log", _log)
_overloaded("cos", _math(math.cos))
_overloaded("sin", _math(math.sin))
_overloaded("tanh", _math(math.tanh))
_overloaded("floor", _math(math.floor))
_overloaded("ceil", _math(math.ceil))
_overloaded("round", _math(round))


# -- comparisons --


def sx_equal(a: Any, b: Any) -> bool:
    """`=`: numbers by value, nil equal to the empty list, containers element by element."""
    if a is None or b is None:
        return (a is None or (isinstance(a, list) and not a)) and (b is None or (isinstance(b, list) and not b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, list) and isinstance(b, list):
        return isinstance(a, SxVector) == isinstance(b, SxVector) and len(a) == len(b) and all(
            sx_equal(x, y) for x, y in zip(a, b)
        )
    return a == b


def _compare(name: str, test: Callable[[Any, Any], bool], numeric: bool) -> None:
    def fn(loc: Location | None, *args: Any) -> Any:
        if _has_tensor(args):
            return _tensor_call(name, loc, args, {})
        if numeric:
            same_kind = all(isinstance(a, str) for a in args)
            if not same_kind:
                _check_numbers(name, args)
        return all(test(a, b) for a, b in zip(args, args[1:]))

    builtin(name, loc=True)(fn)


_compare("=", sx_equal, numeric=False)
_compare("!=", lambda a, b: not sx_equal(a, b), numeric=False)
_compare("<", lambda a, b: a < b, numeric=True)
_compare("<=", lambda a, b: a <= b, numeric=True)
_compare(">", lambda a, b: a > b, numeric=True)
_compare(">=", lambda a, b: a >= b, numeric=True)


@builtin("not", loc=True)
def _not(loc: Location | None, x: Any) -> Any:
    if isinstance(x, TensorLike):
        return _tensor_call("not", loc, (x,), {})
    return not truthy(x)


# -- lists, strings, maps --


def _seq(value: Any, what: str = "a list") -> list:
    if value is None:
        return []
    if isinstance(value, (list, str)) and not isinstance(value, SxMap):
        return value  # type: ignore[return-value]
    raise BuiltinError(f"expects {what}, got {described(value)}")


def _like(source: Any, items: list) -> list:
    """A vector when `source` is one, else a list."""
    return SxVector(items) if isinstance(source, SxVector) else SxList(items)


@builtin("list")
def _list(*items: Any) -> SxList:
    return SxList(items)


@builtin("vector")
def _vector(*items: Any) -> SxVector:
    return SxVector(items)


@builtin("cons")
def _cons(x: Any, xs: Any) -> SxList:
    return SxList([x, *_seq(xs)])


@builtin("first")
def _first(xs: Any) -> Any:
    items = _seq(xs)
    return items[0] if items else None


@builtin("rest")
def _rest(xs: Any) -> Any:
    return _like(xs, list(_seq(xs)[1:]))


@builtin("nth")
def _nth(xs: Any, i: Any) -> Any:
    items = _seq(xs)
    if i.__class__ is not int:
        raise BuiltinError(f"expects an integer index, got {show(i)}")
    if not -len(items) <= i < len(items):
        raise BuiltinError(f"index {i} is out of range for {_count_items(len(items))}")
    return items[i]


def _count_items(n: int) -> str:
    return f"{n} item{'' if n == 1 else 's'}"


@builtin("len")
def _len(xs: Any) -> int:
    if isinstance(xs, dict):
        return len(xs)
    return len(_seq(xs, "a list, vector, string or map"))


@builtin("empty?")
def _empty(xs: Any) -> bool:
    return _len(xs) == 0


@builtin("map", loc=True)
def _map(loc: Location | None, f: Any, xs: Any, *more: Any) -> list:
    if more:
        columns = [_seq(xs)] + [_seq(m) for m in more]
        return _like(xs, [invoke(f, list(args), loc) for args in zip(*columns)])
    return _like(xs, [invoke(f, [x], loc) for x in _seq(xs)])


@builtin("filter", loc=True)
def _filter(loc: Location | None, f: Any, xs: Any) -> list:
    return _like(xs, [x for x in _seq(xs) if truthy(invoke(f, [x], loc))])


def _fold(loc: Location | None, f: Any, init: Any, xs: Any) -> Any:
    acc = init
    for x in _seq(xs):
        acc = invoke(f, [acc, x], loc)
    return acc


builtin("fold", loc=True)(_fold)
builtin("reduce", loc=True)(_fold)


@builtin("range")
def _range(a: Any, b: Any = None, step: Any = 1) -> SxList:
    for v in (a, b, step):
        if v is not None and v.__class__ is not int:
            raise BuiltinError(f"expects integers, got {described(v)}")
    if a is None:
        raise BuiltinError("expects an integer end, got nil")
    if step == 0:
        raise BuiltinError("step must not be 0")
    numbers = range(a) if b is None else range(a, b, step)
    _check_count(len(numbers))
    return SxList(numbers)


def _check_count(n: int) -> None:
    if n > MAX_ITEMS:
        raise BuiltinError(f"would make {n} items; a list or vector holds at most {MAX_ITEMS}")


def _check_chars(text: str) -> str:
    if len(text) > MAX_STRING_CHARS:
        raise BuiltinError(f"would make a string of {len(text)} characters; a string holds at most {MAX_STRING_CHARS}")
    return text


@builtin("concat", loc=True, kwargs=True)
def _concat(loc: Location | None, *parts: Any, **kwargs: Any) -> Any:
    # (concat [t1 t2] axis) joins tensors; otherwise it joins lists.
    if parts and isinstance(parts[0], list) and _has_tensor(tuple(parts[0])):
        return _tensor_call("concat", loc, parts, kwargs)
    if kwargs:
        raise BuiltinError(f"takes keyword arguments only on tensors, got :{next(iter(kwargs))}")
    if parts and all(isinstance(p, str) for p in parts):
        return _check_chars("".join(parts))
    seqs = [_seq(p, "lists or vectors") for p in parts]
    _check_count(sum(len(p) for p in seqs))
    items: list = []
    for p in seqs:
        items.extend(p)
    return SxVector(items) if parts and all(isinstance(p, SxVector) for p in parts) else SxList(items)


@builtin("apply", loc=True)
def _apply(loc: Location | None, f: Any, *args: Any) -> Any:
    if not args:
        raise BuiltinError("expects a function and a list of arguments")
    return invoke(f, [*args[:-1], *_seq(args[-1])], loc)


def display(value: Any) -> str:
    """How `str` and `format` write a value: strings without quotes, the rest as printed."""
    return value if isinstance(value, str) else show(value)


@builtin("str")
def _str(*parts: Any) -> str:
    return _check_chars("".join(display(p) for p in parts))


def format_message(template: Any, args: tuple) -> str:
    """`{}` in `template` takes the next argument; arguments left over are appended."""
    if not isinstance(template, str):
        raise BuiltinError(f"expects a format string, got {show(template)}")
    pieces = template.split("{}")
    if len(pieces) - 1 > len(args):
        need = len(pieces) - 1
        raise BuiltinError(
            f"the format {show(template)} needs {need} argument{'' if need == 1 else 's'}, got {len(args)}"
        )
    out = [pieces[0]]
    for piece, arg in zip(pieces[1:], args):
        out += [display(arg), piece]
    leftover = args[len(pieces) - 1 :]
    return "".join(out) + "".join(" " + display(a) for a in leftover)


@builtin("format")
def _format(template: Any, *args: Any) -> str:
    return _check_chars(format_message(template, args))


@builtin("get")
def _get(m: Any, key: Any, default: Any = None) -> Any:
    if m is None:
        return default
    if isinstance(m, dict):
        return m.get(_map_key(key), default)
    if isinstance(m, (list, str)) and key.__class__ is int:
        return m[key] if -len(m) <= key < len(m) else default
    raise BuiltinError(f"expects a map (or a list and an index), got {described(m)}")


@builtin("assoc")
def _assoc(m: Any, *pairs: Any) -> Any:
    if len(pairs) % 2:
        raise BuiltinError("expects keys and values in pairs")
    if isinstance(m, list) and not isinstance(m, SxMap):
        # A list or vector with index/value pairs (as `get` takes an index): a copy with those replaced.
        items = list(m)
        for i, v in zip(pairs[0::2], pairs[1::2]):
            if i.__class__ is not int:
                raise BuiltinError(f"expects integer indices for {described(m)}, got {described(i)}")
            if not -len(items) <= i < len(items):
                raise BuiltinError(f"index {i} is out of range for {_count_items(len(items))}")
            items[i] = v
        return _like(m, items)
    if m is not None and not isinstance(m, dict):
        raise BuiltinError(f"expects a map (or a list and an index), got {described(m)}")
    out = dict(m or {})
    for k, v in zip(pairs[0::2], pairs[1::2]):
        out[_map_key(k)] = v
    return out


def _map_key(key: Any) -> Any:
    if key.__class__ not in MAP_KEY_TYPES:
        raise BuiltinError(f"{MAP_KEY_RULE}, got {described(key)}")
    return key


@builtin("keys")
def _keys(m: Any) -> SxList:
    if m is None:
        return SxList()
    if not isinstance(m, dict):
        raise BuiltinError(f"expects a map, got {described(m)}")
    return SxList(m.keys())


@builtin("contains?")
def _contains(m: Any, key: Any) -> bool:
    if isinstance(m, dict):
        return _map_key(key) in m
    if isinstance(m, str):
        if not isinstance(key, str):
            raise BuiltinError(f"a string contains strings, not {show(key)}")
        return key in m
    return any(sx_equal(x, key) for x in _seq(m, "a map, list, vector or string"))


@builtin("values")
def _values(*items: Any) -> Values:
    return Values(items)


@builtin("error", loc=True)
def _error(loc: Location | None, message: Any, *args: Any) -> Any:
    if isinstance(message, str):
        raise SxError(format_message(message, args), loc)
    # (error 'bad-size n): the message and the arguments, as `str` would join them with spaces.
    raise SxError(" ".join(display(x) for x in (message, *args)), loc)
