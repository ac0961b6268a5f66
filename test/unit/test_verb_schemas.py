"""`check --json` and `knobs --json` documents of the examples satisfy the schemas shipped in the package
(docs/agents.md; explain, diff, ir, events and sample are validated where those verbs are tested)."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from sexpgpu.tools.check_cmd import check
from sexpgpu.tools.knobs_cmd import knobs_document

ROOT = Path(__file__).resolve().parents[2]


def schema(name: str) -> dict:
    loaded = json.loads(resources.files("sexpgpu").joinpath(f"schemas/{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(loaded)
    return loaded


@pytest.mark.parametrize("example", ["tiny-gpt.sx", "mlp-classifier.sx"])
def test_check_documents_match_their_schema(example):
    document = check(str(ROOT / "examples" / example), "smoke" if example == "tiny-gpt.sx" else None, [])
    jsonschema.validate(json.loads(json.dumps(document)), schema("check"))


@pytest.mark.parametrize(("example", "variant", "sets"), [
    ("gpt.sx", None, []), ("tiny-gpt.sx", "smoke", ["lr=0.01", "precision=bf16"]),
])  # fmt: skip
def test_knobs_documents_match_their_schema(example, variant, sets):
    document = json.loads(json.dumps(knobs_document(str(ROOT / "examples" / example), variant, sets)))
    jsonschema.validate(document, schema("knobs"))
    assert {k["selected"][1] for k in document["knobs"]} >= ({"set", "variant"} if sets else {"default"})


def test_a_document_missing_a_required_key_fails_the_schema():
    with pytest.raises(jsonschema.ValidationError, match="'ok' is a required property"):
        jsonschema.validate({"file": "x.sx", "parameters": 1, "elements": 1, "graphs": 1, "steps": 1,
                             "warnings": []}, schema("check"))


def embedded_schemas() -> dict[str, tuple[Path, str]]:
    """Every schema copy a documentation page embeds (a ```json block with a `$id`), by the file it names."""
    copies = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for block in re.findall(r"```json\n(.*?)```", page.read_text(), re.S):
            if '"$id"' in block:
                copies[json.loads(block)["$id"].rsplit("/", 1)[1]] = (page, block)
    return copies


def test_the_schemas_the_docs_embed_are_the_shipped_files_verbatim():
    copies = embedded_schemas()
    assert {"explain.schema.json", "diff.schema.json", "ir.schema.json"} <= copies.keys()
    for name, (page, block) in copies.items():
        shipped = resources.files("sexpgpu").joinpath(f"schemas/{name}").read_text()
        assert block == shipped, f"{page.relative_to(ROOT)} embeds a stale copy of sexpgpu/schemas/{name}"
