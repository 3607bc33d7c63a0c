"""A store whose keys and values only holders of the job token can read or write.

torch's TCPStore serves anyone who connects, and lists its keys to them (`list_keys`), so a
secret key prefix hides nothing. Instead every key is renamed by a keyed hash and every value
sealed: encrypted with a keystream (SHAKE-256 of a derived key and an IV) where the IV is an
HMAC-SHA256 of the key's name and the plain value (a synthetic IV: the tag that is checked).
Sealing is deterministic, so torch's compare_set still compares what it wrote. A value that
does not open (written by a client without the token, or damaged) raises, and is never
handed on: the rendezvous state torch unpickles and the addresses the workers connect to are
only what the job's own nodes wrote.

Not sealed: counters (`add` sums integers on the server, so anyone can bump one, under its
hashed name), and what a client can do by connecting at all (fill the store's memory, hold
connections, delete keys, put back a value the job itself wrote there before). Those disturb
or stop a job; they cannot make it run foreign code or train with foreign values.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta
from typing import Any

import torch.distributed as dist

TAG = 32
PREFIX = "ddpkit-sealed/"


class SealError(RuntimeError):
    """A value in the store was not written by a holder of the job token."""


class SealedStore(dist.Store):
    """`inner` (a TCPStore, or a PrefixStore over one) seen through the job's key (util/jobtoken.py)."""

    def __init__(self, inner: dist.Store, key: bytes) -> None:
        super().__init__()
        self._inner = inner
        self._names = hmac.new(key, b"names", hashlib.sha256).digest()
        self._tags = hmac.new(key, b"tags", hashlib.sha256).digest()
        self._stream = hmac.new(key, b"stream", hashlib.sha256).digest()

    # -- the sealing ---------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        return PREFIX + hmac.new(self._names, key.encode(), hashlib.sha256).hexdigest()

    def _seal(self, key: str, value: bytes) -> bytes:
        iv = hmac.new(self._tags, self._name(key).encode() + b"\0" + value, hashlib.sha256).digest()
        return iv + _xor(value, hashlib.shake_256(self._stream + iv).digest(len(value)))

    def _open(self, key: str, sealed: bytes) -> bytes:
        iv, body = sealed[:TAG], sealed[TAG:]
        value = _xor(body, hashlib.shake_256(self._stream + iv).digest(len(body)))
        expected = hmac.new(self._tags, self._name(key).encode() + b"\0" + value, hashlib.sha256).digest()
        if len(sealed) < TAG or not hmac.compare_digest(iv, expected):
            raise SealError(
                "a value in the job's store was not written by a node with this job's token (another job, a node "
                "with a different token, or someone else who reached the store's port)"
            )
        return value

    # -- torch's Store --------------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._inner.set(self._name(key), self._seal(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        return self._open(key, self._inner.get(self._name(key)))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        old = _bytes(expected)
        sealed_old = self._seal(key, old) if old else b""  # empty: "only when the key is absent"
        now = self._inner.compare_set(self._name(key), sealed_old, self._seal(key, _bytes(desired)))
        return self._open(key, now)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        got = self._inner.multi_get([self._name(k) for k in keys])
        return [self._open(k, v) for k, v in zip(keys, got, strict=True)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        sealed = [self._seal(k, _bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._inner.multi_set([self._name(k) for k in keys], sealed)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(self._name(key), amount)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self._inner.wait(names)
        else:
            self._inner.wait(names, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check([self._name(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(self._name(key))

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


def sealed_if_token(store: dist.Store) -> dist.Store:
    """`store` sealed with this job's token when one is set (DDPKIT_JOB_TOKEN[_FILE]), else as it is."""
    from ..util.jobtoken import job_token

    key = job_token()
    return store if key is None else SealedStore(store, key)
