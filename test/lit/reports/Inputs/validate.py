"""Validates the JSON document on stdin against a sexpgpu schema; prints what the checks read."""

import json
import sys
from pathlib import Path

import jsonschema

import sexpgpu

kind = sys.argv[1]
doc = json.load(sys.stdin)
schema = json.loads((Path(sexpgpu.__file__).parent / "schemas" / f"{kind}.schema.json").read_text())
jsonschema.validate(doc, schema)
print(f"valid {kind}")
if kind == "diff":
    print("sections " + ", ".join(s["name"] for s in doc["sections"]))
elif kind == "explain":
    p, s = doc["parameters"], doc["step"]
    print(f"parameters {p['count']} elements {p['elements']} bytes {p['master_bytes']}")
    print(f"records {s['records_per_step']} counters " + " ".join(f"{c['name']}={c['per_step']}" for c in s["counters"]))
elif kind == "ir":
    print(f"graphs {len(doc['graphs'])} ops {sum(len(g['ops']) for g in doc['graphs'])}")
    print("files " + " ".join(f["path"] for f in doc["manifest"]["files"]))
