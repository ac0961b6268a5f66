# lit configuration: golden tests piping sexpgpu / sexpgpu-opt into filecheck.
import importlib.util
import os
import shutil
import sys

import lit.formats

config.name = "sexpgpu"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".sx", ".sxir", ".test"]
config.excludes = ["Inputs", "lit.cfg.py"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.test_source_root, "Output")

bindir = os.path.dirname(sys.executable)
config.environment["PATH"] = os.pathsep.join([bindir, config.environment.get("PATH", os.environ.get("PATH", ""))])
config.environment["PYTHONIOENCODING"] = "utf-8"
for tool in ("sexpgpu", "sexpgpu-opt", "filecheck"):
    if shutil.which(tool, path=config.environment["PATH"]) is None:
        lit_config.fatal(f"{tool} not found next to {sys.executable}: run pip install -e '.[test]'")
config.substitutions.append(("%python", sys.executable))

# `REQUIRES: matplotlib` / `UNSUPPORTED: matplotlib` for the plot verb's tests.
if importlib.util.find_spec("matplotlib") is not None:
    config.available_features.add("matplotlib")

# `UNSUPPORTED: cuda-gpu` for the tests of what `--device cuda` says on a machine without a CUDA GPU.
from sexpgpu.backends.cuda.selection import runtime_unavailable  # noqa: E402

if runtime_unavailable("cuda") is None:
    config.available_features.add("cuda-gpu")

# One kernel and lowering cache for the whole suite (`explain --device cuda --target` tests): a file the
# suite lowered once is read back by every later RUN line that lowers it the same way.
config.environment["SEXPGPU_CACHE"] = os.environ.get("SEXPGPU_LIT_CACHE") or os.path.join(
    config.test_exec_root, "sexpgpu-cache")
