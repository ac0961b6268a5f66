"""Runs the lit golden suite as one pytest test, so the single test command covers both."""

import os
import subprocess
import sys

LIT_DIR = os.path.join(os.path.dirname(__file__), "lit")


def test_lit_suite():
    jobs = os.environ.get("LIT_JOBS", str(os.cpu_count() or 2))
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "lit"), "-q", "-j", jobs, LIT_DIR],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
