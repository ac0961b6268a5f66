"""Named pipelines the verbs and the Python API run."""

#: From a .sx file to every graph a training run executes. `autodiff` cleans its own output
#: (canonicalize, cse, dce); the cleanup before `plan-memory` is for what the passes since autodiff add.
TRAINING_PIPELINE = (
    "evaluate,autodiff,diagnose,accumulate,build-updates,fold-constants,insert-casts,canonicalize,cse,dce,plan-memory"
)

#: After the training pipeline, for a CUDA device: the pattern kernels, fusion of everything else into
#: kernel launches and cuBLASLt GEMMs, every buffer's place, the CUDA C (docs/cuda.md, "The lowering").
CUDA_LOWERING = "match-patterns,fuse,plan-buffers,emit-cuda"

#: What `sexpgpu sample` compiles: the training pipeline, whose module's fingerprint is the run's, with
#: the model's forward for one sequence (`@sample`) traced too and cleaned by the same passes.
SAMPLING_PIPELINE = TRAINING_PIPELINE.replace("evaluate,", "evaluate{inference=true},", 1)
