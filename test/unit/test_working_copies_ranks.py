"""Under ZeRO-1 the weights' bf16 working copies are gathered with the parameters (`working-copies`).

Each rank's flat update writes the copies of its shard only; the ranks gather
them as they gather the parameters, so the next step's forward on every rank
reads every weight's new copy. Two ranks (threads of this process on the
interpreter, their collectives staged through the host) train the bf16 tiny
GPT bit-identically to one rank taking both microbatches.
"""

from __future__ import annotations

import io
from pathlib import Path

from fake_nccl import ThreadRanks, ThreadWorld
from sexpgpu.backends.events import read_events
from sexpgpu.backends.training import Trainer, TrainingPlan

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "tiny-gpt.sx")
SETS = ["microbatches=2", "precision=bf16", "steps=4", "eval-every=2", "checkpoint-every=4"]


def losses(out: Path) -> dict[tuple[str, int], object]:
    return {(e["type"], e["step"]): e.get("loss", e.get("metrics")) for e in read_events(out / "events.jsonl")
            if e["type"] in ("step", "eval")}


def test_two_ranks_gather_the_copies_their_shards_wrote_and_train_as_one(tmp_path):
    one = Trainer(TrainingPlan.compile(TINY, "smoke", SETS), tmp_path / "one", None, io.StringIO(), False)
    assert one.copies and one.run().status == "done"
    network = ThreadRanks(2)
    plans = [TrainingPlan.compile(TINY, "smoke", SETS) for _ in range(2)]

    def rank(index: int):
        trainer = Trainer(plans[index], tmp_path / "two", None, io.StringIO(), False,
                          world=ThreadWorld(network, index))
        assert trainer.sharded is not None and all(group.copies is not None for group in trainer.sharded.groups)
        return trainer.run()

    results = network.run(rank)
    assert [results[i].status for i in range(2)] == ["done", "done"]
    assert losses(tmp_path / "two") == losses(tmp_path / "one")
