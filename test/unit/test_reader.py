"""The reader: values, locations, errors, and agreement with the grammar's LALR parser."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sexpgpu.frontend.data import Keyword, SxList, SxMap, SxVector, Symbol, element_loc, loc_of
from sexpgpu.frontend.printing import show
from sexpgpu.frontend.reader import parse_with_lark, read_text

from sexpgpu.diagnostics import SxError


def test_atoms():
    forms = read_text('42 -3 1_000 0.0015 1e-10 -2.5e3 inf -inf "a\\"b\\\\c\\n\\t" :k true false nil x/y')
    assert forms[:7] == [42, -3, 1000, 0.0015, 1e-10, -2500.0, math.inf]
    assert forms[7] == -math.inf
    assert forms[8] == 'a"b\\c\n\t'
    assert forms[9] is Keyword("k")
    assert forms[10:13] == [True, False, None]
    assert forms[13] == Symbol("x/y")
    assert math.isnan(read_text("nan")[0])


def test_numbers_need_a_delimiter():
    assert read_text("1abc 1.2.3")[0] == Symbol("1abc")
    assert read_text("1.2.3")[0] == Symbol("1.2.3")


def test_containers_and_quotes():
    lst, vec, mp, q = read_text("(a [1 2] {:k v}) [1] {:a 1} 'x")
    assert isinstance(lst, SxList) and isinstance(vec, SxVector) and isinstance(mp, SxMap)
    assert q == [Symbol("quote"), Symbol("x")]
    assert show(read_text("`(a ,b ,@c)")[0]) == "`(a ,b ,@c)"


def test_comments():
    assert read_text("; x\n#| y\n z |# 1 #_(2 3) 4 #_ #_ 5 6 7") == [1, 4, 7]


def test_locations_of_every_element():
    forms = read_text("(f 1\n   :k \"s\")", "t.sx")
    form = forms[0]
    assert str(loc_of(form)) == "t.sx:1:1"
    assert str(loc_of(form[0])) == "t.sx:1:2"
    assert [str(element_loc(form, i)) for i in range(4)] == ["t.sx:1:2", "t.sx:1:4", "t.sx:2:4", "t.sx:2:7"]
    assert element_loc(form, 2).end_col == 6


@pytest.mark.parametrize(
    "text, where, message",
    [
        ("(a\n (b)", "1:1", "unclosed '(' opened at 1:1"),
        ("(a]", "1:3", "expected ')' to close '(' opened at 1:1, found ']'"),
        ("  )", "1:3", "unexpected ')'"),
        ('"abc', "1:1", "unterminated string"),
        ('"a\\qb"', "1:3", "bad escape '\\q'"),
        ("#| x", "1:1", "unterminated block comment"),
        ("(a ')", "1:4", "expected a form after '''"),
    ],
)
def test_errors_are_located(text, where, message):
    with pytest.raises(SxError) as err:
        read_text(text, "e.sx")
    assert str(err.value.loc) == f"e.sx:{where}"
    assert message in err.value.message


def test_deep_nesting_needs_no_recursion():
    depth = 50_000
    form = read_text("(" * depth + ")" * depth)[0]
    for _ in range(depth - 1):
        form = form[0]
    assert form == []


# -- property: the fast reader and the LALR reference agree, and only SxError escapes --

atoms = st.one_of(
    st.integers(-10**6, 10**6).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8).map(
        lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
    ),
    st.sampled_from(["x", "train/loss", "model.embed", "+", "<=", "set!", "&rest", ":k", "nil", "true", "inf"]),
)
datums = st.recursive(
    atoms,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "(" + " ".join(xs) + ")"),
        st.lists(inner, max_size=4).map(lambda xs: "[" + " ".join(xs) + "]"),
        st.tuples(st.sampled_from(["'", "`", ",", ",@", "#_"]), inner).map(lambda p: p[0] + p[1] + " 1"),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(datums, max_size=5).map(" ; c\n".join))
def test_fast_reader_agrees_with_lark(text):
    fast = read_text(text, "p.sx")
    reference = parse_with_lark(text, "p.sx")
    assert show(fast) == show(reference)
    assert_same_locations(fast, reference)


def assert_same_locations(fast, reference):
    """Every container, element and symbol is located as the reference reader locates it."""
    assert fast.__class__ is reference.__class__
    if isinstance(fast, Symbol):
        assert fast.loc == reference.loc
    if isinstance(fast, (SxList, SxVector, SxMap)):
        assert fast.loc == reference.loc
        assert [element_loc(fast, i) for i in range(len(fast))] == reference.locs
        assert fast.locs == reference.locs
        for a, b in zip(fast, reference):
            assert_same_locations(a, b)


def test_locations_are_built_on_demand_and_shared():
    forms = read_text("(f 'x\n  [1 \"a\nb\" :k])", "d.sx")
    form = forms[0]
    assert element_loc(form, 0) is form[0].loc is element_loc(form, 0)
    vec = form[2]
    assert vec.loc is element_loc(form, 2)
    assert [(lc.line, lc.col, lc.end_col) for lc in vec.locs] == [(2, 4, 5), (2, 6, None), (3, 4, 6)]
    quoted = form[1]
    assert (quoted.loc.col, quoted.loc.end_col) == (4, None) and quoted[0].loc is quoted.loc
    assert (quoted[1].loc.col, quoted[1].loc.end_col) == (5, 6)
    # A location set by hand (as macro expansion stamps one) replaces the lazy one.
    copy = vec.with_items([1, 2, 3])
    assert copy.locs == vec.locs and copy.loc is vec.loc
    vec.loc = None
    assert vec.loc is None and copy.loc is not None
    form[0].loc = None
    assert form[0].loc is None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="()[]{}'`,@#_|;:\"\\ \nabc1.e-", max_size=40))
def test_random_text_reads_or_fails_with_a_located_error(text):
    try:
        read_text(text, "r.sx")
    except SxError as e:
        assert e.loc is not None and e.loc.file == "r.sx"


def test_skipping_is_linear_before_a_bad_character():
    """Whitespace runs and comments skipped with no nested repetition: an error after many is quick."""
    import time

    text = "(a\n" + "  ; c\n  #| b |#\n" * 20000 + "   #q)"
    start = time.process_time()
    with pytest.raises(SxError) as err:
        read_text(text, "s.sx")
    assert time.process_time() - start < 5
    assert str(err.value.loc) == "s.sx:40002:4" and "unknown reader syntax '#q'" in err.value.message


# -- files: what is read, and how -------------------------------------------------------------


def test_a_byte_order_mark_is_skipped(tmp_path):
    from sexpgpu.frontend.reader import read_file

    path = tmp_path / "bom.sx"
    path.write_bytes(b"\xef\xbb\xbf(f 1)\n")
    forms = read_file(str(path))
    assert forms == [[Symbol("f"), 1]]
    assert str(loc_of(forms[0])) == f"{path}:1:1"


@pytest.mark.parametrize(
    ("data", "where", "byte"),
    [
        (b"(f 1)\n; caf\xe9\n", "2:6", "0xe9"),
        (b"\xff(f)", "1:1", "0xff"),
        ("(f \"héllo\" ".encode() + b"\xc3(", "1:12", "0xc3"),
    ],
)
def test_bytes_that_are_not_utf8_are_an_error_at_the_bad_byte(tmp_path, data, where, byte):
    from sexpgpu.frontend.reader import read_file

    path = tmp_path / "latin.sx"
    path.write_bytes(data)
    with pytest.raises(SxError, match=f"the file is not UTF-8 text: byte {byte}") as err:
        read_file(str(path))
    assert str(err.value.loc) == f"{path}:{where}"


def test_files_that_are_not_regular_files_are_refused_without_blocking(tmp_path):
    import os

    from sexpgpu.frontend.reader import read_file

    fifo = tmp_path / "pipe.sx"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (tmp_path, "a directory"), ("/dev/zero", "a character device")):
        with pytest.raises(SxError, match=f"cannot read '{path}': it is {kind}, not a file"):
            read_file(str(path))


def test_an_integer_literal_over_the_digit_limit_is_an_error_at_it():
    from sexpgpu.frontend.reader import MAX_INT_DIGITS

    assert read_text("1" * MAX_INT_DIGITS)[0] == int("1" * MAX_INT_DIGITS)
    for reader in (read_text, parse_with_lark):
        with pytest.raises(SxError, match=f"integer literal of {MAX_INT_DIGITS + 1} digits is too long") as err:
            reader("(f\n  " + "9" * (MAX_INT_DIGITS + 1) + ")", "big.sx")
        assert (err.value.loc.line, err.value.loc.col) == (2, 3)


def test_long_strings_and_comments_with_escapes_read_whole():
    body = "ab\\n\\\"c" * 10000
    forms = read_text('#| a | b |# (s "' + body + '") #| x |#', "s.sx")
    assert forms[0][1] == "ab\n\"c" * 10000
    assert read_text('"' + "x" * 100000 + '"')[0] == "x" * 100000
