"""tools/device-check's plumbing, on any machine: setup, a part in its own process, the record.

`SEXPGPU_DEVICES=0,1` makes the CUDA device refuse to open everywhere (a lone
process opens one device; ranks are processes of their own), so the test runs
the same with or without a GPU:
the environment part records the machine and says why the device cannot open,
the parts that need the device are skipped with that reason, and the record,
the log and the archive are written. The package is imported from the work
folder's links laid out as pyproject's package-dir says, not from an install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_device_the_check_records_why_and_runs_no_device_part(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "device-check"), "--out", str(out), "--only",
                           "env,gemms,bench"], env=dict(os.environ, SEXPGPU_DEVICES="0,1"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    record = json.loads((out / "device-check.json").read_text())
    why = "SEXPGPU_DEVICES=0,1 asks for 2 ranks, a process each: `sexpgpu run` starts them (docs/distributed.md)"
    env = record["parts"]["env"]
    assert (env["status"], env["device_unavailable"]) == ("failed", why)
    assert env["packages"]["numpy"] and env["python"] == sys.version.split()[0] and env["sexpgpu"]
    for part in ("gemms", "bench"):
        assert record["parts"][part] == {"status": "skipped", "summary": f"the cuda device cannot open here: {why}"}
    assert (record["verdict"], record["failed_parts"], record["skipped_parts"]) == ("failed", ["env"],
                                                                                  ["gemms", "bench"])
    # Imported from the links the setup made in its work folder (removed at the end), not from an install.
    assert record["setup"]["sexpgpu"].endswith(os.path.join("package", "sexpgpu", "__init__.py"))
    assert "sexpgpu-device-check-" in record["setup"]["sexpgpu"]
    assert not Path(record["setup"]["sexpgpu"]).exists()
    assert sorted(p.name for p in out.iterdir()) == ["device-check.json", "device-check.log", "device-check.txt",
                                                     "records.tar.gz"]
    assert "--worker env" in (out / "device-check.log").read_text()
    with tarfile.open(out / "records.tar.gz") as archive:
        assert "env.json" in archive.getnames()
    lines = done.stdout.splitlines()
    assert lines[1:6] == ["time plan on cuda (360 s budget): part, floor, at most", "  env         10 s    30 s",
                          "  gemms       20 s    60 s", "  bench       60 s   120 s",
                          "  total       90 s   210 s (the budget caps it)"]
    assert lines[-4].startswith("device check on cuda: FAILED in ")
    assert lines[-3:] == [
        f"  env       failed   {env['seconds']:5.0f} s  the cuda device cannot open: {why}",
        f"  gemms     skipped      0 s  the cuda device cannot open here: {why}",
        f"  bench     skipped      0 s  the cuda device cannot open here: {why}",
    ]
    # The text report is the plan and the summary, as the run ends (and as it stood after each part).
    assert (out / "device-check.txt").read_text().splitlines() == lines[1:6] + [""] + lines[-4:]


def test_unknown_parts_are_refused():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "device-check"), "--out", "/nonexistent-out",
                           "--only", "env,benchmark"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "no part benchmark; the parts are env, smoke, gemms, explain, examples, capture, tiny-gpt, ranks, " \
           "pytest, lowering, bench" in done.stderr


def test_the_time_plan_fits_a_seven_minute_run():
    """Floors for every part within the budget, and the budget with the setup and a margin within the 7 minutes
    a run may take, so a 15-minute window holds a machine's start, the run, and a second machine for a rerun."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "device-check"), "--list"], capture_output=True,
                          text=True, timeout=60, check=True)
    lines = done.stdout.splitlines()
    budget = float(lines[0].split("(")[1].split(" s budget")[0])
    parts = [line.split()[0] for line in lines[1:-1]]
    floors = [int(line.split()[1]) for line in lines[1:-1]]
    assert parts == ["env", "smoke", "gemms", "explain", "examples", "capture", "tiny-gpt", "ranks", "pytest", "lowering",
                     "bench"]
    assert int(lines[-1].split()[1]) == sum(floors) <= budget
    assert budget + 40 <= 7 * 60  # setup (the wheels, the links) and the device tool's margin


def test_the_environment_is_recorded_when_sexpgpu_does_not_import(tmp_path):
    """The machine's facts are read before sexpgpu is imported, and a failed import marks the device unavailable
    (so every later part says so at once)."""
    broken = tmp_path / "broken" / "sexpgpu"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("broken on purpose")\n')
    result = tmp_path / "env.json"
    subprocess.run([sys.executable, str(ROOT / "tools" / "device-check"), "--worker", "env", "--work", str(tmp_path),
                    "--device", "cuda", "--result", str(result), "--deadline", "1e12"], timeout=120, check=True,
                   env=dict(os.environ, PYTHONPATH=str(broken.parent), PYTHONSAFEPATH="1"))
    record = json.loads(result.read_text())
    why = "sexpgpu does not import: ImportError: broken on purpose"
    assert (record["status"], record["summary"], record["device_unavailable"]) == ("failed", why, why)
    assert record["packages"]["numpy"] and record["python"] == sys.version.split()[0] and record["cpus"]


def test_the_first_minute_runs_on_cuda_sim(tmp_path):
    """`--smoke` on the simulated device: the environment, then one kernel, one GEMM, one captured graph and a
    tiny-gpt step equal to the CPU's; the verdict and both reports."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "device-check"), "--smoke", "--device", "cuda-sim",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "device-check.json").read_text())
    assert list(record["parts"]) == ["env", "smoke"] and record["verdict"] == "passed"
    smoke = record["parts"]["smoke"]
    assert smoke["passed_checks"] == ["kernel", "gemm", "captured graph", "training step"]
    assert smoke["error"] <= 1e-5
    assert "smoke     passed" in (out / "device-check.txt").read_text()
