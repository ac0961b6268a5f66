"""The fused attention kernels (backends/cuda/render/attention.py) on cuda-sim, against a float64 numpy reference.

Head dimensions 32, 64 and 128, sequence lengths 1, 17, 64 and 200 (none
but 64 a multiple of a block), causal and not, f32 and bf16 storage, in the
`heads` layout ([B, H, T, d] everywhere) and the `packed` one (q, k, v read
from one [B, T, 3C] projection, o and do merged-heads, dq, dk, dv written
into one packed [B, T, 3C] gradient, whose every element must be written);
two heads, so head strides are exercised. O, the log-sum-exp, dQ, dK and dV
are checked: |got - want| <= tol * (|want| + max|want|), tol = 1e-5 for f32
and 2e-2 for bf16, references computed in float64 from the stored inputs.
Outputs start as the simulator's NaN poison, so an element no kernel writes
fails. Where there is a GPU every test runs again on it (marked `gpu`).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import pytest
from gpu_device import sim_or_gpu_device  # noqa: F401 (the `device` fixture)
from sexpgpu.backends.cuda.nvrtc import compile_cubin
from sexpgpu.backends.cuda.render.attention import (
    HEADS,
    PACKED,
    AttentionLayout,
    Placement,
    attention_backward,
    attention_forward,
)
from sexpgpu.backends.cuda.render.kernel_source import KernelProgram
from sexpgpu.backends.cuda.render.prelude import translation_unit
from sexpgpu.backends.cuda.sim import KernelFault, SimDevice

NUMPY_DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
TOLERANCE = {"f32": 1e-5, "bf16": 2e-2}
BATCH, HEADS_COUNT = 1, 2
SEQS = (1, 17, 64, 200)
#: Operands that share one buffer in each layout (the packed projection and its gradient).
SHARED_BUFFERS = {"packed": (("q", "k", "v"), ("dq", "dk", "dv")), "heads": ()}

#: (head_dim, causal, dtype, layout, tensor_cores): bf16 takes the tensor cores where they fit unless told not to.
SPECS = [(d, causal, dtype, "heads", None) for d in (32, 64, 128) for causal in (True, False)
         for dtype in ("f32", "bf16")]
SPECS += [(64, causal, dtype, "packed", None) for causal in (True, False) for dtype in ("f32", "bf16")]
SPECS += [(32, True, "bf16", "packed", None), (128, False, "f32", "packed", None)]
SPECS += [(64, causal, "bf16", "packed", False) for causal in (True, False)] + [(40, True, "bf16", "heads", None)]


def programs(head_dim: int, causal: bool, dtype: str, layout: str,
             tensor_cores: bool | None = None) -> tuple[KernelProgram, KernelProgram]:
    chosen = {"heads": HEADS, "packed": PACKED}[layout]
    scale = 1.0 / np.sqrt(head_dim)
    return (attention_forward(head_dim, causal=causal, scale=scale, dtype=dtype, layout=chosen,
                              tensor_cores=tensor_cores),
            attention_backward(head_dim, causal=causal, scale=scale, dtype=dtype, layout=chosen,
                               tensor_cores=tensor_cores))


ALL_PROGRAMS = [p for spec in SPECS for p in programs(*spec)]


def reference(q, k, v, do, scale: float, causal: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Attention and its gradients in float64 on [B, H, T, d] arrays, materialised; and the magnitude of each
    result's terms (the same sums of absolute values), which bounds the rounding of results made by
    cancellation (dq and dk are all zero at one position)."""
    scores = scale * q @ np.swapaxes(k, -1, -2)
    seq = q.shape[2]
    if causal:
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    lse = top + np.log(np.exp(scores - top).sum(-1, keepdims=True))
    p = np.exp(scores - lse)
    o = p @ v
    dp = do @ np.swapaxes(v, -1, -2)
    delta = (dp * p).sum(-1, keepdims=True)
    ds = p * (dp - delta)
    ds_terms = p * (np.abs(dp) + np.abs(delta))
    results = {"o": o, "lse": lse[..., 0], "dq": scale * ds @ k, "dk": scale * np.swapaxes(ds, -1, -2) @ q,
               "dv": np.swapaxes(p, -1, -2) @ do}
    magnitudes = {"o": p @ np.abs(v), "lse": np.abs(lse[..., 0]), "dq": scale * ds_terms @ np.abs(k),
                  "dk": scale * np.swapaxes(ds_terms, -1, -2) @ np.abs(q), "dv": np.swapaxes(p, -1, -2) @ np.abs(do)}
    return results, magnitudes


def indices(placement: Placement, shape: tuple[int, int, int, int]) -> np.ndarray:
    """The buffer index of every element of a [B, H, T, d] tensor placed by `placement`."""
    batch, heads, seq, head_dim = shape
    offset, sb, sh, st = placement.evaluate(seq, heads, head_dim)
    b, h, t, d = np.ogrid[:batch, :heads, :seq, :head_dim]
    return offset + b * sb + h * sh + t * st + d


class Buffers:
    """Host images of a layout's buffers: tensors scattered in by placement, gathered back out."""

    def __init__(self, layout: AttentionLayout, shape: tuple[int, int, int, int]) -> None:
        self.layout, self.shape = layout, shape
        self.home: dict[str, str] = {}
        for group in SHARED_BUFFERS[layout.name]:
            for name in group:
                self.home[name] = group[0]

    def buffer(self, name: str) -> str:
        return self.home.get(name, name)

    def size(self, buffer: str) -> int:
        names = [n for n in ("q", "k", "v", "o", "do", "dq", "dk", "dv") if self.buffer(n) == buffer]
        return max(int(indices(self.layout.placement(n), self.shape).max()) + 1 for n in names)

    def scatter(self, tensors: Mapping[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
        images: dict[str, np.ndarray] = {}
        for name, tensor in tensors.items():
            image = images.setdefault(self.buffer(name), np.zeros(self.size(self.buffer(name)), dtype))
            image[indices(self.layout.placement(name), self.shape)] = tensor
        return images

    def gather(self, name: str, image: np.ndarray) -> np.ndarray:
        return image[indices(self.layout.placement(name), self.shape)]


@pytest.fixture(scope="module")
def module(device):
    """Every attention kernel the tests launch in one translation unit, compiled once (and cached on disk)."""
    return device.compile(translation_unit(k for p in ALL_PROGRAMS for k in p.kernels), "attention_kernels.cu")


def run(device, module, program: KernelProgram, buffers: Buffers, sizes: Mapping[str, int],
        images: Mapping[str, np.ndarray], output_bytes: Mapping[str, int], *,
        both_schedules: bool = False) -> dict[str, bytes]:
    """Launch every step of `program`, its operands bound to their buffers; each buffer's bytes afterwards."""
    held = {name: device.upload(image, name) for name, image in images.items()}
    held |= {name: device.alloc(nbytes, name) for name, nbytes in output_bytes.items()}
    try:
        values = dict(sizes) | {p.name: held[buffers.buffer(p.name)] for p in program.params if p.is_pointer}
        for launch in program.launches(values):
            kernel = module.kernel(launch.kernel.name)
            if both_schedules:
                device.compare_schedules(kernel, launch.shape.grid, launch.shape.block, launch.shape.shared_bytes,
                                         launch.arguments)
            else:
                device.launch(kernel, launch.shape.grid, launch.shape.block, launch.shape.shared_bytes,
                              launch.arguments)
        device.check_canaries()
        return {name: device.download(buf, np.uint8).tobytes() for name, buf in held.items()}
    finally:
        for buf in held.values():
            device.free(buf)


def assert_close(name: str, got: np.ndarray, want: np.ndarray, magnitude: np.ndarray, dtype: str) -> None:
    got = got.astype(np.float64)
    assert not np.isnan(got).any(), f"{name}: NaN (an element not written?)"
    bound = TOLERANCE[dtype] * (np.abs(want) + magnitude.max())
    error = np.abs(got - want)
    worst = np.unravel_index(int(np.argmax(error - bound)), want.shape)
    assert np.all(error <= bound), (f"{name}: {int((error > bound).sum())} of {error.size} elements off; worst at "
                                    f"{tuple(int(i) for i in worst)}: got {got[worst]!r}, want {want[worst]!r}")


def attention_case(device, module, head_dim: int, causal: bool, dtype: str, layout_name: str,
                   tensor_cores: bool | None, seq: int, *,
                   both_schedules: bool = False) -> tuple[dict[str, np.ndarray], ...]:
    """Forward then backward on random inputs: what the kernels gave, the float64 reference and its terms'
    magnitudes, by tensor."""
    forward, backward = programs(head_dim, causal, dtype, layout_name, tensor_cores)
    layout = {"heads": HEADS, "packed": PACKED}[layout_name]
    storage = NUMPY_DTYPES[dtype]
    shape = (BATCH, HEADS_COUNT, seq, head_dim)
    rng = np.random.default_rng(zlib.crc32(f"{head_dim} {causal} {dtype} {layout_name} {seq}".encode()))
    tensors = {n: rng.standard_normal(shape).astype(storage) for n in ("q", "k", "v", "do")}
    wide = {n: t.astype(np.float64) for n, t in tensors.items()}
    want, magnitudes = reference(wide["q"], wide["k"], wide["v"], wide["do"], 1.0 / np.sqrt(head_dim), causal)
    buffers = Buffers(layout, shape)
    sizes = {"batch": BATCH, "heads": HEADS_COUNT, "seq": seq}
    itemsize = np.dtype(storage).itemsize
    stat_bytes = BATCH * HEADS_COUNT * seq * 4
    inputs = buffers.scatter({n: tensors[n] for n in ("q", "k", "v")}, storage)
    out = run(device, module, forward, buffers, sizes, inputs, {"o": buffers.size("o") * itemsize, "lse": stat_bytes},
              both_schedules=both_schedules)
    got = {"o": buffers.gather("o", np.frombuffer(out["o"], storage)),
           "lse": np.frombuffer(out["lse"], np.float32).reshape(shape[:3])}
    # The backward reads the reference's o and lse as the device would hold them.
    saved = inputs | buffers.scatter({"o": want["o"].astype(storage), "do": tensors["do"]}, storage)
    saved["lse"] = want["lse"].astype(np.float32)
    gradients = {buffers.buffer(n): buffers.size(buffers.buffer(n)) * itemsize for n in ("dq", "dk", "dv")}
    out = run(device, module, backward, buffers, sizes, saved, gradients | {"delta": stat_bytes},
              both_schedules=both_schedules)
    for name in ("dq", "dk", "dv"):
        got[name] = buffers.gather(name, np.frombuffer(out[buffers.buffer(name)], storage))
    for buffer in gradients:  # every element of a packed gradient belongs to one of dq, dk, dv
        assert not np.isnan(np.frombuffer(out[buffer], storage).astype(np.float64)).any(), buffer
    return got, want, magnitudes


@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("spec", SPECS, ids=["d{}-{}-{}-{}{}".format(d, "causal" if c else "full", t, lay,
                                                                      "-fma" if cores is False else "")
                                             for d, c, t, lay, cores in SPECS])
def test_attention_against_reference(spec, seq, device, module):
    dtype = spec[2]
    got, want, magnitudes = attention_case(device, module, *spec, seq)
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert_close(name, got[name], want[name], magnitudes[name], "f32" if name == "lse" else dtype)


def test_kernels_are_deterministic_and_race_free(device, module):
    """Two runs give the same bits, under both of cuda-sim's schedules (which must agree: no race)."""
    first, *_ = attention_case(device, module, 64, True, "bf16", "packed", None, 200, both_schedules=True)
    second, *_ = attention_case(device, module, 64, True, "bf16", "packed", None, 200, both_schedules=True)
    for name in first:
        assert first[name].tobytes() == second[name].tobytes(), name


def test_layouts_place_each_tensor():
    """The packed layout reads q, k, v at columns 0, C, 2C of a [B, T, 3C] row and writes merged heads."""
    seq, heads, head_dim = 5, 3, 8
    c = heads * head_dim
    assert PACKED.q.evaluate(seq, heads, head_dim) == (0, seq * 3 * c, head_dim, 3 * c)
    assert PACKED.v.evaluate(seq, heads, head_dim) == (2 * c, seq * 3 * c, head_dim, 3 * c)
    assert PACKED.o.evaluate(seq, heads, head_dim) == (0, seq * c, head_dim, c)
    assert HEADS.dk.evaluate(seq, heads, head_dim) == (0, heads * seq * head_dim, seq * head_dim, head_dim)


@pytest.mark.parametrize("bad", ["seq - 1", "len(seq)", "tokens * 2", "__import__('os')"])
def test_a_placement_is_an_expression_of_the_sizes_only(bad):
    with pytest.raises(ValueError, match="is not an expression of seq, heads, head_dim"):
        Placement(bad, "0", "0", "0")


@pytest.mark.parametrize("head_dim, dtype, scale, message", [
    (12, "f32", 1.0, "head dimension 12"), (256, "f32", 1.0, "head dimension 256"),
    (64, "i32", 1.0, "dtype 'i32'"), (64, "f32", float("nan"), "scale nan is not finite")])
def test_what_the_kernels_do_not_take_is_refused(head_dim, dtype, scale, message):
    for template in (attention_forward, attention_backward):
        with pytest.raises(ValueError, match=message):
            template(head_dim, causal=True, scale=scale, dtype=dtype)


@pytest.mark.parametrize("head_dim, dtype", [(64, "f32"), (40, "bf16")])
def test_tensor_cores_are_refused_where_they_do_not_fit(head_dim, dtype):
    for template in (attention_forward, attention_backward):
        with pytest.raises(ValueError, match=f"tensor-core kernels take bf16 storage and head dimensions that are "
                                             f"multiples of 16, not {dtype} and {head_dim}"):
            template(head_dim, causal=False, scale=0.125, dtype=dtype, tensor_cores=True)


WMMA_PRODUCT = r"""
#include <mma.h>
extern "C" __global__ void product(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c, float* d,
                                   int b_col_major, int lanes) {
    using namespace nvcuda;
    if ((int)threadIdx.x >= lanes) return;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, a, 16);
    if (b_col_major) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
        wmma::load_matrix_sync(fb, b, 24);
        wmma::mma_sync(acc, fa, fb, acc);
    } else {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
        wmma::load_matrix_sync(fb, b, 24);
        wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> twice;
    wmma::fill_fragment(twice, 1.0f);
    for (int i = 0; i < acc.num_elements; ++i) twice.x[i] = acc.x[i] + c[0];
    wmma::store_matrix_sync(d, twice, 20, wmma::mem_col_major);
}
"""


@pytest.mark.parametrize("b_col_major", [False, True])
def test_cuda_sim_wmma_is_the_warps_product_in_order_of_k(b_col_major):
    """cuda-sim's wmma: A (row_major, ldm 16) times B (row- or col-major, ldm 24), f32 sums in order of k from the
    accumulator, bit for bit; an element-wise change of every fragment element; a col-major store with ldm 20;
    a warp with a lane that has exited is refused."""
    device = SimDevice()
    module = device.compile(WMMA_PRODUCT, "wmma_product.cu")
    rng = np.random.default_rng(5)
    a = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    b_stored = rng.standard_normal((16, 24)).astype(ml_dtypes.bfloat16)
    b = b_stored[:, :16].T if b_col_major else b_stored[:, :16]  # B [k, n]: col-major reads b_stored[n, k]
    want = np.zeros((16, 16), np.float32)
    for k in range(16):  # products of bf16 are exact in f32; each sum is rounded
        want = want + a[:, k:k + 1].astype(np.float32) * b[k:k + 1, :].astype(np.float32)
    want = want + np.float32(0.5)
    held = [device.upload(a), device.upload(b_stored), device.upload(np.array([0.5], np.float32)),
            device.alloc(16 * 20 * 4)]
    device.compare_schedules(module.kernel("product"), 1, 32, 0, (*held, int(b_col_major), 32))
    got = device.download(held[3], np.float32, (16, 20))[:, :16].T
    assert got.tobytes() == want.tobytes()
    with pytest.raises(KernelFault, match="which needs all 32 lanes of the warp, but lanes 0x80000000 of it"):
        device.launch(module.kernel("product"), 1, 32, 0, (*held, int(b_col_major), 31))


#: What NVRTC compiles: every kernel kind at each head dimension and storage, causal (the full variant differs
#: only in a loop bound and a comparison), and the packed layout's addressing once (ptxas is slow on wmma).
NVRTC_PROGRAMS = [p for d in (32, 64, 128) for dtype in ("f32", "bf16") for p in programs(d, True, dtype, "heads")]
NVRTC_PROGRAMS += [*programs(64, True, "bf16", "packed"), *programs(40, True, "bf16", "heads")]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_attention_kernel_compiles_with_nvrtc_without_spills(arch):
    source = translation_unit(k for p in NVRTC_PROGRAMS for k in p.kernels)
    cubin = compile_cubin(source, arch, name="attention_kernels")
    assert set(cubin.kernels) == {k.name for p in NVRTC_PROGRAMS for k in p.kernels}
    assert not cubin.spilling(), [k.name for k in cubin.spilling()]
    assert all(k.stack_frame == 0 for k in cubin.kernels.values())
