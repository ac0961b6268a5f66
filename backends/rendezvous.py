"""Rank 0's few bytes (NCCL's unique id) to every rank of a `torchrun`-style launch (docs/distributed.md).

Ranks started with `RANK`, `WORLD_SIZE` and `MASTER_ADDR`/`MASTER_PORT` and
no MPI meet as PyTorch's `env://` ranks do: through a small TCP service at
MASTER_ADDR:MASTER_PORT. Where `torchrun` already runs one there (its agent's
`TCPStore`, `TORCHELASTIC_USE_AGENT_STORE=True`, the default since PyTorch
2.4), the ranks use it through PyTorch's own client, as PyTorch's ranks do
(torchrun brings PyTorch); elsewhere rank 0 serves the bytes itself: it
listens on MASTER_PORT, each other rank connects (retrying until rank 0 is
up), says who it is and receives them. Only the bootstrap goes through
here; every collective afterwards is NCCL's.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable

from ..diagnostics import SxError

#: Seconds every rank has to reach the rendezvous (ranks of a launch start within seconds).
RENDEZVOUS_SECONDS = 300.0
#: What a rank says first (then its rank, 4 bytes big-endian), so a stray connection is told apart.
GREETING = b"sexpgpu-rendezvous/1\n"
#: The agent store's key of the bytes (one per restart of a torchrun job).
STORE_KEY = "sexpgpu/nccl-unique-id"


def master_address() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT; a one-line error where either is missing or the port is no port."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SxError(f"RANK/WORLD_SIZE start GPU ranks that meet at MASTER_ADDR:MASTER_PORT, but they are "
                      f"{host or 'unset'}:{port or 'unset'}; set both (torchrun does), or start the ranks with "
                      "`mpiexec` (docs/distributed.md)")
    return host, int(port)


def share_bytes(rank: int, size: int, make: Callable[[], bytes], length: int,
                seconds: float = RENDEZVOUS_SECONDS) -> bytes:
    """Rank 0's `make()` (`length` bytes) on every rank of `size`."""
    host, port = master_address()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return _through_agent_store(rank, size, make, host, port, seconds)
    if rank == 0:
        payload = make()
        _serve(payload, size, port, seconds)
        return payload
    return _fetch(rank, host, port, length, seconds)


def _serve(payload: bytes, size: int, port: int, seconds: float) -> None:
    """Give `payload` to each of the other `size - 1` ranks as it connects."""
    deadline = time.monotonic() + seconds
    waiting = set(range(1, size))
    try:
        server = socket.create_server(("", port), backlog=size)
    except OSError as err:
        raise SxError(f"rank 0 cannot listen on MASTER_PORT {port} for the other ranks ({err.strerror}); "
                      "give a free port") from None
    with server:
        while waiting:
            server.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                connection, _ = server.accept()
            except TimeoutError:
                raise SxError(f"rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, sorted(waiting)))} did "
                              f"not reach rank 0 on MASTER_PORT {port} within {seconds:.0f} s") from None
            with connection:
                connection.settimeout(10.0)
                try:
                    greeting = _receive(connection, len(GREETING) + 4)
                except (OSError, EOFError):
                    continue
                rank = struct.unpack(">i", greeting[len(GREETING):])[0]
                if greeting[:len(GREETING)] != GREETING or rank not in waiting:
                    continue
                connection.sendall(payload)
                waiting.discard(rank)


def _fetch(rank: int, host: str, port: int, length: int, seconds: float) -> bytes:
    """Rank 0's bytes, asked for until it answers or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001)) as connection:
                connection.sendall(GREETING + struct.pack(">i", rank))
                return _receive(connection, length)
        except (OSError, EOFError) as err:
            if time.monotonic() >= deadline:
                raise SxError(f"rank {rank} could not reach rank 0 at MASTER_ADDR:MASTER_PORT {host}:{port} "
                              f"within {seconds:.0f} s ({err})") from None
            time.sleep(0.2)


def _receive(connection: socket.socket, length: int) -> bytes:
    data = b""
    while len(data) < length:
        chunk = connection.recv(length - len(data))
        if not chunk:
            raise EOFError(f"the connection closed after {len(data)} of {length} bytes")
        data += chunk
    return data


def _through_agent_store(rank: int, size: int, make: Callable[[], bytes], host: str, port: int,
                         seconds: float) -> bytes:
    """The bytes through the TCPStore torchrun's agent serves at MASTER_ADDR:MASTER_PORT."""
    from datetime import timedelta

    try:
        from torch.distributed import TCPStore
    except ImportError:
        raise SxError("TORCHELASTIC_USE_AGENT_STORE says torchrun's store serves MASTER_PORT, but PyTorch, whose "
                      "client speaks to it, is not importable here") from None
    store = TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=seconds))
    key = f"{STORE_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        payload = make()
        store.set(key, payload)
        return payload
    return bytes(store.get(key))
