"""sexpgpu: a compiler toolkit for deep-learning experiments written as S-expressions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:
    from .api import Experiment
    from .backends.training import RunResult


# The API imports the compiler lazily, so `import sexpgpu` (and every console script) stays fast.


def compile(path: str, variant: str | None = None, set: dict[str, Any] | None = None) -> Experiment:  # noqa: A001
    """Compile the experiment at `path` under a selection; see `sexpgpu.api.Experiment`."""
    from .api import compile as compile_experiment

    return compile_experiment(path, variant, set)


def train(path: str, variant: str | None = None, set: dict[str, Any] | None = None, out: str | None = None, **options: Any) -> RunResult:  # noqa: A001
    """Train the experiment at `path` as `sexpgpu run` does; returns how the run ended."""
    from .backends.training import train as train_experiment
    from .report.lowering_text import lowering_text

    return train_experiment(path, variant, set, out, lowering_text=lowering_text, **options)


def sample(run: str, prompt: str = "\n", **options: Any) -> dict[str, Any]:
    """Generate from a run's checkpoint as `sexpgpu sample` does; returns its `--json` document
    (options: tokens, temperature, top_k, seed, samples, device, checkpoint, force, on_text)."""
    from .backends.sampling import sample as sample_run

    return sample_run(run, prompt, **options)


__all__ = ["__version__", "compile", "sample", "train"]
