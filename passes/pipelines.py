"""Named pipelines the verbs and the Python API run."""

#: What `sexpgpu check` runs, as `clang -fsyntax-only` stops before the optimizer: the training pipeline's
#: passes that may reject the experiment, warn about it or add a graph a run executes. The rest of the
#: training pipeline only rewrites or measures graphs that exist (no user error, no warning, no graph
#: added or removed), so `check` reports the same on a file either way and spends none of its time there.
CHECK_PIPELINE = "evaluate,autodiff,diagnose,accumulate,build-updates"

#: From a .sx file to every graph of the experiment. `autodiff` cleans its own output (canonicalize, cse,
#: dce); the cleanup before `plan-memory` is for what the passes since autodiff add.
TRAINING_PIPELINE = f"{CHECK_PIPELINE},fold-constants,insert-casts,canonicalize,cse,dce,plan-memory"

#: After the training pipeline: the bf16 working copies of the weights (docs/passes.md#working-copies), which a
#: run's graphs read and its updates write; a report of the lowering without a device makes them as a run does.
WORKING_COPIES = "working-copies"

#: After the training pipeline, for a run: the bf16 working copies of the weights (their updates write them,
#: the model graphs read them instead of casting), and the graphs the training driver runs beside the
#: experiment's (`derived`): the copies made from the parameters, each optimizer group's update and the
#: clipping over flat arrays.
RUN_GRAPHS = f"{WORKING_COPIES},flatten-updates"

#: After `RUN_GRAPHS`, for a device that stacks microbatches (`Executor.stacks_microbatches`): a stacked
#: train graph for each degree it may choose among by memory.
STACK_VARIANTS = "stack-variants"

#: After the training pipeline, for a CUDA device: casts before the views matmuls read, the pattern kernels,
#: GEMM operand layouts, fusion of everything else into kernel launches and cuBLASLt GEMMs, every buffer's
#: place, the CUDA C (docs/cuda.md, "The lowering").
CUDA_LOWERING = "gemm-layouts{transposes=false},match-patterns,gemm-layouts,fuse,plan-buffers,emit-cuda"


def cuda_lowering(arch: str) -> str:
    """`CUDA_LOWERING` for the device architecture `arch` (`sm_90`): launches planned for its size (a column
    reduction split to fill its SMs)."""
    return CUDA_LOWERING.replace(",fuse,", f",fuse{{arch={arch}}},", 1) if arch else CUDA_LOWERING


def run_graphs(stacking: bool) -> str:
    """The passes after the training pipeline that make the graphs a training run executes beside the
    experiment's; with `stacking`, the stacking variants too."""
    return RUN_GRAPHS + (f",{STACK_VARIANTS}" if stacking else "")


#: What `sexpgpu sample` compiles: the training pipeline, whose module's fingerprint is the run's, with
#: the model's forward for one sequence (`@sample`) traced too and cleaned by the same passes.
SAMPLING_PIPELINE = TRAINING_PIPELINE.replace("evaluate,", "evaluate{inference=true},", 1)

#: After the training pipeline, for the compiled CPU target (`cpu-c`): the CUDA lowering's target-independent
#: passes, asking the `cpu-c` kernel target (backends/cpu_c/target.py); the C renderer (backends/cpu_c/)
#: reads the `kern` plan they leave.
CPU_C_LOWERING = ("gemm-layouts{transposes=false},match-patterns{target=cpu-c},gemm-layouts,fuse{target=cpu-c},"
                  "plan-buffers")
