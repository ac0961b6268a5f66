"""NVRTC compiles CUDA C to CUBIN without a GPU: realistic kernels, ptxas's figures, errors, the cache."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import textwrap

import pytest
from sexpgpu.backends.cuda import nvrtc
from sexpgpu.backends.cuda.errors import KernelCompileError
from sexpgpu.backends.cuda.nvrtc import KernelResources, compile_cubin, cubin_arch, parse_ptxas_log
from sexpgpu.tools.common import guarded

# Three kernels in the style emit-cuda writes: a warp-per-row softmax (shuffle reductions), a bf16
# layernorm (block reduction through shared memory, bf16 storage, f32 math), and an AdamW update
# through 128-bit float4 loads. NVRTC has no INFINITY: a generated kernel defines its own constants.
KERNELS = textwrap.dedent(r"""
    #include <cuda_bf16.h>
    #define SX_NEG_INF __int_as_float(0xff800000u)

    extern "C" __global__ void softmax_rows(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
        const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
        const int lane = threadIdx.x % 32;
        if (row >= rows) return;
        const float* xr = x + (size_t)row * cols;
        float m = SX_NEG_INF;
        for (int i = lane; i < cols; i += 32) m = fmaxf(m, xr[i]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float s = 0.f;
        for (int i = lane; i < cols; i += 32) s += expf(xr[i] - m);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const float inv = 1.f / s;
        for (int i = lane; i < cols; i += 32) y[(size_t)row * cols + i] = expf(xr[i] - m) * inv;
    }

    __device__ __forceinline__ float block_sum(float v, float* partial) {
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
        __syncthreads();
        v = threadIdx.x % 32 < blockDim.x / 32 ? partial[threadIdx.x % 32] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        __syncthreads();
        return v;
    }

    extern "C" __global__ void layernorm_bf16(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                              const __nv_bfloat16* __restrict__ b, __nv_bfloat16* __restrict__ y,
                                              float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                              int cols, float eps) {
        __shared__ float partial[32];
        const size_t row = blockIdx.x;
        const __nv_bfloat16* xr = x + row * cols;
        float sum = 0.f;
        for (int i = threadIdx.x; i < cols; i += blockDim.x) sum += __bfloat162float(xr[i]);
        const float mean = block_sum(sum, partial) / cols;
        float squares = 0.f;
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float d = __bfloat162float(xr[i]) - mean;
            squares += d * d;
        }
        const float rstd = rsqrtf(block_sum(squares, partial) / cols + eps);
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float n = (__bfloat162float(xr[i]) - mean) * rstd;
            y[row * cols + i] = __float2bfloat16(n * __bfloat162float(w[i]) + __bfloat162float(b[i]));
        }
        if (threadIdx.x == 0) { mean_out[row] = mean; rstd_out[row] = rstd; }
    }

    __device__ __forceinline__ float adamw_one(float p, float g, float& m, float& v, float lr, float beta1, float beta2,
                                               float eps, float decay, float correction1, float correction2) {
        m = beta1 * m + (1.f - beta1) * g;
        v = beta2 * v + (1.f - beta2) * g * g;
        return p - lr * ((m / correction1) / (sqrtf(v / correction2) + eps) + decay * p);
    }

    extern "C" __global__ void adamw_f32x4(float4* __restrict__ param, const float4* __restrict__ grad,
                                           float4* __restrict__ m, float4* __restrict__ v, int n4, float lr,
                                           float beta1, float beta2, float eps, float decay,
                                           float correction1, float correction2) {
        const int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i >= n4) return;
        float4 p = param[i], mi = m[i], vi = v[i];
        const float4 g = grad[i];
        p.x = adamw_one(p.x, g.x, mi.x, vi.x, lr, beta1, beta2, eps, decay, correction1, correction2);
        p.y = adamw_one(p.y, g.y, mi.y, vi.y, lr, beta1, beta2, eps, decay, correction1, correction2);
        p.z = adamw_one(p.z, g.z, mi.z, vi.z, lr, beta1, beta2, eps, decay, correction1, correction2);
        p.w = adamw_one(p.w, g.w, mi.w, vi.w, lr, beta1, beta2, eps, decay, correction1, correction2);
        param[i] = p; m[i] = mi; v[i] = vi;
    }
""")

SMALL = 'extern "C" __global__ void scale(float* y, float a, int n) { int i = threadIdx.x; if (i < n) y[i] *= a; }\n'


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test compiles into a cache of its own, never the user's."""
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_realistic_kernels_compile_to_cubin_for_the_architecture(arch):
    module = compile_cubin(KERNELS, arch, name="patterns")
    assert module.image[:4] == b"\x7fELF"
    assert cubin_arch(module.image) == arch
    assert module.arch == arch
    assert set(module.kernels) == {"softmax_rows", "layernorm_bf16", "adamw_f32x4"}
    for kernel in module.kernels.values():
        assert 0 < kernel.registers <= 255, kernel
        assert not kernel.spills and kernel.stack_frame == 0, kernel
    assert module.spilling() == []
    assert module.kernels["layernorm_bf16"].shared == 32 * 4  # the partial sums
    assert module.kernels["layernorm_bf16"].barriers == 1
    assert module.kernels["softmax_rows"].shared == 0
    assert not module.from_cache


def test_a_kernel_that_spills_is_reported():
    source = r"""
    extern "C" __global__ void spills(float* y, int n) {
        float a[256];
        for (int i = 0; i < 256; ++i) a[i] = y[i * n];
        for (int j = 0; j < n; ++j) for (int i = 0; i < 256; ++i) a[(i * 7 + j) & 255] += a[i] * 1.0001f;
        for (int i = 0; i < 256; ++i) y[i] = a[i];
    }
    """
    module = compile_cubin(source, "sm_90", name="spills")
    [spilling] = module.spilling()
    assert spilling.name == "spills" and spilling.spill_stores > 0 and spilling.stack_frame > 0


def test_ptxas_log_parsed_per_kernel():
    log = textwrap.dedent("""\
        ptxas info    : 0 bytes gmem
        ptxas info    : Function properties for helper
        ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Compiling entry function 'spill_k' for 'sm_80'
        ptxas info    : Function properties for spill_k
        ptxas         .     1088 bytes stack frame, 96 bytes spill stores, 64 bytes spill loads
        ptxas info    : Used 255 registers, used 0 barriers, 1088 bytes cumulative stack size, 364 bytes cmem[0]
        ptxas info    : Compile time = 768.082 ms
        ptxas info    : Compiling entry function 'smem_k' for 'sm_80'
        ptxas info    : Function properties for smem_k
        ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 10 registers, used 1 barriers, 1024 bytes smem, 360 bytes cmem[0]
        ptxas info    : Compile time = 7.300 ms
    """)
    assert parse_ptxas_log(log) == {
        "spill_k": KernelResources("spill_k", registers=255, stack_frame=1088, spill_stores=96, spill_loads=64,
                                   shared=0, barriers=0),
        "smem_k": KernelResources("smem_k", registers=10, stack_frame=0, spill_stores=0, spill_loads=0,
                                  shared=1024, barriers=1),
    }


def test_headers_and_library_come_from_the_wheels():
    toolchain = nvrtc.nvrtc_toolchain()
    assert toolchain.version[0] == 13
    assert toolchain.library_found_via == "site-packages"
    assert toolchain.include_found_via == ("site-packages",)
    for folder in (toolchain.library, *toolchain.include_dirs):
        assert "site-packages" in folder and not folder.startswith("/usr/local/cuda"), folder


def test_compile_error_is_internal_with_log_and_model_path(capsys):
    source = SMALL.replace("y[i] *= a;", "y[i] *= a")  # the missing semicolon

    def generate() -> int:
        try:
            compile_cubin(source, "sm_90", name="scale_fused_3", model_path="model.blocks.0.mlp")
        except KernelCompileError as err:
            assert err.kernel == "scale_fused_3" and err.target == "sm_90"
            assert "scale_fused_3.cu(1): error: expected a \";\"" in err.log
            raise
        return 0

    assert guarded(generate) == 3
    err = capsys.readouterr().err
    assert "internal error" in err
    assert "NVRTC rejected the generated kernel scale_fused_3 (model path model.blocks.0.mlp) for sm_90:" in err
    assert 'scale_fused_3.cu(1): error: expected a ";"' in err


def test_the_code_generator_attaches_the_model_path():
    with pytest.raises(KernelCompileError) as caught:
        try:
            compile_cubin(SMALL.replace("y[i] *= a;", "y[i] = -INFINITY;"), "sm_80", name="fill")
        except KernelCompileError as err:
            raise err.at("model.head") from None
    assert caught.value.model_path == "model.head"
    assert 'identifier "INFINITY" is undefined' in str(caught.value)  # NVRTC has no <math.h> macros


def test_second_compile_hits_the_cache(private_cache):
    first = compile_cubin(SMALL, "sm_90")
    second = compile_cubin(SMALL, "sm_90")
    assert not first.from_cache and second.from_cache
    assert second.image == first.image and second.kernels == first.kernels and second.log == first.log
    entries = list(private_cache.rglob("*"))
    assert [p.name for p in entries if p.is_file()] == [f"{first.key}.cubin"]


def test_cache_key_covers_source_arch_and_options():
    toolchain = nvrtc.nvrtc_toolchain()
    key = nvrtc.cache_key(SMALL, "sm_90", ("--std=c++17",), toolchain)
    assert key == nvrtc.cache_key(SMALL, "sm_90", ("--std=c++17",), toolchain)
    variants = {
        nvrtc.cache_key(SMALL, "sm_80", ("--std=c++17",), toolchain),
        nvrtc.cache_key(SMALL, "sm_90", ("--std=c++17", "-lineinfo"), toolchain),
        nvrtc.cache_key(SMALL + "\n", "sm_90", ("--std=c++17",), toolchain),
    }
    assert key not in variants and len(variants) == 3
    sm80 = compile_cubin(SMALL, "sm_80")
    assert not sm80.from_cache and cubin_arch(sm80.image) == "sm_80"
    assert not compile_cubin(SMALL, "sm_80", options=("--std=c++17", "-lineinfo")).from_cache


def test_cache_key_covers_the_compiler_identity():
    toolchain = nvrtc.nvrtc_toolchain()
    other = nvrtc.Nvrtc(toolchain.version, toolchain.library, toolchain.library_found_via, toolchain.include_dirs,
                        toolchain.include_found_via, identity="another build")
    assert nvrtc.cache_key(SMALL, "sm_90", (), toolchain) != nvrtc.cache_key(SMALL, "sm_90", (), other)


def test_a_damaged_entry_is_compiled_again(private_cache):
    first = compile_cubin(SMALL, "sm_90")
    [entry] = private_cache.rglob("*.cubin")
    entry.write_bytes(entry.read_bytes()[:-10])  # as a crash mid-write on a filesystem without ordering would
    again = compile_cubin(SMALL, "sm_90")
    assert not again.from_cache and again.image == first.image
    assert compile_cubin(SMALL, "sm_90").from_cache


def test_concurrent_processes_share_the_cache(private_cache):
    script = ("import sys; from sexpgpu.backends.cuda.nvrtc import compile_cubin; "
              f"sys.stdout.buffer.write(compile_cubin({SMALL!r}, 'sm_90').image)")
    env = dict(os.environ, SEXPGPU_CACHE=str(private_cache))
    workers = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env) for _ in range(4)]
    images = [worker.communicate()[0] for worker in workers]
    assert all(worker.returncode == 0 for worker in workers)
    assert len(set(images)) == 1 and images[0][:4] == b"\x7fELF"
    files = [p for p in private_cache.rglob("*") if p.is_file()]
    assert len(files) == 1 and files[0].suffix == ".cubin"  # no temporary file left behind
    assert compile_cubin(SMALL, "sm_90").image == images[0]


def test_an_unwritable_cache_warns_once_and_still_compiles(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("SEXPGPU_CACHE", str(blocker))
    monkeypatch.setattr(nvrtc, "_UNWRITABLE_ROOTS_WARNED", set())
    assert compile_cubin(SMALL, "sm_90").image[:4] == b"\x7fELF"
    assert compile_cubin(SMALL, "sm_80").image[:4] == b"\x7fELF"
    err = capsys.readouterr().err
    assert err.count("warning: cannot write the kernel cache") == 1 and "SEXPGPU_CACHE" in err


def test_default_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("SEXPGPU_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert nvrtc.cache_root() == tmp_path / "sexpgpu"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert nvrtc.cache_root() == tmp_path / "home" / ".cache" / "sexpgpu"


def test_ptx_targets_are_refused():
    with pytest.raises(ValueError, match="CUBIN for a real architecture"):
        compile_cubin(SMALL, "compute_90")


# --- without the `cuda` extra -----------------------------------------------------------------------

@pytest.fixture
def fresh_toolchain():
    """Locate the toolchain again (under the test's patches), and again after it."""
    nvrtc.nvrtc_toolchain.cache_clear()
    yield
    nvrtc.nvrtc_toolchain.cache_clear()


def _one_line_user_error(capsys) -> str:
    assert guarded(lambda: compile_cubin(SMALL, "sm_90")) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert "pip install 'sexpgpu[cuda]'" in lines[0] and "pip install -e '.[cuda]'" in lines[0]
    return lines[0]


def test_without_cuda_python_one_line_names_the_install_command(fresh_toolchain, monkeypatch, capsys):
    real_import = builtins.__import__

    def without_cuda(name, *args, **kwargs):
        if name == "cuda" or name.startswith("cuda."):
            raise ModuleNotFoundError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_cuda)
    line = _one_line_user_error(capsys)
    assert line.startswith("error: cuda-python is not installed (No module named 'cuda")


def test_without_the_nvrtc_wheel(fresh_toolchain, monkeypatch, capsys):
    from cuda import pathfinder

    def not_found(name):
        raise pathfinder.DynamicLibNotFoundError(f"Failure finding lib{name}.so")

    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", not_found)
    assert "nvidia-cuda-nvrtc" in _one_line_user_error(capsys)


def test_without_the_runtime_headers(fresh_toolchain, monkeypatch, capsys):
    from cuda import pathfinder

    monkeypatch.setattr(pathfinder, "locate_nvidia_header_directory", lambda name: None)
    assert "nvidia-cuda-runtime" in _one_line_user_error(capsys)



def test_crt_headers_carried_into_another_site_are_found_beside_the_runtimes(tmp_path, monkeypatch) -> None:
    """The device check installs a carried nvidia-cuda-crt under its own site: crt/mma.h (the wmma API the
    attention kernels use) then lives in another folder of the `nvidia` namespace package than cuda_bf16.h."""
    import nvidia

    runtime = tmp_path / "site" / "nvidia" / "cu13" / "include"
    carried = tmp_path / "carried" / "nvidia" / "cu13" / "include"
    (carried / "crt").mkdir(parents=True)
    runtime.mkdir(parents=True)
    (carried / "crt" / "mma.h").write_text("")
    monkeypatch.setattr(nvidia, "__path__", [str(tmp_path / "site" / "nvidia"), str(tmp_path / "carried" / "nvidia")])
    assert nvrtc._crt_include_dir(str(runtime)) == str(carried)
    (runtime / "crt").mkdir()
    (runtime / "crt" / "mma.h").write_text("")
    assert nvrtc._crt_include_dir(str(runtime)) is None  # the usual wheel layout: one folder holds both
