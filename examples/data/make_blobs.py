"""Writes blobs-train.npz and blobs-val.npz for examples/mlp-classifier.sx.

Four classes of points in 8 dimensions, each class a Gaussian blob around its
own centre (centres drawn once from a fixed seed, so the files are
reproducible). Each archive holds `x` [N, 8] f32 and `label` [N] i32, one
array per loader field.

    python examples/data/make_blobs.py
"""

from pathlib import Path

import numpy as np

FEATURES = 8
CLASSES = 4
SPREAD = 1.5


def blobs(rng: np.random.Generator, centres: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, CLASSES, count).astype(np.int32)
    points = centres[labels] + SPREAD * rng.standard_normal((count, FEATURES))
    return points.astype(np.float32), labels


def main() -> None:
    here = Path(__file__).resolve().parent
    rng = np.random.default_rng(2024)
    centres = 2.0 * rng.standard_normal((CLASSES, FEATURES))
    for name, count in (("blobs-train.npz", 4096), ("blobs-val.npz", 512)):
        x, label = blobs(rng, centres, count)
        np.savez(here / name, x=x, label=label)


if __name__ == "__main__":
    main()
