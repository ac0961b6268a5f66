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
    assert sorted(p.name for p in out.iterdir()) == ["device-check.json", "device-check.log", "records.tar.gz"]
    assert "--worker env" in (out / "device-check.log").read_text()
    with tarfile.open(out / "records.tar.gz") as archive:
        assert "env.json" in archive.getnames()
    lines = done.stdout.splitlines()
    assert lines[-4].startswith("device check on cuda: FAILED in ")
    assert lines[-3:] == [
        f"  env       failed   {env['seconds']:5.0f} s  the cuda device cannot open: {why}",
        f"  gemms     skipped      0 s  the cuda device cannot open here: {why}",
        f"  bench     skipped      0 s  the cuda device cannot open here: {why}",
    ]


def test_unknown_parts_are_refused():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "device-check"), "--out", "/nonexistent-out",
                           "--only", "env,benchmark"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "no part benchmark; the parts are env, pytest, lowering, gemms, explain, examples, capture, tiny-gpt, " \
           "bench" in done.stderr
