"""What the training driver does differently as one of several data-parallel ranks (docs/distributed.md).

The global batch of a step is the same whatever the rank count: the step's
M microbatches are dealt in order, rank r taking microbatches
r·M/N … (r+1)·M/N − 1 (the loader positions one rank would have drawn them
at; `dealt`), so N ranks × M/N microbatches compute the step of one rank ×
M. After each rank's last microbatch the summed gradients are summed over
the ranks (`GradientReduction`) before the driver scales them by 1/M, so
clipping, the update and everything after see the step's mean gradient.

ZeRO-1 (`ShardedUpdates`): where a flat group's element count divides by
the rank count, each rank keeps the optimizer states of its shard of the
group alone: the gradients are reduce-scattered, the rank updates its shard
of the parameters and states with the group's update graph rebuilt for the
shard, and the parameters are all-gathered. The update is element-wise, so
the result is the same bit for bit as updating the whole group.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..diagnostics import Location, SxError
from ..passes.flat_updates import flat_update_graph
from ..passes.working_copies import UPDATE_OUTPUT
from .distributed import Communicator, DeviceCollectives, HostStaging, shard_bounds
from .executor import DeviceArray, Executable, Executor

#: Where `sexpgpu run --ranks N` asks each rank to leave its process id and last words (launch.py).
RANK_DIRECTORY_VARIABLE = "SEXPGPU_RANK_DIR"
#: How often a rank's record is touched to say it is alive.
HEARTBEAT_SECONDS = 2.0


def local_microbatches(microbatches: int, ranks: int, loc: Location | None) -> int:
    """How many of a step's `microbatches` one of `ranks` runs; a located error where they do not divide."""
    if microbatches % ranks:
        raise SxError(f":microbatches {microbatches} cannot be dealt evenly to {ranks} ranks: each rank runs "
                      f"the same number of a step's microbatches, so make :microbatches a multiple of {ranks}",
                      loc)
    return microbatches // ranks


@contextlib.contextmanager
def dealt(loader: Any, world: Communicator, local: int) -> Iterator[None]:
    """Within: the loader draws this rank's microbatches of the step; after: it stands where one rank
    running every microbatch would (so the loader's state, and a checkpoint, is the same on every rank)."""
    loader.position += world.rank * local * loader.batch
    yield
    loader.position += (world.size - 1 - world.rank) * local * loader.batch


def evaluation_share(batches: Iterator[dict[str, np.ndarray]], world: Communicator) -> Iterator[dict[str, np.ndarray]]:
    """This rank's share of an evaluation's batches: every `world.size`-th, from its rank."""
    for index, batch in enumerate(batches):
        if index % world.size == world.rank:
            yield batch


def sum_over_ranks(world: Communicator, sums: dict[str, Any]) -> dict[str, Any]:
    """`sums` summed over the ranks under rank 0's names (a rank that saw none of a name adds 0); an
    integer (a counter) stays one."""
    if world.size == 1:
        return sums
    names = world.broadcast(sorted(sums))
    totals = world.sum_values([float(sums.get(name, 0.0)) for name in names])
    return {name: int(total) if isinstance(sums.get(name), int) else total for name, total in zip(names, totals)}


def any_rank(world: Communicator, flag: bool) -> bool:
    """Whether `flag` holds on any rank (a Ctrl-C one rank saw stops them all after the same step)."""
    return flag if world.size == 1 else world.sum_values([1.0 if flag else 0.0])[0] > 0


def diagnoses_here(setup: Any, diagnosed: bool) -> bool:
    """Whether this rank runs the diagnosed graph in a diagnostic step: the rank of the step's first
    microbatch (rank 0), or of its last where the diagnosed graph reduces the step's gradient."""
    world: Communicator = setup.world
    return diagnosed and world.rank == (world.size - 1 if setup.diagnosis_accumulates else 0)


def sums_whole(setup: Any, diagnosed: bool) -> bool:
    """Whether this step's gradients meet before its last microbatch: a diagnostic step over several
    ranks whose diagnosed graph reduces the step's gradient, which it must see whole."""
    return diagnosed and setup.diagnosis_accumulates and setup.world.size > 1


def reduce_step(trainer: Any, diagnosed: bool, held: tuple[Executable, int] | None,
                calls: list[tuple[Any, int]]) -> dict[str, np.ndarray] | None:
    """The step's gradients summed over the ranks (`GradientReduction`, `ShardedUpdates`), after every
    rank's microbatches. In a step that `sums_whole`, the last rank holds its last microbatch back
    (`held`, the diagnosed graph): every other microbatch's gradient is summed whole, the last rank
    adds the held one with the diagnosed graph, and shares the step's gradient and observations
    (returned: what rank 0 logs)."""
    if not sums_whole(trainer, diagnosed):
        trainer.reduce_gradients()
        if trainer.sharded is not None:
            trainer.sharded.reduce_gradients()
        return None
    if held is not None and not calls:
        # The last rank's only microbatch is the held one: it adds nothing to the sum before it.
        for array in trainer.whole_gradients.arrays:
            trainer.executor.write(array, np.zeros(trainer.executor.download(array).shape, np.float32))
    trainer.whole_gradients()
    if held is not None:
        graph, count = held
        calls.append((graph(trainer._inputs(graph, trainer._next_batches(count), trainer.grad_out),
                            trainer.grad_out), count))
    last = trainer.world.size - 1
    trainer.whole_gradients.share(last)
    observed = dict(calls[-1][0].observed) if held is not None else None
    return trainer.world.broadcast(observed, root=last)


def zero_stage(plan: Any) -> int:
    """The defrun's `:zero-stage` (1 where not written)."""
    return int(plan.run_op.attributes.get("zero_stage", 1))


def plan_reduction(setup: Any) -> tuple[ShardedUpdates | None, GradientReduction]:
    """How a setup's gradients meet over its ranks: ZeRO-1 over the flat groups it can shard (their
    update taken over from the driver's `flat_updates`, their states from its `states`), and one
    summed buffer of every other gradient; with gradient diagnostics, `setup.whole_gradients`, the
    sum of every gradient (`reduce_step`)."""
    world: Communicator = setup.world
    #: Through what the gradients meet: the device's collectives (NCCL), else host staging.
    setup.collectives = (setup.executor.collectives(world) or HostStaging(setup.executor, world)
                         if world.size > 1 else None)
    sharded = None
    if world.size > 1 and zero_stage(setup.plan) == 1 and setup.flat_groups:
        sharded = ShardedUpdates(setup, full_gradients=bool(setup.clips))
        if not sharded.groups:
            sharded = None
    arrays: list[DeviceArray] = []
    if world.size > 1:
        taken = sharded.spans() if sharded is not None else []
        for _, paths in setup.flat_groups:
            start, stop = setup.flat_bounds[paths[0]][0], setup.flat_bounds[paths[-1]][1]
            if (start, stop) not in taken:
                arrays.append(setup.executor.view(setup.flat_grads, start, (stop - start,)))
        arrays.extend(setup.grad_out[f"grad/{path}"] for path in setup.lone_params)
    if setup.diagnosis_accumulates and world.size > 1:
        whole = [setup.flat_grads] if setup.flat_bounds else []
        whole.extend(setup.grad_out[f"grad/{path}"] for path in setup.lone_params)
        setup.whole_gradients = GradientReduction(setup.collectives, whole)
    if sharded is not None:
        # The driver's flat updates are its flat groups', in order.
        setup.flat_updates[:] = [update for update, (_, paths) in zip(setup.flat_updates, setup.flat_groups)
                                 if not sharded.owns(paths[0])]
        for name in list(setup.states):
            if sharded.owns(name.rsplit("/", 1)[0]):
                del setup.states[name]
    return sharded, GradientReduction(setup.collectives, arrays)


def manifest_fields(trainer: Any) -> dict[str, Any]:
    """What the start event's manifest adds for several ranks: their count, the microbatches each
    runs, whether the optimizer states are sharded."""
    world: Communicator = trainer.world
    if world.size == 1:
        return {}
    return {"ranks": world.size, "microbatches_per_rank": trainer.local_microbatches,
            "zero_stage": 1 if trainer.sharded is not None else 0, "transport": trainer.collectives.transport}


class GradientReduction:
    """Sums the step's gradients over the ranks, in place, through the setup's `DeviceCollectives`: the
    flat gradient array and every gradient outside it (through host staging, packed into one buffer in
    a fixed order). Arrays a `ShardedUpdates` reduces itself (the spans it reduce-scatters) are left out."""

    def __init__(self, collectives: DeviceCollectives, arrays: Sequence[DeviceArray]) -> None:
        self.collectives = collectives
        self.arrays = list(arrays)

    def __call__(self) -> None:
        if self.arrays:
            self.collectives.sum_arrays(self.arrays)

    def share(self, root: int) -> None:
        """Every rank's arrays replaced by rank `root`'s."""
        if self.arrays:
            self.collectives.share_arrays(self.arrays, root)


class ShardedGroup:
    """One flat group under ZeRO-1: its span of the flat arrays, this rank's shard of it, the shard's
    states and the group's update graph for the shard."""

    def __init__(self, setup: Any, paths: list[str]) -> None:
        ex: Executor = setup.executor
        world: Communicator = setup.world
        self.paths = paths
        self.start = setup.flat_bounds[paths[0]][0]
        self.stop = setup.flat_bounds[paths[-1]][1]
        shard_start, shard_stop = shard_bounds(self.stop - self.start, world.size)[world.rank]
        self.shard = (self.start + shard_start, self.start + shard_stop)
        shard_numel = shard_stop - shard_start
        by_param = {str(func.attributes["param"]): func for func in setup.plan.graphs_of_kind("update")}
        funcs = [by_param[path] for path in paths]
        self.update: Executable = ex.compile(flat_update_graph(funcs, shard_numel))
        self.state_names = list(setup.updates[paths[0]][1])
        self.states = {state: ex.zeros((shard_numel,), "f32") for state in self.state_names}
        self.param = ex.view(setup.flat_params, self.shard[0], (shard_numel,))
        self.grad = ex.view(setup.flat_grads, self.shard[0], (shard_numel,))
        self.group_params = ex.view(setup.flat_params, self.start, (self.stop - self.start,))
        self.group_grads = ex.view(setup.flat_grads, self.start, (self.stop - self.start,))
        #: The shard's and the group's bf16 working copies, where the update writes them (`working-copies`).
        self.copies: tuple[DeviceArray, DeviceArray] | None = None
        if UPDATE_OUTPUT in self.update.output_names:
            self.copies = (ex.view(setup.flat_copies, self.shard[0], (shard_numel,)),
                           ex.view(setup.flat_copies, self.start, (self.stop - self.start,)))


class ShardedUpdates:
    """ZeRO-1 over the flat groups whose element count divides by the rank count (docs/distributed.md).

    Takes over those groups from the driver: their gradients' reduction (reduce-scatter into the
    shard, unless `full_gradients`: a clip reads the whole reduced gradient, so it is summed whole),
    their updates and the all-gather of their parameters, and their states in checkpoints.
    """

    def __init__(self, setup: Any, full_gradients: bool) -> None:
        self.world: Communicator = setup.world
        self.executor: Executor = setup.executor
        self.collectives: DeviceCollectives = setup.collectives
        self.full_gradients = full_gradients
        self.groups = [ShardedGroup(setup, paths) for _, paths in setup.flat_groups
                       if (setup.flat_bounds[paths[-1]][1] - setup.flat_bounds[paths[0]][0]) % self.world.size == 0]
        self.paths = {path for group in self.groups for path in group.paths}
        self.flat_bounds = setup.flat_bounds
        self.shapes = {f"{path}/{state}": shape for path in self.paths
                       for state, shape in setup.updates[path][1].items()}

    def owns(self, path: str) -> bool:
        """Whether `path` is a parameter of a sharded group."""
        return path in self.paths

    def spans(self) -> list[tuple[int, int]]:
        """The (start, stop) in the flat arrays of each sharded group."""
        return [(group.start, group.stop) for group in self.groups]

    def reduce_gradients(self) -> None:
        """Each group's gradient span summed over the ranks: this rank's shard of it at least."""
        if self.full_gradients:
            self.collectives.sum_arrays([group.group_grads for group in self.groups])
            return
        for group in self.groups:
            self.collectives.reduce_scatter(group.group_grads, group.grad)

    def update(self, step_input: DeviceArray) -> None:
        """Each rank updates its shards; then every rank gets every shard of the parameters."""
        for group in self.groups:
            arrays = {"param": group.param, "grad": group.grad, **group.states}
            written = {"param": group.param, **group.states}
            if group.copies is not None:
                written[UPDATE_OUTPUT] = group.copies[0]
            group.update({**arrays, "step": step_input}, written)
        for group in self.groups:
            self.collectives.all_gather(group.param, group.group_params)
            if group.copies is not None:
                self.collectives.all_gather(*group.copies)

    def gathered_states(self) -> dict[str, np.ndarray] | None:
        """Every state of the sharded groups, whole, on rank 0 (None on the others): a checkpoint's."""
        shards = [{state: self.executor.download(array).copy() for state, array in group.states.items()}
                  for group in self.groups]
        every = self.world.gather(shards)
        if every is None:
            return None
        states: dict[str, np.ndarray] = {}
        for index, group in enumerate(self.groups):
            for state in group.state_names:
                whole = np.concatenate([rank_shards[index][state] for rank_shards in every])
                for path in group.paths:
                    start, stop = self.flat_bounds[path]
                    name = f"{path}/{state}"
                    states[name] = whole[start - group.start:stop - group.start].reshape(self.shapes[name])
        return states

    def load_states(self, states: dict[str, np.ndarray]) -> None:
        """This rank's shards of whole states (a checkpoint's, written on any rank count)."""
        for group in self.groups:
            for state in group.state_names:
                # The group's span as the flat arrays lay it out: each member at its (aligned) place, gaps zero.
                whole = np.zeros(group.stop - group.start, dtype=np.float32)
                for path in group.paths:
                    start, stop = self.flat_bounds[path]
                    whole[start - group.start:stop - group.start] = np.asarray(
                        states[f"{path}/{state}"], dtype=np.float32).reshape(-1)
                self.executor.write(group.states[state], whole[group.shard[0] - group.start:
                                                               group.shard[1] - group.start])

    def state_bytes(self) -> int:
        """The bytes of optimizer state this rank holds for the sharded groups."""
        return sum(4 * (group.shard[1] - group.shard[0]) * len(group.state_names) for group in self.groups)


class RankRecord:
    """This rank's process id and last words, in the folder `sexpgpu run --ranks N` watches: what it
    names when a rank dies (launch.py). A file per rank, replaced whole at each activity, and touched
    every `HEARTBEAT_SECONDS` by a thread of its own: a rank whose file goes stale while its process
    lives has stopped responding (stopped, or frozen holding the interpreter), which the launcher ends."""

    def __init__(self, world: Communicator) -> None:
        folder = os.environ.get(RANK_DIRECTORY_VARIABLE)
        self.path = Path(folder) / f"rank-{world.rank}" if folder and world.size > 1 else None
        self.say("starting")
        if self.path is not None:
            threading.Thread(target=self._beat, name="sexpgpu-rank-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        assert self.path is not None
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            with contextlib.suppress(OSError):  # replaced by `say` at that moment: the new file is as fresh
                os.utime(self.path)

    def say(self, activity: str) -> None:
        if self.path is None:
            return
        temporary = self.path.with_suffix(".tmp")
        with contextlib.suppress(OSError):  # the record is a courtesy for the failure message
            temporary.write_text(f"{os.getpid()}\n{activity}\n")
            os.replace(temporary, self.path)


def read_rank_records(folder: Path) -> dict[int, tuple[int, str, float]]:
    """rank → (its process id, its last words, seconds since its last sign of life) from a `RankRecord` folder."""
    records = {}
    for path in folder.glob("rank-*"):
        if not path.name.removeprefix("rank-").isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            pid, _, activity = path.read_text().partition("\n")
            silent = time.time() - path.stat().st_mtime
            records[int(path.name.removeprefix("rank-"))] = (int(pid), activity.strip(), silent)
    return records


class _NullEventLog:
    """The event log of a rank other than 0: rank 0 alone writes the run record."""

    def write(self, type_: str, **fields: Any) -> dict[str, Any]:
        return {"type": type_, **fields}

    def close(self) -> None:
        pass


def event_log(world: Communicator, path: Path) -> Any:
    """The run's event log on rank 0; on the other ranks, one that writes nothing."""
    from .events import EventLog

    return EventLog(path) if world.is_root else _NullEventLog()


def progress_stream(world: Communicator, stream: Any) -> Any:
    """Where a rank shows its progress and summary: rank 0 where asked; the others nowhere."""
    return stream if world.is_root else open(os.devnull, "w")  # noqa: SIM115  (lives as long as the run)
