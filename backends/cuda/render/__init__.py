"""The CUDA target's renderer: the prelude, the kernel templates, and the `emit-cuda` pass.

`prelude` holds the text every generated translation unit starts with
(`prelude.cuh`, the source NVRTC and cuda-sim's host compiler both read);
`templates` the parameterised kernel families (row programs, the
cross-entropy tail, deterministic reductions, gather and scatter-add, fill
and copy), each returning a `kernel_source.KernelProgram`; `rows` the
generator the row programs are written with. `fused` writes the kernels
`fuse` generates from their bodies, `launches` plans how every kernel is
launched, `pattern_kernels` the programs behind `match-patterns`' kernels,
and `emit` is the `emit-cuda` pass that puts a module's kernels into one
translation unit (registered by the CUDA target, `backends/cuda/target.py`).
"""
