"""Starting and watching the ranks of `sexpgpu run --ranks N` (docs/distributed.md, "Launching").

The ranks are started by the MPI launcher the `mpi` extra installs (the
mpich wheel's `mpiexec`, hydra), as llm.c's runs are (`mpirun -np N`):
the ranks meet through MPI anyway, and hydra already does what a launcher
must — it starts the processes, forwards Ctrl-C, and when one dies it kills
the others at once. What this adds is the account: each rank leaves its
process id and last words in a folder (ranks.RankRecord), and when the
run ends badly this names the rank that died, in one line instead of
hydra's banner, and closes the run record with an `end` event `failed`.
A rank that stops responding without dying (SIGSTOP, a frozen process)
would hold the others in a collective forever: its record goes stale, and
this ends it (`SilenceWatch`), which makes it a dead rank like any other.

Each rank runs single-threaded BLAS (`OMP_NUM_THREADS=1` and its kin)
unless the environment says otherwise, as `torchrun` does: N ranks each
running a thread per core would fight over the cores.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..diagnostics import SxError, display_path
from .checkpoint import list_checkpoints
from .distributed import MPI_INSTALL, import_mpi
from .events import EventLog, read_events
from .ranks import RANK_DIRECTORY_VARIABLE, read_rank_records

#: The thread-count variables of the BLAS libraries numpy may use, each set to 1 unless already set.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
#: A rank silent this long (no activity, no heartbeat: ranks.HEARTBEAT_SECONDS) has stopped responding.
SILENT_SECONDS = 15.0
#: Lines of hydra's report of a rank that ended badly (replaced by one line naming the rank).
_HYDRA_BANNER = re.compile(r"^(=+|=   .*|YOUR APPLICATION TERMINATED.*|This typically refers to a problem.*|"
                           r"Please see the FAQ page.*|Abort\(\d+\) on node .*)$")
_HYDRA_PID = re.compile(r"=   PID (\d+) RUNNING AT")
_HYDRA_CODE = re.compile(r"=   EXIT CODE: (\d+)")
_HYDRA_SIGNAL = re.compile(r"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: .*\(signal (\d+)\)")


def find_mpiexec() -> str:
    """The `mpiexec` beside this Python (the mpich wheel's), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise SxError(f"several ranks need an MPI launcher (mpiexec), and there is none; install MPI with `{MPI_INSTALL}`")
    return found


def rank_environment(folder: Path) -> dict[str, str]:
    """The environment the ranks start with: this one, single-threaded BLAS unless told, the folder
    they leave their records in."""
    env = dict(os.environ)
    for variable in THREAD_VARIABLES:
        env.setdefault(variable, "1")
    env[RANK_DIRECTORY_VARIABLE] = str(folder)
    return env


def launch_ranks(arguments: Sequence[str], ranks: int, out_dir: Path) -> int:
    """Run `sexpgpu <arguments>` as `ranks` processes under mpiexec and wait for them; the exit status
    (1 naming the rank where one died)."""
    import_mpi(ranks)  # without the extra: one line naming it, before anything starts (mpiexec comes with it)
    command = [find_mpiexec(), "-n", str(ranks), sys.executable, "-m", "sexpgpu.tools.main", *arguments]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="sexpgpu-ranks-") as folder:
        process = subprocess.Popen(command, env=rank_environment(Path(folder)), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, errors="replace")
        silence = SilenceWatch(Path(folder))
        silence.start()
        # hydra reports a dead rank on its standard output, and its ranks may on either stream.
        watch = HydraWatch()
        relay_errors = threading.Thread(target=watch.relay, args=(process.stderr, sys.stderr), daemon=True)
        relay_errors.start()
        # A Ctrl-C reaches the ranks from the terminal (one process group): they finish the step, write
        # a checkpoint and end `interrupted`. Here it would only cut the relay short.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            watch.relay(process.stdout, sys.stdout)
            relay_errors.join()
            code = process.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
            silence.stop()
        dead_pid, how = watch.dead_pid, watch.how
        if silence.silent is not None:
            dead_pid, seconds = silence.silent
            how = f"stopped responding (no sign of life for {seconds:.0f} s)"
        if code == 0:
            return 0
        records = read_rank_records(Path(folder))
    if dead_pid is None:
        # A rank ended with an error it printed itself (and stopped the others): nothing to add.
        return code
    return _report_dead_rank(records, dead_pid, how, out_dir, started)


class SilenceWatch(threading.Thread):
    """Ends a rank that stops responding: one whose record (ranks.RankRecord) shows no sign of life for
    `SILENT_SECONDS` while its process lives — stopped (SIGSTOP), or frozen holding the interpreter. The
    others would wait for it in a collective forever; killed, it is a dead rank, and hydra stops the
    others at once. `silent` is (its process id, the seconds it was silent) once one was ended."""

    def __init__(self, folder: Path) -> None:
        super().__init__(name="sexpgpu-rank-silence", daemon=True)
        self.folder = folder
        self.silent: tuple[int, float] | None = None
        self._ended = threading.Event()

    def run(self) -> None:
        while not self._ended.wait(1.0):
            for pid, _, seconds in read_rank_records(self.folder).values():
                if seconds > SILENT_SECONDS and process_lives(pid):
                    self.silent = (pid, seconds)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    return

    def stop(self) -> None:
        self._ended.set()
        self.join()


def process_lives(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (running, sleeping or stopped; not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class HydraWatch:
    """Copies the ranks' output through, but hydra's banner about a dead rank, from which it keeps the
    process id and how the rank ended."""

    def __init__(self) -> None:
        self.dead_pid: int | None = None
        self.how = ""

    def relay(self, source: TextIO, target: TextIO) -> None:
        held_blank = False  # hydra's banner starts with a blank line
        for line in source:
            stripped = line.rstrip("\n")
            if not stripped and not held_blank:
                held_blank = True
                continue
            if _HYDRA_BANNER.match(stripped):
                self._read(stripped)
                held_blank = False
                continue
            if held_blank:
                target.write("\n")
                held_blank = False
            target.write(line)
            target.flush()

    def _read(self, line: str) -> None:
        if match := _HYDRA_PID.match(line):
            self.dead_pid = int(match.group(1))
        elif match := _HYDRA_SIGNAL.match(line):
            with contextlib.suppress(ValueError):
                self.how = f"was killed by {signal.Signals(int(match.group(1))).name}"
        elif (match := _HYDRA_CODE.match(line)) and not self.how:
            self.how = f"exited with status {match.group(1)}"


def _report_dead_rank(records: dict[int, tuple[int, str, float]], dead_pid: int, how: str, out_dir: Path,
                      started: float) -> int:
    rank = next((rank for rank, (pid, _, _) in records.items() if pid == dead_pid), None)
    who = f"rank {rank} (process {dead_pid})" if rank is not None else f"process {dead_pid}"
    last_words = records[rank][1] if rank is not None else "before it reported"
    checkpoints = list_checkpoints(out_dir) if out_dir.exists() else []
    kept = (f"the last checkpoint, {display_path(str(checkpoints[-1][1]))}, is intact" if checkpoints
            else "no checkpoint was written")
    message = f"{who} {how or 'ended'} {last_words}; the other ranks were stopped; {kept}"
    _close_record(out_dir / "events.jsonl", message, started)
    print(f"error: {message}", file=sys.stderr)
    return 1


def _close_record(path: Path, message: str, started: float) -> None:
    """An `end` event `failed` in a run record rank 0 could not close (it was stopped with the others)."""
    if not path.exists():
        return
    with contextlib.suppress(SxError):
        events = read_events(path)
        if events and events[-1].get("type") == "end":
            return
        step = max((event["step"] for event in events if event.get("type") == "step"), default=0)
        log = EventLog(path)
        log.write("end", status="failed", step=step, seconds=time.time() - started, message=message)
        log.close()
