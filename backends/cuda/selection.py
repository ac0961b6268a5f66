"""Which device runtime a device name opens, as the environment says.

- `cuda`: a GPU, through the driver `SEXPGPU_CUDA_DRIVER` names: `cuda-python` (the default;
  cuda-python's driver API) or `pycuda`;
- `cuda-sim`: the simulated device (`driver_sim`), whatever `SEXPGPU_CUDA_DRIVER` says.

`SEXPGPU_DEVICES` holds the device id to open (default 0; `cuda-sim` has the one device 0). Several
ids mean several data-parallel ranks, a process each (docs/distributed.md): `sexpgpu run` starts them,
and each rank, started under a launcher, opens the id at its local rank; a lone process asked for
several is a one-line error, as is a device that cannot open (no driver, no GPU, no `cuda` extra, no
pycuda).

`SEXPGPU_SIM_MEMORY` sizes the simulated device's memory (`64MiB`, `1.5GiB`, or bytes; default half
the host's), so a run can be made to meet the memory limits of a GPU; a bad size is a usage error.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ...diagnostics import SxError, UsageError
from ..distributed import launcher_world, local_rank
from .runtime import DeviceRuntime, DeviceUnavailable

DEVICES = ("cuda", "cuda-sim")
DRIVERS = ("cuda-python", "pycuda")
DEFAULT_DRIVER = "cuda-python"
#: The units `SEXPGPU_SIM_MEMORY` takes (binary, as the runtime's messages print them); none is bytes.
MEMORY_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
                "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def switch_setting(variable: str) -> bool:
    """An on/off environment variable (on where unset): `0`/`off`/`no`/`false` or `1`/`on`/`yes`/`true`;
    anything else is a one-line error."""
    value = (os.environ.get(variable) or "on").strip().lower()
    if value in ("0", "off", "no", "false"):
        return False
    if value in ("1", "on", "yes", "true"):
        return True
    raise SxError(f"{variable}={value} is not on or off")


def requested_driver(device: str) -> str:
    """The driver `device` opens with: `cuda-sim` for the simulator, else `SEXPGPU_CUDA_DRIVER`'s."""
    if device == "cuda-sim":
        return "cuda-sim"
    driver = os.environ.get("SEXPGPU_CUDA_DRIVER") or DEFAULT_DRIVER
    if driver not in DRIVERS:
        raise DeviceUnavailable(device, f"SEXPGPU_CUDA_DRIVER={driver} names no CUDA driver; use "
                                        f"{' or '.join(DRIVERS)} (the default is {DEFAULT_DRIVER})")
    return driver


def requested_device_ids() -> tuple[str, list[str]]:
    """`SEXPGPU_DEVICES` as set (default 0) and the ids it names."""
    text = (os.environ.get("SEXPGPU_DEVICES") or "0").strip()
    return text, [part.strip() for part in text.split(",") if part.strip()]


def rank_device_ids(ranks: int) -> list[str]:
    """The device id each of `ranks` ranks on one machine opens: the id of `SEXPGPU_DEVICES` at its local
    rank, or the one id it names (default 0) for every rank."""
    ids = requested_device_ids()[1]
    return ids if len(ids) > 1 else ids * ranks


def requested_device_index(device: str) -> int:
    """The device id `SEXPGPU_DEVICES` names (default 0); `DeviceUnavailable` for several or a bad one."""
    text, ids = requested_device_ids()
    if len(ids) > 1:
        if launcher_world() is None:
            raise DeviceUnavailable(device, f"SEXPGPU_DEVICES={text} asks for {len(ids)} ranks, a process each: "
                                            "`sexpgpu run` starts them (docs/distributed.md)")
        if local_rank() >= len(ids):
            raise DeviceUnavailable(device, f"SEXPGPU_DEVICES={text} names {len(ids)} devices, but this is local "
                                            f"rank {local_rank()} of a machine")
        ids = [ids[local_rank()]]
    if len(ids) != 1 or not ids[0].isdigit():
        raise DeviceUnavailable(device, f"SEXPGPU_DEVICES={text} is not a device id (0, 1, ...)")
    index = int(ids[0])
    if device == "cuda-sim" and index != 0:
        raise DeviceUnavailable(device, f"SEXPGPU_DEVICES={text}, but the simulated device is device 0 alone")
    return index


def requested_sim_memory() -> int | None:
    """The simulated device's memory in bytes as `SEXPGPU_SIM_MEMORY` gives it (None: unset, the
    simulator's default); a `UsageError` for anything but a positive size."""
    text = (os.environ.get("SEXPGPU_SIM_MEMORY") or "").strip()
    if not text:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)", text)
    unit = MEMORY_UNITS.get(match.group(2).lower()) if match else None
    nbytes = int(float(match.group(1)) * unit) if match and unit else 0
    if nbytes <= 0:
        raise UsageError(f"SEXPGPU_SIM_MEMORY={text} is not a memory size; give a positive number of bytes, or one with KiB, "
                         "MiB, GiB or TiB (64MiB, 1.5GiB)")
    return nbytes


def open_runtime(device: str = "cuda", **options: Any) -> DeviceRuntime:
    """The runtime of `device` (`cuda` or `cuda-sim`) with the driver and device id the environment
    names; `options` go to the simulator (`memory_bytes`, else `SEXPGPU_SIM_MEMORY`'s; `schedule`,
    `cache_dir`). A device that cannot open raises a one-line user error (`DeviceUnavailable`, or
    `CudaToolchainMissing` without the `cuda` extra)."""
    if device not in DEVICES:
        raise ValueError(f"no device runtime for {device!r}; the devices are {', '.join(DEVICES)}")
    driver = requested_driver(device)
    index = requested_device_index(device)
    if driver == "cuda-sim":
        from .driver_sim import SimRuntime

        options.setdefault("memory_bytes", requested_sim_memory())
        return SimRuntime(index, **options)
    if driver == "pycuda":
        from .driver_pycuda import PycudaRuntime

        return PycudaRuntime(index)
    from .driver_cuda import CudaRuntime

    return CudaRuntime(index)


def runtime_unavailable(device: str) -> str | None:
    """None when `open_runtime(device)` can open a device here; else why not, in one line (for the
    executor registry's probe). Opens no context. A bad `SEXPGPU_SIM_MEMORY` is a `UsageError`, so
    `--device cuda-sim` refuses it before any work."""
    try:
        driver = requested_driver(device)
        index = requested_device_index(device)
    except DeviceUnavailable as err:
        return err.reason
    if driver == "cuda-sim":
        requested_sim_memory()
        from .sim.compiler import compiler_identity, host_compiler
        from .sim.errors import SimError

        try:
            compiler_identity(host_compiler())
        except SimError as err:
            return str(err)
        return None
    if driver == "pycuda":
        from .driver_pycuda import probe
    else:
        from .driver_cuda import probe
    return probe(index)
