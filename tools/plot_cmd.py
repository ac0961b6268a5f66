"""`sexpgpu plot DIR`: the metrics of a run record over steps, as a PNG (see docs/verbs/plot.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..backends.events import read_events
from ..diagnostics import SxError, UsageError, display_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="a run record (the --out directory of sexpgpu run)")
    parser.add_argument("-o", "--output", metavar="FILE", help="where to write the PNG (default: DIR/metrics.png)")


def metric_series(events: list[dict]) -> dict[str, dict[int, float]]:
    """Metric name → {step: value}: train metrics and the objective from `step` events, evaluations' from `eval`.

    A resumed run appends to the log, so a step may appear twice; the later
    line wins, as it is the one the final parameters descend from.
    """
    series: dict[str, dict[int, float]] = {}
    objective: dict[int, float] = {}
    for event in events:
        if event.get("type") not in ("step", "eval"):
            continue
        if event["type"] == "step" and event.get("loss") is not None:
            objective[int(event["step"])] = float(event["loss"])
        for name, value in event.get("metrics", {}).items():
            if value is not None:
                series.setdefault(name, {})[int(event["step"])] = float(value)
    # The objective is usually also a metric (`(metric train/loss loss)`); draw it only when not.
    train_metrics = {name for e in events if e.get("type") == "step" for name in e.get("metrics", {})}
    if objective and not any(panel_of(name) == "loss" for name in train_metrics):
        series["loss"] = objective
    return series


def panel_of(metric: str) -> str:
    """Metrics sharing a last name component (`train/loss`, `val/loss`) share a panel."""
    return metric.rsplit("/", 1)[-1]


def plot(run_dir: Path, output: Path) -> Path:
    log = run_dir / "events.jsonl"
    if not log.is_file():
        raise SxError(f"{display_path(str(run_dir))} is not a run record: it has no events.jsonl")
    # The record is checked before matplotlib is needed, so a bad record is reported either way.
    series = metric_series(read_events(log))
    if not series:
        raise SxError(f"{display_path(str(log))} holds no metrics yet")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SxError("sexpgpu plot needs matplotlib; install it with: pip install 'sexpgpu[plot]'") from None
    panels: dict[str, list[str]] = {}
    for name in series:
        panels.setdefault(panel_of(name), []).append(name)
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), squeeze=False, sharex=True)
    for ax, (panel, names) in zip(axes[:, 0], panels.items()):
        for name in names:
            steps = sorted(series[name])
            values = [series[name][s] for s in steps]
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
        ax.set_ylabel(panel)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(display_path(str(run_dir)))
    figure.tight_layout()
    try:
        figure.savefig(output, dpi=100)
    except OSError as err:
        raise UsageError(f"cannot write {display_path(str(output))}: {err.strerror or err}") from None
    finally:
        plt.close(figure)
    return output


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.dir)
    output = plot(run_dir, Path(args.output) if args.output else run_dir / "metrics.png")
    print(f"wrote {display_path(str(output))}")
    return 0
