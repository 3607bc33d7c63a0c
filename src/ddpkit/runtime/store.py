"""The workers' key-value store: on one node a file in the launcher's private folder, which no
other local user can open; across nodes a TCPStore rank 0 serves on the master address only.

Why a file on one node: torch's TCPStore has no authentication, and loopback is open to every
local user, who could read and rewrite the keys the process group forms from (torch 2.13 has no
TCPStore on a Unix socket). A FileStore in a 0700 folder is reachable by the job's own user only.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import DdpkitError
from ..util.envvars import RESTART_COUNT_VAR, STORE_FILE_VAR
from .sealed import sealed_if_token


def make_store(env: Any, timeout: float) -> dist.Store:
    """The workers' key-value store for `env` (a DistEnv). Started by ddpkit's launcher on one
    node: a FileStore in its private folder. Otherwise rank 0 serves a TCPStore on the master
    address only (torch's default listens on every interface); under torch's elastic agent
    with a shared store (static rendezvous), every rank is a client of the agent's store,
    as torchrun does. With a job token (util/jobtoken.py) every TCPStore is seen sealed: other
    clients of its port can neither read nor forge the keys the process group forms from."""
    wait = timedelta(seconds=timeout)
    private = os.environ.get(STORE_FILE_VAR)
    if private and env.nnodes == 1:
        return private_store(private, env.world_size, wait)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, wait)
        prefix = f"/worker/attempt_{os.environ.get(RESTART_COUNT_VAR, '0')}"  # the agent's own, string as torch sets it
        return sealed_if_token(dist.PrefixStore(prefix, store))
    if env.rank != 0:
        return sealed_if_token(dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, wait))
    fd = bound_listener(env.master_addr, env.master_port).detach()  # the store owns the socket now
    server = dist.TCPStore(env.master_addr, env.master_port, env.world_size, True, wait, master_listen_fd=fd)
    return sealed_if_token(server)


def private_store(base: str, world_size: int, wait: timedelta) -> dist.Store:
    """This attempt's FileStore under `base` (in ddpkit's launcher's 0700 folder): one file per
    group of workers the agent starts, named by its restart count and the port torch's rendezvous
    picked for that round, so that restarted workers never read an earlier attempt's keys."""
    attempt = os.environ.get(RESTART_COUNT_VAR, "0")
    store = dist.FileStore(f"{base}-{attempt}-{os.environ.get('MASTER_PORT', '0')}", world_size)
    store.set_timeout(wait)
    return store


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
