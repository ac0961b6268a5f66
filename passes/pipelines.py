"""Named pipelines the verbs and the Python API run."""

#: From a .sx file to every graph a training run executes.
TRAINING_PIPELINE = (
    "evaluate,autodiff,diagnose,accumulate,build-updates,fold-constants,insert-casts,canonicalize,cse,dce,plan-memory"
)
