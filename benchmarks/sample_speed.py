"""`sexpgpu sample` speed: 200 tokens of tiny-gpt on one core (the goal: under 2 seconds).

    python benchmarks/sample_speed.py [RUN] [--tokens 200] [--device cpu]

RUN is a run record of `examples/tiny-gpt.sx` (default: a fresh one trained for
one step in a temporary directory; the speed does not depend on the weights).
The process is pinned to one core with one BLAS thread. Prints the time to
compile the experiment and load the checkpoint (once per `sample`), and the
wall and CPU time and tokens/s of generating, greedy and sampled. There is no key-value
cache yet: every token recomputes the whole window (tiny-gpt's 64 tokens),
so this is the without-cache figure only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="a tiny-gpt run record (default: train one step now)")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from sexpgpu.backends.devices import open_device
    from sexpgpu.backends.sampling import Sampler, locate_run
    from sexpgpu.backends.training import train

    with tempfile.TemporaryDirectory() as scratch:
        run = args.run
        if run is None:
            run = str(Path(scratch) / "run")
            with open(os.devnull, "w") as quiet:
                train(str(ROOT / "examples" / "tiny-gpt.sx"), sets=["steps=1"], out=run, stream=quiet)
        started = time.perf_counter()
        sampler = Sampler(locate_run(run), open_device(args.device, "sample"))
        setup = time.perf_counter() - started
        prompt = sampler.encode_prompt("The ")
        print(f"window {sampler.window} tokens, vocabulary {sampler.vocab}, device {args.device}, one core")
        print(f"compile and load: {setup:.2f}s (once per sample command)")
        for name, temperature in (("greedy", 0.0), ("sampled (T 0.8, top-k 200)", 0.8)):
            started, cpu_started = time.perf_counter(), time.process_time()
            tokens = [t for t, _ in sampler.generate(prompt, args.tokens, temperature, 200, seed=1)]
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            print(f"{name}: {len(tokens)} tokens in {seconds:.2f}s wall, {cpu:.2f}s CPU; "
                  f"{len(tokens) / seconds:,.0f} tok/s ({1000 * seconds / len(tokens):.1f} ms a token)")
        print("no KV cache yet: every token recomputes the window. On a shared machine the CPU time is the "
              "steadier figure (one thread: it is the time the core spent)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
