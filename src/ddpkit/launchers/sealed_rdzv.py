"""torch's c10d rendezvous over a sealed store: a multi-node job started with a job token.

torch's rendezvous keeps its state pickled in the store (rewriting it ran code in the agents)
and publishes the workers' master address there; the agents also exchange their ranks there.
Under the backend name SEALED, all of that goes through runtime/sealed.py's SealedStore: a
client without the token can neither read those keys nor write one that any agent accepts, so
it is never counted as a node, and what the agents unpickle is only what they wrote.

The store's host also leaves one plain key, CHECK_KEY, that says the job has a token (and a
hash that a node with the wrong one sees differ): a ddpkit node without the token, or with
another, is refused at once in one line instead of waiting in a rendezvous of its own.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from ..errors import DdpkitError

SEALED = "ddpkit-sealed-c10d"
CHECK_KEY = "ddpkit/job-token-check"
NO_TOKEN = "no-token"


def token_check(key: bytes | None, run_id: str) -> bytes:
    """What the host leaves under CHECK_KEY: a hash of the job's key and id, or NO_TOKEN."""
    if key is None:
        return NO_TOKEN.encode()
    return hmac.new(key, b"check\0" + run_id.encode(), hashlib.sha256).hexdigest().encode()


def mark_store(store: Any, run_id: str) -> None:
    """On the node that hosts the rendezvous store, before any node can meet in it."""
    from ..util.jobtoken import job_token

    store.set(CHECK_KEY, token_check(job_token(), run_id))


def refuse_if_foreign(store: Any, key: bytes | None, run_id: str, endpoint: str) -> None:
    """A node whose token (or lack of one) is not the job's: one line that says so."""
    if not store.check([CHECK_KEY]):
        return  # a host that is not ddpkit's, or not yet marked: the rendezvous itself decides
    theirs, ours = bytes(store.get(CHECK_KEY)), token_check(key, run_id)
    if hmac.compare_digest(theirs, ours):
        return
    if key is None:
        raise DdpkitError(
            f"the job at {endpoint} was started with a job token and this node has none: set DDPKIT_JOB_TOKEN_FILE "
            "(or DDPKIT_JOB_TOKEN) to the job's token on every node (README, Security)"
        )
    if theirs == NO_TOKEN.encode():
        raise DdpkitError(
            f"this node has a job token and the job at {endpoint} was started without one: "
            "set the same token on every node, or on none"
        )
    raise DdpkitError(
        f"this node's job token is not the one of the job at {endpoint} (or its --rdzv-id differs): "
        "give every node the same token"
    )


def _create_sealed_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, _create_tcp_store
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from ..runtime.sealed import SealedStore
    from ..util.jobtoken import job_token

    key = job_token()
    raw = _create_tcp_store(params)
    refuse_if_foreign(raw, key, params.run_id, params.endpoint)
    store = raw if key is None else SealedStore(raw, key)

    class Backend(C10dRendezvousBackend):
        name = SEALED  # torch checks that the handler's backend is the one asked for

    return create_handler(store, Backend(store, params.run_id), params)


def register() -> str:
    """The backend name to give torch's agent for a multi-node c10d rendezvous (registered once)."""
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    rendezvous_handler_registry.register(SEALED, _create_sealed_handler)  # the same creator again: a no-op
    return SEALED
