"""emit-cuda's library: the CUDA prelude and the kernel templates of the pattern families.

`prelude` holds the text every generated translation unit starts with;
`templates` the parameterised kernel families (row programs, the
cross-entropy tail, deterministic reductions, gather and scatter-add, fill
and copy), each returning a `kernel_source.KernelProgram`; `rows` the
generator the row programs are written with. `fused` writes the kernels
`fuse` generates from their bodies, `launches` plans how every kernel is
launched, and `emit` is the `emit-cuda` pass that puts a module's kernels
into one translation unit.
"""

from . import emit as emit  # registers the emit-cuda pass

