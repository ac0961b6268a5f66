"""What cuda-sim reads from a CUDA source before compiling it.

The kernels (`extern "C" __global__ void NAME(...)`, with their parameter
declarations and `__launch_bounds__`) and the `extern __shared__` arrays.
The compiler itself tells the parameters' kinds and sizes (the export
section asks it); the names and the declared types here are for messages.
"""

from __future__ import annotations

import re

from attrs import frozen

_COMMENT_OR_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)
_BALANCED = r"\((?:[^()]|\([^()]*\))*\)"
_KERNEL_HEAD = re.compile(
    r'\bextern\s*"C"\s+(?P<head>(?:[^;{}()"]|__launch_bounds__\s*' + _BALANCED + r")*?)"
    r"\b(?!__launch_bounds__\b)(?P<name>[A-Za-z_]\w*)\s*\("
)
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\s*\((?P<args>(?:[^()]|\([^()]*\))*)\)")
_EXTERN_SHARED = re.compile(r"\bextern\s+__shared__\b[^;]*?\b(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*;")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
#: Words that end a parameter's type rather than name it (`unsigned int` has no name).
_TYPE_WORDS = frozenset(
    "void bool char short int long float double signed unsigned const volatile __restrict__ __restrict "
    "size_t ptrdiff_t int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t".split()
)


@frozen
class ParamDecl:
    """A kernel parameter as the source declares it."""

    name: str
    type: str


@frozen
class KernelDecl:
    """A kernel as the source declares it; `launch_bounds` is the text inside `__launch_bounds__(...)`."""

    name: str
    params: tuple[ParamDecl, ...]
    launch_bounds: str | None
    line: int


def without_comments(text: str) -> str:
    """`text` with every comment blanked out (newlines kept, so lines still count), literals untouched."""

    def blank(match: re.Match[str]) -> str:
        token = match.group(0)
        if token[0] in "\"'":
            return token
        return "".join(ch if ch == "\n" else " " for ch in token)

    return _COMMENT_OR_LITERAL.sub(blank, text)


def find_kernels(source: str) -> list[KernelDecl]:
    """Every `extern "C" __global__` function, once each (a prototype and its definition are one kernel)."""
    text = without_comments(source)
    kernels: dict[str, KernelDecl] = {}
    for match in _KERNEL_HEAD.finditer(text):
        head = match.group("head")
        if "__global__" not in head.split():
            continue
        name = match.group("name")
        bounds = _LAUNCH_BOUNDS.search(head)
        params = _split_params(text, match.end())
        kernels.setdefault(
            name,
            KernelDecl(
                name=name,
                params=tuple(_param(decl, i) for i, decl in enumerate(params)),
                launch_bounds=bounds.group("args").strip() if bounds else None,
                line=text.count("\n", 0, match.start("name")) + 1,
            ),
        )
    return list(kernels.values())


def extern_shared_names(source: str) -> list[str]:
    """The names of the `extern __shared__ T name[];` arrays, each once."""
    return list(dict.fromkeys(m.group("name") for m in _EXTERN_SHARED.finditer(without_comments(source))))


def _split_params(text: str, start: int) -> list[str]:
    """The parameter declarations of the list that opens just before `start`, split at top-level commas."""
    depth, params, current = 0, [], []
    for ch in text[start:]:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            params.append("".join(current))
            current = []
            continue
        current.append(ch)
    params.append("".join(current))
    params = [" ".join(p.split()) for p in params]
    return [] if params in ([""], ["void"]) else params


def _param(decl: str, index: int) -> ParamDecl:
    words = _IDENTIFIER.findall(decl)
    if len(words) >= 2 and words[-1] not in _TYPE_WORDS and decl.endswith(words[-1]):
        return ParamDecl(words[-1], decl[: -len(words[-1])].strip())
    return ParamDecl(f"arg{index}", decl)
