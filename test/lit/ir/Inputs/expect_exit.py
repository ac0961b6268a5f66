"""Run a command and fail unless it exits with the given status: `expect_exit.py 2 CMD ARGS...`."""

import subprocess
import sys

status = subprocess.run(sys.argv[2:]).returncode
if status != int(sys.argv[1]):
    sys.exit(f"expected exit status {sys.argv[1]}, got {status}: {' '.join(sys.argv[2:])}")
