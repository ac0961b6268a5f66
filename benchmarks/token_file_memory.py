"""A loader's memory does not grow with its token file: a 1 GB llm.c file opens at once and trains a step.

    python benchmarks/token_file_memory.py [--gigabytes 1] [--dir DIR]

Writes a synthetic llm.c token file of the given size (uint16 byte ids, header
magic 20240520) in DIR (default: a temporary directory, removed after), then
in a fresh process each: opens a `token-file` loader on it (the time, and what
opening read: the header's page), and trains tiny-gpt's smoke variant for one
step reading it (the vocabulary check scans the whole file first). Each line
gives the process's peak resident memory and, at its end, its anonymous
(private) and file-backed resident memory, against the same step on the
bundled 575 KB `train.u16`: flat memory is the same figures for both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

#: Run in a fresh process: open a loader on ARGV[1], or train one step reading it; print the memory figures.
CHILD = r"""
import json, re, sys, time, io
from pathlib import Path

def memory():
    status = Path("/proc/self/status").read_text()
    field = lambda name: int(re.search(name + r":\s+(\d+) kB", status).group(1)) // 1024
    return {"peak_mb": field("VmHWM"), "anon_mb": field("RssAnon"), "file_mb": field("RssFile")}

what, path, example = sys.argv[1:4]
started = time.perf_counter()
if what == "open":
    from sexpgpu.backends.loaders import Field, Loader
    loader = Loader("train", {"kind": "token-file", "path": path}, [Field("tokens", (65,), "i32")], 16, True, 1, None)
    loader.next_batch()
    result = {"tokens": len(loader.tokens)}
else:
    from sexpgpu.backends.training import train
    source = Path(example).read_text().replace('"data/train.u16"', json.dumps(path))
    experiment = Path(path).with_name("memory.sx")
    experiment.write_text(source.replace('"data/val.u16"', json.dumps(str(Path(example).parent / "data/val.u16"))))
    out = Path(path).with_name(f"run-{Path(path).stem}")
    run = train(str(experiment), "smoke", ["steps=1", "warmup=0", "eval-every=1000", "checkpoint-every=1000"], out, stream=io.StringIO())
    result = {"loss": run.train_loss}
print(json.dumps({"seconds": time.perf_counter() - started, **result, **memory()}))
"""


def child(what: str, path: Path) -> dict:
    output = subprocess.run([sys.executable, "-c", CHILD, what, str(path), str(ROOT / "examples" / "tiny-gpt.sx")],
                            capture_output=True, text=True, env={"OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if output.returncode:
        raise SystemExit(f"the {what} process failed:\n{output.stderr}")
    return json.loads(output.stdout.splitlines()[-1])


def write_big(path: Path, gigabytes: float) -> None:
    from sexpgpu.backends.token_files import TokenFileWriter

    writer = TokenFileWriter(path, "llmc", np.dtype("<u2"))
    chunk = (np.arange(1 << 24) * 7919 % 251).astype(np.int64)
    for _ in range(max(1, int(gigabytes * (1 << 30) / 2) // len(chunk))):
        writer.add(chunk)
    writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--dir", help="where to write the file (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        big = Path(scratch) / "big.bin"
        started = time.perf_counter()
        write_big(big, args.gigabytes)
        print(f"wrote {big.stat().st_size / (1 << 30):.2f} GiB of llm.c tokens in {time.perf_counter() - started:.1f}s")
        small = Path(scratch) / "train.u16"
        small.write_bytes((ROOT / "examples" / "data" / "train.u16").read_bytes())
        for what in ("open", "train"):
            for name, path in (("bundled 575 KB", small), (f"{args.gigabytes:g} GB", big)):
                r = child(what, path)
                label = "open + one batch" if what == "open" else "one training step"
                print(f"{label:18} {name:15} {r['seconds']:6.2f}s  peak RSS {r['peak_mb']:5} MB  "
                      f"anonymous {r['anon_mb']:5} MB  file-backed {r['file_mb']:5} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
