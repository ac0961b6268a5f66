"""Named pipelines the verbs and the Python API run."""

#: From a .sx file to every graph a training run executes. `autodiff` cleans its own output
#: (canonicalize, cse, dce); the cleanup before `plan-memory` is for what the passes since autodiff add.
TRAINING_PIPELINE = (
    "evaluate,autodiff,diagnose,accumulate,build-updates,fold-constants,insert-casts,canonicalize,cse,dce,plan-memory"
)
