"""Run a command with its standard error on standard output; succeed only when it exits 1.

    %python exit1.py sexpgpu check broken.sx | filecheck ...

`not` accepts any failure; the verbs promise exit status 1 for an experiment
with an error (2 is a wrong command line, 3 a bug), so the tests check it.
"""

import subprocess
import sys

status = subprocess.call(sys.argv[1:], stderr=subprocess.STDOUT, stdout=sys.stdout)
print(f"exit {status}")
sys.exit(0 if status == 1 else 1)
