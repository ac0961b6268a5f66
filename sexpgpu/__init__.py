"""sexpgpu: a compiler toolkit for deep-learning experiments written as S-expressions."""

__version__ = "0.1.0"
