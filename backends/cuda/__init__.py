"""Where the CUDA executor registers (`register_executor("cuda", ..., probe=...)`, backends/executor.py).

This build has none, so `--device cuda` is refused with the registry's reason.
"""
