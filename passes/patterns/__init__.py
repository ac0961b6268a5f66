"""The pieces of `match-patterns`: recognising row programs and the cross-entropy tail from their math.

- `domain`: the row domain of a reduction along one axis (rows, per-row
  values, columns, whole values) and which graph ops live in it;
- `regions`: growing a region from a reduction through the ops of its domain;
- `evaluate`: the region's ops evaluated in float64 on a few sample rows;
- `families`: each family's formula, and the numeric search that binds a
  region's values to a family's inputs and outputs;
- `forms`: the spelling a match was written in, read off its structure;
- `plans`: which matched regions are replaced and which fall back, and why;
- `attention`: attention (`softmax(scale·Q·Kᵀ + mask)·V` and its backward)
  recognised around a softmax match, its plans and its kernels' operands.

docs/cuda.md, section "Pattern families", describes the method.
"""
