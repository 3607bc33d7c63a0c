"""The workers' key-value store (rank 0 serves it on the master address only)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..envvars import RESTART_COUNT_VAR
from ..errors import DdpkitError


def make_store(env: Any, timeout: float) -> dist.Store:
    """The workers' key-value store for `env` (a DistEnv). Rank 0 serves it on the master
    address only (torch's default listens on every interface); under torch's elastic agent
    with a shared store (static rendezvous), every rank is a client of the agent's store,
    as torchrun does."""
    wait = timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, wait)
        prefix = f"/worker/attempt_{os.environ.get(RESTART_COUNT_VAR, '0')}"  # the agent's own, string as torch sets it
        return dist.PrefixStore(prefix, store)
    if env.rank != 0:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, wait)
    fd = bound_listener(env.master_addr, env.master_port).detach()  # the store owns the socket now
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, True, wait, master_listen_fd=fd)


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening socket on exactly host:port (not all interfaces)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise DdpkitError(
            f"cannot listen on the master address {host}:{port} ({e.strerror}); "
            "is the port in use, or is the address not this node's?"
        ) from None
    return sock
