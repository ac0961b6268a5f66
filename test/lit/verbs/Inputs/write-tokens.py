"""Write a token file of ids below 16 to standard output, for token-file tests.

    write-tokens.py llmc MAGIC VERSION COUNT   llm.c's header saying MAGIC, VERSION and COUNT, then 400 uint16 ids
    write-tokens.py odd                        400 uint16 ids and one byte more (a headerless stream cut mid-token)
"""

import sys

import numpy as np

tokens = (np.arange(400) % 16).astype("<u2").tobytes()
if sys.argv[1] == "odd":
    sys.stdout.buffer.write(tokens + b"\x01")
else:
    header = np.zeros(256, "<i4")
    header[:3] = [int(x) for x in sys.argv[2:5]]
    sys.stdout.buffer.write(header.tobytes() + tokens)
