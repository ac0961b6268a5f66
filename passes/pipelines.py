"""Named pipelines the verbs and the Python API run."""

#: From a .sx file to every graph a training run executes. `autodiff` cleans its own output
#: (canonicalize, cse, dce); the cleanup before `plan-memory` is for what the passes since autodiff add.
TRAINING_PIPELINE = (
    "evaluate,autodiff,diagnose,accumulate,build-updates,fold-constants,insert-casts,canonicalize,cse,dce,plan-memory"
)

#: After the training pipeline, for a CUDA device: the pattern kernels, fusion of everything else into
#: kernel launches and cuBLASLt GEMMs, every buffer's place, the CUDA C (docs/cuda.md, "The lowering").
CUDA_LOWERING = "match-patterns,fuse,plan-buffers,emit-cuda"

#: After the training pipeline, for the compiled CPU target (`cpu-c`): the CUDA lowering's target-independent
#: passes; the C renderer (backends/cpu_c/) reads the `kern` plan they leave.
CPU_C_LOWERING = "match-patterns,fuse,plan-buffers"
