"""Run a command; succeed only when it exits with the status given first.

    %python exit-status.py 2 sexpgpu check f.sx --set width
"""

import subprocess
import sys

expected, command = int(sys.argv[1]), sys.argv[2:]
status = subprocess.call(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if status != expected:
    print(f"{' '.join(command)}: exit {status}, expected {expected}")
sys.exit(0 if status == expected else 1)
