"""`sexpgpu sample` from a trained tiny-gpt, and `sexpgpu prepare` feeding a run.

The sampled run is tiny-gpt's smoke variant trained briefly (its greedy text
is not constant yet, so the devices have something to agree on). Commands run
through the command line in a subprocess, as a user runs them.
"""

from __future__ import annotations

import io
import json
import shutil
from importlib import resources
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from sexpgpu.backends import tokenizers
from sexpgpu.backends.devices import open_device
from sexpgpu.backends.events import read_events
from sexpgpu.backends.sampling import Sampler, locate_run
from sexpgpu.backends.training import train
from sexpgpu.tools.main import main
from test_run import EXAMPLE, ROOT, SMALL, run_cli, step_losses

import sexpgpu

TRAINED = ["--variant", "smoke", "--set", "steps=60", "--set", "lr=0.01", "--set", "eval-every=1000"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sample") / "run"
    run_cli("run", str(EXAMPLE), *TRAINED, "--out", str(out))
    return out


def sample_schema() -> dict:
    return json.loads(resources.files("sexpgpu").joinpath("schemas/sample.schema.json").read_text())


def test_sample_decodes_streams_and_is_deterministic_for_a_seed(trained):
    args = ("sample", str(trained), "--prompt", "The ", "--tokens", "40", "--seed", "1")
    first = run_cli(*args)
    again = run_cli(*args)
    other = run_cli(*args[:-1], "2")
    assert first.stdout == again.stdout
    assert first.stdout != other.stdout
    text, separator, rest = first.stdout.partition("\n---------------\n")
    assert separator and rest == ""
    assert text.startswith("The ")
    # Bytes of the corpus's alphabet: the model learned its characters.
    assert len(text.encode()) >= 44 and all(c.isprintable() or c == "\n" for c in text)


def test_json_gives_tokens_and_log_probabilities_and_matches_its_schema(trained):
    result = run_cli("sample", str(trained), "--prompt", "The ", "--tokens", "12", "--samples", "2", "--json")
    document = json.loads(result.stdout)
    jsonschema.validate(document, sample_schema())
    assert document["tokenizer"] == "bytes" and document["window"] == 16 and document["step"] == 60
    assert document["prompt"] == {"text": "The ", "tokens": list(b"The ")}
    for sample in document["samples"]:
        assert len(sample["tokens"]) == len(sample["logprobs"]) == 12
        assert sample["text"] == bytes(sample["tokens"]).decode("utf-8", "replace")
        assert all(-30 < p <= 0 for p in sample["logprobs"])
    assert document["samples"][0]["tokens"] != document["samples"][1]["tokens"]


def test_the_python_api_returns_the_json_document_and_streams_the_text(trained):
    pieces: list[str] = []
    document = sexpgpu.sample(str(trained), "The ", tokens=8, temperature=0, on_text=pieces.append)
    cli = json.loads(run_cli("sample", str(trained), "--prompt", "The ", "--tokens", "8", "--temperature", "0",
                             "--json").stdout)
    assert document == cli
    assert "".join(pieces) == "The " + document["samples"][0]["text"] + "\n---------------\n"


def test_a_window_longer_than_the_model_slides(trained):
    """40 new tokens after a 4-token prompt pass the smoke model's window of 16: the last 16 are its input."""
    sampler = Sampler(locate_run(trained), open_device("cpu", "sample"))
    prompt = sampler.encode_prompt("The ")
    tokens = [t for t, _ in sampler.generate(prompt, 40, temperature=0)]
    context = (prompt + tokens)[:-1]
    assert tokens[-1] == int(np.argmax(sampler.log_probs(context[-16:])))
    assert np.array_equal(sampler.log_probs(context), sampler.log_probs(context[-16:]))


def test_greedy_tokens_are_the_same_on_cpu_and_cuda_sim(trained):
    samplers = {device: Sampler(locate_run(trained), open_device(device, "sample")) for device in ("cpu", "cuda-sim")}
    prompt = samplers["cpu"].encode_prompt("The m")
    out = {device: list(s.generate(prompt, 6, temperature=0)) for device, s in samplers.items()}
    assert [t for t, _ in out["cpu"]] == [t for t, _ in out["cuda-sim"]]
    assert len({t for t, _ in out["cpu"]}) > 1, "a constant greedy text compares too little"
    # The devices' float results differ more than rounding on this model (its eval graph's loss, too, by
    # 3e-4 relative): the log-probabilities agree loosely, the greedy tokens exactly.
    np.testing.assert_allclose([p for _, p in out["cpu"]], [p for _, p in out["cuda-sim"]], atol=0.05)


def test_a_prompt_with_characters_outside_the_model_vocabulary_is_one_clear_line(tmp_path):
    """A byte-level model with 128 ids (the corpus is ASCII) cannot take the UTF-8 bytes of 'é'."""
    experiment = tmp_path / "ascii.sx"
    experiment.write_text(EXAMPLE.read_text().replace(":vocab 256", ":vocab 128"))
    shutil.copytree(ROOT / "examples" / "data", tmp_path / "data")
    run_cli("run", str(experiment), *SMALL, "--set", "steps=3", "--out", str(tmp_path / "run"))
    result = run_cli("sample", str(tmp_path / "run"), "--prompt", "café", check=False)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == ("error: the prompt cannot be encoded for this model: its token 4, from the character 'é' "
                             "at offset 3, is id 195, outside the model's vocabulary of 128 (ids 0 to 127)\n")


def test_a_vocabulary_padded_past_the_tokenizer_never_yields_a_padding_id(tmp_path):
    """A byte model with 300 logits: ids 256-299 have probability but no text; they are never drawn."""
    experiment = tmp_path / "padded.sx"
    experiment.write_text(EXAMPLE.read_text().replace(":vocab 256", ":vocab 300"))
    shutil.copytree(ROOT / "examples" / "data", tmp_path / "data")
    train(str(experiment), "smoke", {"steps": 3, "eval-every": 1000}, tmp_path / "run", stream=io.StringIO())
    sampler = Sampler(locate_run(tmp_path / "run"), open_device("cpu", "sample"))
    assert (sampler.vocab, sampler.drawable) == (300, 256)
    prompt = sampler.encode_prompt("The ")
    assert np.exp(sampler.log_probs(prompt)[256:]).sum() > 0.05
    drawn = [t for t, _ in sampler.generate(prompt, 100, temperature=5.0, top_k=None, seed=3)]
    assert max(drawn) < 256 and len(set(drawn)) > 20


def test_prepare_llmc_then_a_run_gives_the_losses_of_the_bundled_files(tmp_path):
    prepared = tmp_path / "prepared"
    result = run_cli("prepare", "examples/data/corpus.txt", "--tokenizer", "bytes", "--out", str(prepared),
                     "--format", "llmc")
    assert "train.bin: 287,580 u16 tokens (llmc)" in result.stdout and "tok/s" in result.stdout
    experiment = tmp_path / "prepared.sx"
    experiment.write_text(EXAMPLE.read_text().replace('"data/train.u16"', f'"{prepared}/train.bin"')
                          .replace('"data/val.u16"', f'"{prepared}/val.bin"'))
    options = {"variant": "smoke", "sets": {"steps": 3, "eval-every": 3}}
    train(str(EXAMPLE), **options, out=tmp_path / "bundled", stream=io.StringIO())
    train(str(experiment), **options, out=tmp_path / "from-prepared", stream=io.StringIO())
    assert step_losses(tmp_path / "bundled") == step_losses(tmp_path / "from-prepared")
    evals = [[e["metrics"] for e in read_events(run / "events.jsonl") if e["type"] == "eval"]
             for run in (tmp_path / "bundled", tmp_path / "from-prepared")]
    assert evals[0] == evals[1] and evals[0]


def test_a_gpt2_run_encodes_the_prompt_and_decodes_with_its_tokenizer(tmp_path, monkeypatch, capsys):
    """prepare (GPT-2's tokenizer: here a small BPE built in the process), train on it, sample: the text
    round-trips through the run's tokenizer, named by its loaders."""
    monkeypatch.syspath_prepend(str(ROOT / "test" / "unit"))
    from test_tokenizers import small_bpe

    encoding = small_bpe()
    monkeypatch.setattr(tokenizers, "load_gpt2_encoding", lambda: encoding)
    assert main(["prepare", "examples/data/corpus.txt", "--tokenizer", "gpt2", "--out", str(tmp_path)]) == 0
    experiment = tmp_path / "bpe.sx"
    experiment.write_text(EXAMPLE.read_text().replace(":vocab 256", f":vocab {encoding.n_vocab}")
                          .replace('"data/train.u16" :tokenizer bytes', f'"{tmp_path}/train.bin" :tokenizer gpt2')
                          .replace('"data/val.u16" :tokenizer bytes', f'"{tmp_path}/val.bin" :tokenizer gpt2'))
    train(str(experiment), "smoke", {"steps": 3, "eval-every": 1000}, tmp_path / "run", stream=io.StringIO())
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "run"), "--prompt", "the band", "--tokens", "5", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["tokenizer"] == "gpt2"
    assert document["prompt"] == {"text": "the band", "tokens": encoding.encode_ordinary("the band")}
    assert document["samples"][0]["text"] == encoding.decode(document["samples"][0]["tokens"], errors="replace")
