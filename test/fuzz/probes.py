"""Hand-written probes: one input per class of bad input issue 13 lists (items 1, 2 and 4).

Each probe is a small tree of files and a command line, run as a real command
in a scratch directory with a wall-clock bound (and, where the class needs it,
an address-space limit or a Ctrl-C after a delay). Its outcome is classed as
the fuzzer classes them (`sxfuzz.classify`), with its time and peak memory.
`benchmarks/fuzz_campaign.py --probes` runs them all and prints a table.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sxfuzz

#: A small experiment with a tensor `h` in its objective: `{OBJECTIVE}` is where a probe puts its expression.
EXPERIMENT = """\
(defknobs (lr 0.01) (width 4) (layers 1) (beta 0.9) (eps 1e-8))
(defloader data :source (synthetic-tokens :vocab 16 :count 256 :seed 1) :fields ((tokens [5] i32)) :batch 2)
(defmodule net () (let ((w (param w [width] :init ones))) (fn (x) (* x (sum w)))))
(defmodel model (net))
(defn objective (batch)
  (let ((h (model (cast (get batch :tokens) f32))))
    {OBJECTIVE}))
(defoptimizer opt {OPTIMIZER})
(defrun :steps 2 :loader data :objective objective :optimizer opt)
"""


def experiment(objective: str = "(mean h)", optimizer: str = "(adamw :lr lr)", loader: str | None = None) -> bytes:
    text = EXPERIMENT.replace("{OBJECTIVE}", objective).replace("{OPTIMIZER}", optimizer)
    if loader is not None:
        text = text.replace("(synthetic-tokens :vocab 16 :count 256 :seed 1)", loader)
    return text.encode()


@dataclass
class Probe:
    """One probe: its class (as the issue words it), files, command line (after the program) and limits."""

    name: str
    item: str
    files: dict[str, bytes]
    argv: list[str]
    program: str = "sexpgpu"
    #: Outcome classes that fulfil the contract for this probe (by default: any good one).
    expected: tuple[str, ...] = ("exit 0", "located 1", "exit 2")
    timeout: float = 60.0
    memory_bytes: int = 0
    #: Send Ctrl-C after this many seconds (the probe then expects exit 130).
    interrupt_after: float | None = None
    #: What the class is about, beyond the exit: checked by `check` on the stderr (substrings that must not appear).
    forbidden: tuple[str, ...] = ()
    setup: list[str] = field(default_factory=list)


@dataclass
class ProbeResult:
    probe: Probe
    kind: str
    returncode: int | None
    seconds: float
    max_rss_mib: float
    stderr: str

    @property
    def ok(self) -> bool:
        return self.kind in self.probe.expected and not any(text in self.stderr for text in self.probe.forbidden)


def _nested_let(depth: int) -> bytes:
    return ("(def x " + "(let ((a 1)) " * depth + "a" + ")" * depth + ")\nx\n").encode()


def _npz(**arrays: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


RECORDS = """\
(defloader data :source (npy-file "d.npz") :fields ((x [4] f32) (y [] i32)) :batch 2)
(defmodule net () (let ((w (param w [4 3] :init zeros))) (fn (x) (matmul x w))))
(defmodel model (net))
(defn objective (batch) (cross-entropy (model (get batch :x)) (get batch :y)))
(defoptimizer opt (sgd :lr 0.1))
(defrun :steps 2 :loader data :objective objective :optimizer opt)
"""

GOOD_NPZ = _npz(x=np.zeros((6, 4), np.float32), y=np.arange(6) % 3)


def probes() -> list[Probe]:
    """Every probe, in the issue's order."""
    e = experiment
    run = ["run", "p.sx", "--out", "out"]
    p: list[Probe] = [
        # -- item 1: no internal error on user input -----------------------------------------------
        Probe("vector-map-key", "1: a vector as a map key", {"p.sx": b"(def m {[1 2] 3})\nm\n"}, ["eval", "p.sx"]),
        Probe("vector-get", "1: a vector as a map key", {"p.sx": b"(get {:a 1} [1 2])\n"}, ["eval", "p.sx"]),
        Probe("vector-contains", "1: a vector as a map key", {"p.sx": b"(contains? {:a 1} [1])\n"}, ["eval", "p.sx"]),
        Probe("vector-assoc", "1: a vector as a map key", {"p.sx": b"(assoc {} [1] 2)\n"}, ["eval", "p.sx"]),
        Probe("int-literal-4300", "1: an integer literal over 4,300 digits",
              {"p.sx": b"(def x " + b"9" * 5000 + b")\n"}, ["eval", "p.sx"]),
        Probe("pow-lr", "1: (pow 10 400) as a learning rate", {"p.sx": e(optimizer="(adamw :lr (pow 10 400))")},
              ["check", "p.sx"]),
        Probe("sqrt-arity", "1: built-ins skipping argument checks", {"p.sx": e("(mean (sqrt h h))")}, ["check", "p.sx"]),
        Probe("pow-arity", "1: built-ins skipping argument checks", {"p.sx": e("(mean (pow h))")}, ["check", "p.sx"]),
        Probe("max-arity", "1: built-ins skipping argument checks", {"p.sx": e("(mean (max h 0 1))")}, ["check", "p.sx"]),
        Probe("min-keyword", "1: built-ins skipping argument checks", {"p.sx": e("(mean (min h :foo 1))")},
              ["check", "p.sx"]),
        Probe("equal-one", "1: built-ins skipping argument checks", {"p.sx": e("(mean (= h))")}, ["check", "p.sx"]),
        Probe("synthetic-no-count", "1: a missing required keyword",
              {"p.sx": e(loader="(synthetic-tokens :vocab 16)")}, ["check", "p.sx"]),
        Probe("adamw-groups", "1: a stray keyword", {"p.sx": e(optimizer="(adamw :lr 0.01 :groups 1e-8)")},
              ["check", "p.sx"]),
        Probe("defmodel-traced", "1: (defmodel m2 (net)) inside a traced function",
              {"p.sx": e("(do (defmodel m2 (net)) (mean h))")}, ["check", "p.sx"]),
        Probe("iota-negative", "1: negative dimensions accepted by check (and failing at run)",
              {"p.sx": e("(+ (mean h) (sum (cast (iota [-3] 0) f32)))")}, ["check", "p.sx"], expected=("located 1",)),
        Probe("causal-mask-negative", "1: negative dimensions accepted by check (and failing at run)",
              {"p.sx": e("(+ (mean h) (sum (causal-mask -1)))")}, ["check", "p.sx"], expected=("located 1",)),
        Probe("set-lr-nan", "1: non-finite hyperparameters", {"p.sx": e()}, ["explain", "p.sx", "--set", "lr=nan"]),
        Probe("set-lr-negative", "1: out-of-range hyperparameters accepted by check", {"p.sx": e()},
              ["check", "p.sx", "--set", "lr=-1"], expected=("located 1", "exit 2")),
        Probe("betas-out-of-range", "1: out-of-range hyperparameters",
              {"p.sx": e(optimizer="(adamw :lr lr :betas [beta 1.5])")}, ["check", "p.sx"], expected=("located 1",)),
        Probe("eps-zero", "1: out-of-range hyperparameters", {"p.sx": e(optimizer="(adamw :lr lr :eps eps)")},
              ["check", "p.sx", "--set", "eps=0"], expected=("located 1", "exit 2")),
        Probe("explain-lr-huge", "1: out-of-range hyperparameters crashing explain and diff", {"p.sx": e()},
              ["diff", "p.sx", "p.sx", "--set", "lr=1e308"]),
        Probe("out-is-a-file", "1: --out naming a file", {"p.sx": e(), "out": b"x"}, run, expected=("exit 2",)),
        Probe("out-unwritable", "1: --out naming an unwritable place", {"p.sx": e()},
              ["run", "p.sx", "--out", "/proc/sexpgpu-probe"], expected=("exit 2",)),
        Probe("npz-truncated", "1: a truncated .npz", {"p.sx": RECORDS.encode(), "d.npz": GOOD_NPZ[: len(GOOD_NPZ) // 2]},
              run, expected=("located 1",)),
        Probe("labels-strings", "1: labels of a string dtype",
              {"p.sx": RECORDS.encode(), "d.npz": _npz(x=np.zeros((6, 4), np.float32), y=np.array(list("abcabc")))},
              run, expected=("located 1",)),
        Probe("parameter-too-big", "1: a parameter that does not fit in memory",
              {"p.sx": e().replace(b"(param w [width]", b"(param w [width 1000000000]")}, run,
              expected=("located 1",), memory_bytes=4 << 30),
        Probe("activation-too-big", "1: an activation that does not fit in memory",
              {"p.sx": e("(mean (cast (+ (reshape (get batch :tokens) [10 1 1]) (iota [1 20000 20000] 1)) f32))")},
              run, expected=("located 1",), memory_bytes=3 << 30),
        Probe("thread-stack-vm-limit", "1: a virtual-memory limit the evaluator's thread stack exceeds",
              {"p.sx": e()}, ["check", "p.sx"], memory_bytes=900 << 20),
        # -- item 2: bounded evaluation --------------------------------------------------------------
        Probe("int-size", "2: integers have a size bound", {"p.sx": b"(def x (pow 2 (pow 2 40)))\n"}, ["eval", "p.sx"],
              timeout=30),
        Probe("range-size", "2: range has a size bound", {"p.sx": b"(def x (range 1000000000000))\n"}, ["eval", "p.sx"],
              timeout=30, memory_bytes=4 << 30),
        Probe("iota-size", "2: iota and shapes have size bounds",
              {"p.sx": e("(+ (mean h) (sum (cast (iota [100000000 100000000 100000000] 0) f32)))")}, ["check", "p.sx"],
              expected=("located 1",), timeout=30),
        Probe("layers-2-31", "2: check of an absurd knob stops with an error", {"p.sx": e(
            "(+ (mean h) (reduce + 0 (map (fn (i) (mean h)) (range layers))))")},
            ["check", "p.sx", "--set", "layers=2147483648"], timeout=30, memory_bytes=4 << 30),
        Probe("self-expanding-macro", "2: a self-expanding macro gives a located error",
              {"p.sx": b"(defmacro m () '(m))\n(m)\n"}, ["eval", "p.sx"], expected=("located 1",), timeout=30),
        Probe("nested-40k", "2: 40k nested forms give a located error naming the form",
              {"p.sx": b"(def x " + b"(list " * 40000 + b"1" + b")" * 40000 + b")\n"}, ["eval", "p.sx"], timeout=60),
        Probe("nested-let-10k", "2: nested let is linear (10k levels)", {"p.sx": _nested_let(10000)}, ["eval", "p.sx"],
              timeout=60),
        Probe("nested-let-20k", "2: nested let is linear (20k levels)", {"p.sx": _nested_let(20000)}, ["eval", "p.sx"],
              timeout=60),
        Probe("string-1mb", "2: a 1 MB string literal takes megabytes",
              {"p.sx": b'(def s "' + b"x" * (1 << 20) + b'")\n(len s)\n'}, ["eval", "p.sx"], timeout=60),
        Probe("ctrl-c-evaluation", "2: Ctrl-C interrupts any long evaluation",
              {"p.sx": b"(defn f (n) (if (= n 0) 0 (+ 1 (f (- n 1)))))\n(def loop (reduce + 0 (map (fn (i) (reduce + 0 (map f (range 1000)))) (range 1000000))))\n"},
              ["eval", "p.sx"], expected=("exit 130",), interrupt_after=3.0, timeout=6),
        # -- item 4: file access confined --------------------------------------------------------------
        Probe("require-passwd", "4: require loads .sx source only and never echoes another file",
              {"p.sx": b'(require "/etc/passwd")\n'}, ["eval", "p.sx"], forbidden=("root:",)),
        Probe("require-directory", "4: a directory given where a file is expected", {"p.sx": b'(require "d")\n'},
              ["eval", "p.sx"], setup=["mkdir d"]),
        Probe("require-fifo", "4: a FIFO given where a file is expected", {"p.sx": b'(require "f.sx")\n'},
              ["eval", "p.sx"], setup=["mkfifo f.sx"], timeout=20),
        Probe("opt-loc-names-passwd", "4: sexpgpu-opt never opens a file a loc() names",
              {"p.sxir": b'graph.func @f {\n  %0 = graph.input {name = "x", role = "batch"} : () -> tensor<4xf32> '
                         b'loc("/etc/passwd":1:1)\n  %1 = graph.exp %0, %0 : (tensor<4xf32>, tensor<4xf32>) -> '
                         b'tensor<4xf32> loc("/etc/passwd":1:1)\n  graph.return %1 {names = ["y"]} : (tensor<4xf32>) '
                         b'-> ()\n}\n'}, ["p.sxir"], program="sexpgpu-opt", forbidden=("root:",)),
        Probe("opt-loc-names-fifo", "4: sexpgpu-opt never opens a file a loc() names (a FIFO: a hang)",
              {"p.sxir": b'graph.func @f {\n  %0 = graph.input {name = "x", role = "batch"} : () -> tensor<4xf32> '
                         b'loc("f.sx":1:1)\n  graph.return %0 {names = ["y"]} : (tensor<4xf32>) -> ()\n}\n'},
              ["p.sxir", "-p", "ir-json"], program="sexpgpu-opt", setup=["mkfifo f.sx"], timeout=20),
        Probe("cli-directory", "4: a directory as the file argument", {}, ["check", "."], expected=("unlocated 1",)),
        Probe("cli-device", "4: a device as the file argument", {}, ["check", "/dev/zero"], expected=("unlocated 1",),
              timeout=20),
        Probe("cli-fifo", "4: a FIFO as the file argument", {}, ["check", "f.sx"], expected=("unlocated 1",),
              setup=["mkfifo f.sx"], timeout=20),
        Probe("loader-fifo", "4: a FIFO where a loader expects a file",
              {"p.sx": RECORDS.encode()}, run, expected=("located 1",), setup=["mkfifo d.npz"], timeout=30),
        Probe("resume-fifo", "4: a FIFO given to --resume", {"p.sx": e()}, ["run", "p.sx", "--resume", "f"],
              expected=("unlocated 1",), setup=["mkfifo f"], timeout=30),
        Probe("non-utf8", "4: a non-UTF-8 file is a located error", {"p.sx": b"(def x 1)\n; caf\xe9\n"}, ["check", "p.sx"],
              expected=("located 1",)),
        Probe("byte-order-mark", "4: a UTF-8 byte-order mark is skipped", {"p.sx": b"\xef\xbb\xbf(def x 1)\nx\n"},
              ["eval", "p.sx"], expected=("exit 0",)),
    ]
    return p


def run_probe(probe: Probe) -> ProbeResult:
    """Run one probe as a real command in a scratch directory."""
    with tempfile.TemporaryDirectory(prefix="sxprobe-") as tmp:
        root = Path(tmp)
        for name, data in probe.files.items():
            (root / name).write_bytes(data)
        for command in probe.setup:
            subprocess.run(command, shell=True, cwd=root, check=True)

        def limits() -> None:
            if probe.memory_bytes:
                resource.setrlimit(resource.RLIMIT_AS, (probe.memory_bytes, probe.memory_bytes))

        program = str(Path(sys.executable).with_name(probe.program))
        stderr_path = root / ".stderr"
        started = time.monotonic()
        with open(stderr_path, "wb") as err:
            child = subprocess.Popen([program, *probe.argv], cwd=root, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=err, preexec_fn=limits,
                                     env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
            interrupted = False
            timed_out = False
            while True:
                pid, status, usage = os.wait4(child.pid, os.WNOHANG)
                if pid:
                    break
                elapsed = time.monotonic() - started
                if probe.interrupt_after is not None and not interrupted and elapsed > probe.interrupt_after:
                    child.send_signal(signal.SIGINT)
                    interrupted = True
                if elapsed > probe.timeout:
                    child.kill()
                    pid, status, usage = os.wait4(child.pid, 0)
                    timed_out = True
                    break
                time.sleep(0.01)
            child.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - started
        stderr = stderr_path.read_text("utf-8", "replace")
        returncode = None if timed_out else child.returncode
        return ProbeResult(probe, sxfuzz.classify(returncode, stderr, timed_out), returncode, seconds,
                           usage.ru_maxrss / 1024, stderr)
