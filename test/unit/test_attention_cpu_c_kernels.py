"""The cpu-c attention kernels (backends/cpu_c/attention.py) alone, against a float64 numpy reference.

Each case builds the two `kern.kernel`s of one attention (the forward and the backward's one step, as the
`cpu-c` target plans it) as `match-patterns` does, renders their C with the unit prelude, compiles it with the host
compiler and the project's flags, and runs them through ctypes in order: Q, K and V read from one packed
[B, T, 3·H·d] projection, O, dO and the gradients in merged heads [B, T, H, d], as in tiny-gpt. Head
dimensions 8, 32 and 40 (one vector, a whole tile, a tile and a vector), sequences 1, 7, 17 and 64 (the
last a multiple of a query block), causal and full, f32 and bf16 storage. O, the log-sum-exp, dQ, dK and dV
are checked: |got - want| <= tol * (|want| + max(max|want|, 1)), tol = 1e-5 for f32 and 2e-2 for bf16 (as
the CUDA kernels' test; the inputs are standard normal, so a result that cancels to 0, as dQ of one token,
is held to tol), the reference computed from the stored inputs. Outputs start as NaN, so an element no
kernel writes fails. The results are the same bit for bit on 1 and 2 threads.
"""

from __future__ import annotations

import ctypes
import functools

import ml_dtypes
import numpy as np
import pytest
from sexpgpu.backends.cpu_c import compiler
from sexpgpu.backends.cpu_c.attention import ATTENTION_PRELUDE
from sexpgpu.backends.cpu_c.compiler import compile_shared, missing_compiler
from sexpgpu.backends.cpu_c.kernels import PRELUDE
from sexpgpu.backends.cpu_c.render import kernel_code, kernel_function
from sexpgpu.backends.cpu_c.target import ATTENTION_BACKWARD_READS, ATTENTION_BACKWARD_WRITES
from sexpgpu.dialects.core import Operation, TensorType

pytestmark = pytest.mark.skipif(missing_compiler() is not None, reason="no C compiler with OpenMP on this machine")

NUMPY_DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
TOLERANCE = {"f32": 1e-5, "bf16": 2e-2}
BATCH, HEADS = 2, 2
SEQS = (1, 7, 17, 64)
#: Each step's (inputs, outputs), by operand name, in the order of the kernel's C parameters.
STEPS = {
    ("forward", 0): (("q", "k", "v"), ("o", "lse")),
    ("backward", 0): (ATTENTION_BACKWARD_READS, ATTENTION_BACKWARD_WRITES),
}


class Attention:
    """The two kernels of one attention, compiled into one shared object, and its buffers."""

    def __init__(self, head_dim: int, seq: int, causal: bool, dtype: str, seed: int = 0) -> None:
        self.head_dim, self.seq, self.causal, self.dtype = head_dim, seq, causal, dtype
        self.scale = 1.0 / np.sqrt(head_dim)
        width = HEADS * head_dim
        packed = [str(seq * 3 * width), str(head_dim), str(3 * width)]
        merged = ["0", str(seq * width), str(head_dim), str(width)]
        self.placements = {"q": ["0", *packed], "k": [str(width), *packed], "v": [str(2 * width), *packed],
                           **{name: merged for name in ("o", "do", "dq", "dk", "dv")}}
        self.kernels = [self._kernel(direction, step) for direction, step in STEPS]
        self.library: ctypes.CDLL | None = None
        rng = np.random.default_rng(seed)
        storage = NUMPY_DTYPES[dtype]
        self.buffers = {"qkv": rng.standard_normal((BATCH, seq, 3 * width)).astype(storage),
                        "do": rng.standard_normal((BATCH, seq, HEADS, head_dim)).astype(storage)}

    def _kernel(self, direction: str, step: int) -> Operation:
        inputs, outputs = STEPS[(direction, step)]
        names = [*inputs, *outputs]
        stats = TensorType(shape=(BATCH, HEADS, self.seq), dtype="f32")
        tensor = TensorType(shape=(BATCH, self.seq, HEADS, self.head_dim), dtype=self.dtype)
        types = [stats if name == "lse" else tensor for name in names]
        return Operation("kern.kernel", attributes={
            "sym_name": f"attention_{direction}_{step}_{self.seq}_{'causal' if self.causal else 'full'}", "kind": "attention", "direction": direction,
            "step": step, "head_dim": self.head_dim, "causal": self.causal, "scale": self.scale,
            "placements": self.placements, "sizes": {"batch": BATCH, "heads": HEADS, "seq": self.seq},
            "operands": names, "inputs": types[:len(inputs)], "outputs": types[len(inputs):]})

    def code(self) -> str:
        """The C of the kernels and, for ctypes, an exported function calling each (they are hidden)."""
        code = ""
        for op in self.kernels:
            count = len(op.attributes["inputs"]) + len(op.attributes["outputs"])
            function = kernel_function(op.attributes["sym_name"])
            code += (kernel_code(op) + f"void sx_test_{function}({', '.join(f'void* p{k}' for k in range(count))}) {{\n"
                     f"    {function}({', '.join(f'p{k}' for k in range(count))});\n}}\n")
        return code

    def run(self, threads: int) -> dict[str, np.ndarray]:
        """O, the log-sum-exp, dQ, dK and dV of the kernels run on `threads` threads (outputs start as NaN)."""
        assert self.library is not None, "compile() it first"
        self.library.sx_test_threads(threads)
        storage = NUMPY_DTYPES[self.dtype]
        qkv, do = self.buffers["qkv"], self.buffers["do"]
        values = {"q": qkv, "k": qkv, "v": qkv, "do": do}
        for name in ("o", "dq", "dk", "dv"):
            values[name] = np.full(do.shape, np.nan, dtype=storage)
        values["lse"] = np.full((BATCH, HEADS, self.seq), np.nan, dtype=np.float32)
        for op, (inputs, outputs) in zip(self.kernels, STEPS.values()):
            call = getattr(self.library, f"sx_test_{kernel_function(op.attributes['sym_name'])}")
            call(*(ctypes.c_void_p(values[name].ctypes.data) for name in (*inputs, *outputs)))
        return {name: values[name].astype(np.float64) for name in ("o", "lse", "dq", "dk", "dv")}

    def reference(self) -> dict[str, np.ndarray]:
        """The float64 results from the stored inputs, in the kernels' layouts."""
        d, width = self.head_dim, HEADS * self.head_dim
        qkv = self.buffers["qkv"].astype(np.float64)

        def heads(x: np.ndarray) -> np.ndarray:  # [B, T, H·d] -> [B, H, T, d]
            return x.reshape(BATCH, self.seq, HEADS, d).transpose(0, 2, 1, 3)
        q, k, v = (heads(qkv[..., part * width:(part + 1) * width]) for part in range(3))
        do = self.buffers["do"].astype(np.float64).transpose(0, 2, 1, 3)
        scores = self.scale * q @ k.transpose(0, 1, 3, 2)
        if self.causal:
            scores = np.where(np.tril(np.ones((self.seq, self.seq), dtype=bool)), scores, -np.inf)
        top = scores.max(axis=-1, keepdims=True)
        lse = (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))
        p = np.exp(scores - lse)
        o = p @ v
        dp = do @ v.transpose(0, 1, 3, 2)
        ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))

        def merged(x: np.ndarray) -> np.ndarray:  # [B, H, T, d] -> [B, T, H, d]
            return x.transpose(0, 2, 1, 3)
        return {"o": merged(o), "lse": lse[..., 0], "dq": merged(self.scale * ds @ k),
                "dk": merged(self.scale * ds.transpose(0, 1, 3, 2) @ q), "dv": merged(p.transpose(0, 1, 3, 2) @ do)}


def compile_attentions(attentions: list[Attention]) -> ctypes.CDLL:
    """Build the kernels of `attentions` into one shared object (one compile) and give it to each."""
    unit = (PRELUDE + ATTENTION_PRELUDE + "".join(attention.code() for attention in attentions)
            + "void sx_test_threads(int n) {\n#ifdef _OPENMP\n    omp_set_num_threads(n);\n#endif\n}\n"
            + "int sx_test_wide(void) {\n#ifdef SX_ATT_WIDE\n    return 1;\n#else\n    return 0;\n#endif\n}\n")
    library, _ = compile_shared([unit], use_cache=False)
    for attention in attentions:
        attention.library = library
    return library


@functools.cache
def compiled(head_dim: int, dtype: str) -> dict[tuple[int, bool], Attention]:
    """Every (seq, causal) case of a head dimension and storage type, compiled together."""
    cases = {(seq, causal): Attention(head_dim, seq, causal, dtype, seed=head_dim * 1000 + seq)
             for seq in SEQS for causal in (True, False)}
    compile_attentions(list(cases.values()))
    return cases


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("head_dim", [8, 32, 40])
def test_attention_kernels_against_reference(head_dim, seq, causal, dtype):
    attention = compiled(head_dim, dtype)[(seq, causal)]
    got, want = attention.run(threads=1), attention.reference()
    for name in want:
        magnitude = max(np.abs(want[name]).max(), 1.0)
        error = np.abs(got[name] - want[name])
        bound = TOLERANCE[dtype] * (np.abs(want[name]) + magnitude)
        assert np.all(error <= bound), (name, float(np.nanmax(error - bound)))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_kernels_do_not_depend_on_the_thread_count(causal):
    attention = Attention(32, 64, causal, "f32")
    compile_attentions([attention])
    one, two = attention.run(threads=1), attention.run(threads=2)
    for name in one:
        assert np.array_equal(one[name], two[name]), name


def test_wide_tiles_give_the_narrow_tiles_bits(monkeypatch):
    """Head dimension 40 and 64 keys: rows of sums through 16-lane tiles (2 vectors, then 1) and the 8-lane
    tail, against the same kernels compiled without AVX-512 (8-lane tiles only)."""
    wide = Attention(40, 64, True, "f32", seed=7)
    if not compile_attentions([wide]).sx_test_wide():
        pytest.skip("the host compiler targets no AVX-512 here: the kernels have 8-lane tiles only")
    narrow = Attention(40, 64, True, "f32", seed=7)
    monkeypatch.setattr(compiler, "FLAGS", (*compiler.FLAGS, "-mno-avx512f"))
    assert not compile_attentions([narrow]).sx_test_wide()
    got, want = wide.run(threads=1), narrow.run(threads=1)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
