"""The reports: what the compiler made of a file, as one document and its text.

- `document`: `build_document` reads the experiment module (the `exp` ops and the `graph.func` ops) and
  the facts passes left on the unit, and returns one dict with stable keys
  (`sexpgpu/schemas/explain.schema.json`); `explain --json` prints it, `diff` compares two.
- `explain_text`: `render_text` turns that dict, and only that dict, into the report `sexpgpu explain`
  prints, so the text and `--json` cannot disagree.
- `lowering_text`: the lowering report's text, from the lowering document and the device's facts an
  executor hands up (`passes/lowering_report.py`); `explain --device cuda` and `run` print it.
- `text`: the counts, paths and tables the three share with `diff`.

The reports sit above what they read (the dialects, the facts passes leave, the facts executors return):
no backend imports them (test/unit/test_import_layers.py), so an executor returns facts and the verbs
print them. The dump pass `explain` renders the document for `sexpgpu-opt`.
"""
