"""Validate an explain document against the schema given, then print its `device` object's figures a line each."""

import json
import sys

import jsonschema

document = json.load(sys.stdin)
jsonschema.validate(document, json.load(open(sys.argv[1])))
print("valid")
device = document["device"]
print(f"executor {device['executor']} arch {device['arch']} name {device['name']} patterns {device['patterns']}")
for row in device["rows"]:
    print(f"row {row['name']} kernels {row['kernels']} gemms {row['gemms']} fused {row['fused_groups']}"
          if row["fused_groups"] else f"row {row['name']} kernels {row['kernels']} gemms {row['gemms']}")
    for group in row["families"]:
        fired = " ".join(f"{k['name']}:{k['fired']}" for k in group["kernels"])
        forms = "".join(f" as {a['form']}" for a in group["as"])
        fell = ", ".join(dict.fromkeys(f["family"] for f in group["fell_back"]))
        print(f"  {group['group']} {fired}{forms}" if fired else f"  {group['group']} fell back {fell}")
memory, stacking = device["memory"], device["stacking"]
print(f"memory persistent {memory['persistent_bytes']} total {memory['total_bytes']} free {memory['free_bytes']}")
print(f"stacking degrees {stacking['degrees']} chosen {stacking['chosen']}")
print(f"compiled {device['compiled']['compiler']} spills {device['compiled']['spills']}")
estimate = device.get("estimate")
if estimate is not None:
    print(f"estimate {estimate['gpu']} stacking {estimate['stacking']} launches {estimate['launches']} "
          f"rows {sorted(name for name, row in estimate['rows'].items() if row['calls'])} "
          f"costs {any('launch_costs' in row for row in device['rows'])}")
