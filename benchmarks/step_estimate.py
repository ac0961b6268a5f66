"""The step estimate of GPT-2 small on each GPU of the table: the yardstick of the lowering's launches and traffic.

    python benchmarks/step_estimate.py [--example examples/gpt2-small.sx] [--gpu h200 --gpu h100 ...] [--top 10]

What `sexpgpu explain FILE --device cuda --target sm_90 --gpu G` models (docs/cuda.md, "The step
estimate"; `passes/roofline.py`), for each GPU: the stacking degree a run there would choose, launches a
step, GB of device-memory traffic, the modelled step time, tokens a second, MFU, the shares of GEMMs,
memory-bound kernels and launch costs, and the launches taking the most modelled time with their model
paths. No GPU is needed: the lowering is compiled for sm_90 by NVRTC (cached under `$SEXPGPU_CACHE`).

Issue 18's reference for GPT-2 small on an H200, from an earlier roofline of the same lowering: about
4,600 launches, 390 GB, 150 ms and 17% MFU; llm.c's kernels at the same shapes about 2,600 launches,
100 GB, 60 ms and 44% MFU. The goal: at most 2,800 launches, 130 GB, and at least 40% MFU.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from sexpgpu.passes.roofline import GPUS
from sexpgpu.tools.explain_cmd import target_document, with_estimate

from sexpgpu.targets import register_targets

ROOT = Path(__file__).resolve().parents[1]
#: Issue 18's figures for GPT-2 small on an H200: (launches, GB, ms, MFU).
REFERENCE = {"today": (4600, 390, 150, 0.17), "llm.c": (2600, 100, 60, 0.44), "goal": (2800, 130, None, 0.40)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default=str(ROOT / "examples" / "gpt2-small.sx"))
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--gpu", action="append", choices=list(GPUS), help="repeatable (default: every GPU of the table)")
    parser.add_argument("--top", type=int, default=10, help="launches listed by modelled time (at most 10)")
    args = parser.parse_args()
    register_targets()
    name = Path(args.example).name
    for key in args.gpu or list(GPUS):
        gpu = GPUS[key]
        start = time.perf_counter()
        document = with_estimate(target_document(args.example, None, [], args.arch, gpu), gpu, launches=False)
        modelled = document["device"]["estimate"]
        shares = modelled["shares"]
        print(f"{name} on {key} ({gpu.name}), stacking {modelled['stacking']}  "
              f"[lowered and modelled in {time.perf_counter() - start:.1f} s]")
        print(f"  launches a step     {modelled['launches']}")
        print(f"  device memory       {modelled['bytes'] / 1e9:.1f} GB")
        print(f"  FLOPs               {modelled['flops'] / 1e12:.2f} TFLOP, {modelled['gemm_flops'] / 1e12:.2f} in GEMMs"
              + (f" ({modelled['flops_per_token'] / 1e6:.0f} MFLOP a token)" if modelled["flops_per_token"] else ""))
        print(f"  modelled step       {modelled['step_ms']:.1f} ms")
        if modelled["tokens_per_second"] is not None:
            print(f"  tokens/s            {modelled['tokens_per_second']:,.0f}")
        print(f"  MFU                 {modelled['mfu']:.1%} ({modelled['mfu_dtype']} dense peak)")
        print(f"  shares              GEMMs {shares['gemm']:.1%}, memory-bound kernels {shares['memory_bound']:.1%}, "
              f"compute-bound kernels {shares['compute_bound']:.1%}, launches {shares['launch']:.1%}")
        if modelled["unmodelled"]:
            print(f"  no FLOP model       {', '.join(modelled['unmodelled'])} kernels (counted by their bytes)")
        print(f"  top {min(args.top, len(modelled['top']))} launches by modelled time:")
        for launch in modelled["top"][:args.top]:
            print(f"    {launch['ms_per_step']:7.3f} ms  {launch['bytes'] / 1e6:9.1f} MB  {launch['flops'] / 1e9:9.1f} GFLOP  "
                  f"{launch['kernel']:<44} {launch['path'] or '-'}")
    print("issue 18 (GPT-2 small on an H200): launches, GB, ms, MFU")
    for label, (launches, gigabytes, ms, mfu) in REFERENCE.items():
        print(f"  {label:<6} {launches:>5}  {gigabytes:>4} GB  {f'{ms} ms' if ms else '-':>6}  {mfu:.0%}")


if __name__ == "__main__":
    main()
