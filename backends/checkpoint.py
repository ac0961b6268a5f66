"""Checkpoints: `DIR/checkpoints/step-N/` written atomically, read back verified.

A checkpoint directory holds

- `params.safetensors`: every parameter by its path (f32 master weights);
- `optimizer.safetensors`: every optimizer state as `<path>/<state>` (`m`, `v`,
  `momentum`);
- `manifest.json`: the step, the selection, the loader positions, the RNG
  state, the hashes of the source files, the experiment fingerprint, the
  SHA-256 of both tensor files, and `checksum`: the SHA-256 of everything
  else in the manifest (its canonical JSON), so the manifest is covered as
  the tensor files are.

It is written into a temporary sibling directory, every file and the
directory fsynced, then renamed into place, so a crash at any moment leaves
either the whole checkpoint or none of it; the previous checkpoints stay
untouched. Reading verifies the manifest's checksum and both tensor hashes, so
a damaged checkpoint, or a manifest edited by hand (a step, a loader position,
the selection), is refused rather than resumed from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from ..diagnostics import SxError

#: A tensor's shape and dtype, as a checkpoint must hold it.
TensorSpec = tuple[tuple[int, ...], np.dtype]

FORMAT = "sexpgpu-checkpoint"
#: 2: the manifest carries its own checksum.
VERSION = 2
PARAMS_FILE = "params.safetensors"
STATES_FILE = "optimizer.safetensors"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
#: A test hook, `STEP:SECONDS`: pause that long between writing the tensors and the
#: manifest of that step's checkpoint, so a test can kill the process in the middle of it.
PAUSE_ENV = "SEXPGPU_TEST_CHECKPOINT_PAUSE"


class Checkpoint:
    """One checkpoint read back: its manifest, parameters and optimizer states."""

    def __init__(self, path: Path, manifest: dict[str, Any], params: dict[str, np.ndarray],
                 states: dict[str, np.ndarray]) -> None:
        self.path = path
        self.manifest = manifest
        self.params = params
        self.states = states

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def check_matches(self, params: dict[str, TensorSpec], states: dict[str, TensorSpec]) -> None:
        """Refuse, naming the tensor, a checkpoint whose tensors are not exactly the experiment's
        (`params`, `states`: name → (shape, dtype)): one missing, one of another shape or dtype, or
        one the experiment does not have."""
        for kind, theirs, ours in (("parameter", self.params, params), ("optimizer state", self.states, states)):
            for name, (shape, dtype) in ours.items():
                found = theirs.get(name)
                if found is None:
                    raise self._mismatch(f"it holds no {kind} {name}")
                if found.shape != tuple(shape):
                    raise self._mismatch(f"{kind} {name} is {list(found.shape)} there, {list(shape)} here")
                if found.dtype != dtype:
                    raise self._mismatch(f"{kind} {name} is {found.dtype} there, {dtype} here")
            extra = sorted(set(theirs) - set(ours))
            if extra:
                raise self._mismatch(f"it holds {kind} {extra[0]}, which the experiment does not have")

    def _mismatch(self, why: str) -> SxError:
        return SxError(f"cannot resume from {self.path}: its tensors do not match the experiment's: {why}")


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a manifest without its `checksum` field."""
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _contiguous(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(array) for name, array in tensors.items()}


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def write_checkpoint(run_dir: Path, step: int, params: dict[str, np.ndarray], states: dict[str, np.ndarray],
                     manifest: dict[str, Any]) -> Path:
    """Write `run_dir/checkpoints/step-<step>/` atomically; returns its path.

    `manifest` holds what the caller records (selection, loaders, RNG,
    sources, fingerprint); the format, step and file hashes are added here.
    """
    root = checkpoints_dir(run_dir)
    final = root / f"step-{step}"
    temporary = root / f".step-{step}.tmp-{os.getpid()}"
    try:
        return _write_checkpoint(root, final, temporary, step, params, states, manifest)
    # A full disk, a read-only place (safetensors reports its I/O errors as its own): nothing half-written stays.
    except (OSError, SafetensorError) as err:
        shutil.rmtree(temporary, ignore_errors=True)
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise SxError(f"cannot write the checkpoint {final}: {reason}") from None


def _write_checkpoint(root: Path, final: Path, temporary: Path, step: int, params: dict[str, np.ndarray],
                      states: dict[str, np.ndarray], manifest: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    save_file(_contiguous(params), str(temporary / PARAMS_FILE))
    save_file(_contiguous(states), str(temporary / STATES_FILE))
    pause_step, _, pause_seconds = os.environ.get(PAUSE_ENV, "").partition(":")
    if pause_step == str(step):
        time.sleep(float(pause_seconds))
    record = {
        **manifest,
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "files": {name: file_sha256(temporary / name) for name in (PARAMS_FILE, STATES_FILE)},
    }
    record["checksum"] = manifest_checksum(record)
    (temporary / MANIFEST_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    for name in (PARAMS_FILE, STATES_FILE, MANIFEST_FILE):
        _fsync_path(temporary / name)
    _fsync_path(temporary)
    if final.exists():
        # Rewriting a step (an interrupt right after a cadence checkpoint): move the old one
        # aside first so a crash between the renames still leaves the earlier checkpoints.
        retired = root / f".step-{step}.old-{os.getpid()}"
        os.rename(final, retired)
        os.rename(temporary, final)
        shutil.rmtree(retired)
    else:
        os.rename(temporary, final)
    _fsync_path(root)
    return final


def remove_incomplete(run_dir: Path) -> None:
    """Delete what a killed writer left behind (temporary directories never renamed into place)."""
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(".step-") and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, by step (temporary directories are never listed)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def resolve_checkpoint(path: Path) -> Path:
    """`--resume` takes a run directory (its latest checkpoint) or one `step-N` directory."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists() or _STEP_DIR.match(path.name):
        return path
    found = list_checkpoints(path)
    if not found:
        if not path.exists():
            raise SxError(f"cannot resume from {path}: no such directory")
        if not path.is_dir():
            raise SxError(f"cannot resume from {path}: it is not a directory (give a run record or one of its "
                          "checkpoints/step-N)")
        raise SxError(f"cannot resume from {path}: it holds no checkpoint (looked in {checkpoints_dir(path)})")
    return found[-1][1]


def read_checkpoint(path: Path, use: str = "resumed from") -> Checkpoint:
    """Load and verify one checkpoint directory; a damaged one is an SxError naming what is wrong
    (it "cannot be `use`": resumed from, sampled from)."""
    path = Path(path)

    def refuse(why: str) -> SxError:
        earlier = [p for _, p in list_checkpoints(path.parent.parent) if p != path]
        hint = f"; an earlier one is {earlier[-1]}" if earlier else ""
        return SxError(f"checkpoint {path} is damaged and cannot be {use}: {why}{hint}")

    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise refuse(f"{MANIFEST_FILE} is missing")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON, bad UTF-8, a huge integer
        raise refuse(f"{MANIFEST_FILE} is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise refuse(f"{MANIFEST_FILE} is not a sexpgpu checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise refuse(f"checkpoint format version {manifest.get('version')} is not {VERSION} "
                     "(written by another version of sexpgpu)")
    if manifest.get("checksum") != manifest_checksum(manifest):
        raise refuse(f"{MANIFEST_FILE} does not match its checksum: it was edited or damaged "
                     "(a checkpoint's step, loader positions and selection are resumed as written)")
    files = manifest.get("files")
    for name in (PARAMS_FILE, STATES_FILE):
        if not (path / name).is_file():
            raise refuse(f"{name} is missing")
        if not isinstance(files, dict) or file_sha256(path / name) != files.get(name):
            raise refuse(f"{name} does not match the hash its manifest records")
    try:
        params = load_file(str(path / PARAMS_FILE))
        states = load_file(str(path / STATES_FILE))
    except Exception as err:  # safetensors raises its own error types for malformed files
        raise refuse(f"cannot read the tensors ({err})") from None
    return Checkpoint(path, manifest, params, states)
