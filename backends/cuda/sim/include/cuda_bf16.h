// cuda-sim's stand-in for <cuda_bf16.h>: cuda_sim.h, force-included before the source,
// already declares what a kernel uses from it.
#pragma once
