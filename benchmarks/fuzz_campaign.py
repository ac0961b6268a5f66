"""A long fuzz campaign: mutated .sx/.sxir files through every verb; counts per outcome class.

Run: python benchmarks/fuzz_campaign.py --cases 5000 --jobs 2 --out fuzz-findings/
     python benchmarks/fuzz_campaign.py --probes     # one hand-written input per class of bad input

It prints the inputs tried and how many ended in each class (exit 0, located
exit 1, exit 2, exit 3, traceback, hang, unlocated exit 1, killed by a
signal), then each distinct bad outcome (by its innermost frame or message)
with a count and one case number; the input, command line and stderr of every
bad case are saved under `--out` (`<class>-<case>/`). The mutator and the
runner are `test/fuzz/sxfuzz.py`, the ones the CI test (`test/fuzz/test_fuzz.py`)
samples; a case number with the same `--seed` always makes the same input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test" / "fuzz"))

import sxfuzz  # noqa: E402


def run_probes(only: str | None) -> int:
    """Each probe's outcome, time and peak memory; the ones that break the contract are marked."""
    import probes

    failed = 0
    for probe in probes.probes():
        if only and only not in probe.name:
            continue
        result = probes.run_probe(probe)
        first = next((line for line in result.stderr.splitlines() if "error" in line), "")[:110]
        mark = "ok " if result.ok else "BAD"
        failed += not result.ok
        print(f"{mark} {probe.name:<24} {result.kind:<12} {result.seconds:6.1f}s {result.max_rss_mib:7.0f} MiB  "
              f"[{probe.item}]\n      {first}", flush=True)
    print(f"\n{failed} probes broke the contract")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000, help="inputs to try (default 2000)")
    parser.add_argument("--seed", default="campaign", help="the generator's seed (default 'campaign')")
    parser.add_argument("--start", type=int, default=0, help="the first case number")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before a case counts as a hang")
    parser.add_argument("--max-depth", type=int, default=50_000, help="the deepest nesting a mutation adds")
    parser.add_argument("--memory", type=float, default=6.0, help="address-space limit of a case, GiB")
    parser.add_argument("--out", type=Path, default=Path("fuzz-reproducers"), help="folder for reproducers")
    parser.add_argument("--only", help="only seeds whose path contains this (or probes whose name does)")
    parser.add_argument("--probes", action="store_true",
                        help="run the hand-written probes (one per class of bad input) instead of mutants")
    args = parser.parse_args()
    if args.probes:
        return run_probes(args.only)

    seeds = [s for s in sxfuzz.load_seeds() if not args.only or args.only in s.rel]
    counts: Counter[str] = Counter()
    causes: dict[str, list[int]] = {}
    started = time.monotonic()
    with sxfuzz.Workspace(slots=args.jobs) as workspace:
        runner = sxfuzz.Runner(workspace, timeout=args.timeout, memory_bytes=int(args.memory * (1 << 30)))
        cases = sxfuzz.make_cases(seeds, args.cases, seed=args.seed, start=args.start, max_depth=args.max_depth)
        for done, outcome in enumerate(runner.run(cases), 1):
            counts[outcome.kind] += 1
            if outcome.bad:
                causes.setdefault(sxfuzz.signature(outcome), []).append(outcome.case.number)
                sxfuzz.save_reproducer(outcome, args.out)
            if done % 250 == 0:
                print(f"{done} inputs, {time.monotonic() - started:.0f}s: "
                      + ", ".join(f"{k} {counts[k]}" for k in sxfuzz.OUTCOMES if counts[k]), flush=True)
    print(f"\ninputs tried: {sum(counts.values())} ({len(seeds)} seeds, seed {args.seed!r}, "
          f"cases {args.start}..{args.start + args.cases - 1}) in {time.monotonic() - started:.0f}s")
    for kind in sxfuzz.OUTCOMES:
        print(f"  {kind:<12} {counts[kind]}")
    if causes:
        print(f"\ndistinct bad outcomes ({len(causes)}), reproducers in {args.out}/:")
        for cause, numbers in sorted(causes.items(), key=lambda item: -len(item[1])):
            print(f"  {len(numbers):5}  {cause}  (e.g. case {numbers[0]})")
    return 1 if causes else 0


if __name__ == "__main__":
    sys.exit(main())
