// cuda-sim's stand-in for <mma.h>: cuda_sim.h, force-included before the source,
// already emulates the nvcuda::wmma subset a kernel uses from it.
#pragma once
