"""emit-cuda's library: the CUDA prelude and the kernel templates of the pattern families.

`prelude` holds the text every generated translation unit starts with;
`templates` the parameterised kernel families (row programs, the
cross-entropy tail, deterministic reductions, gather and scatter-add, fill
and copy), each returning a `kernel_source.KernelProgram`; `rows` the
generator the row programs are written with.
"""
