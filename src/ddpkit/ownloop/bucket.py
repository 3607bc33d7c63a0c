"""rt.save / rt.load with a bucket URL (s3://BUCKET/PREFIX/NAME): the same files as on a local
disk, written in a local staging folder first and committed by the rule of a run stored in a
bucket (storage/remote.py): every object, then the manifest `NAME.manifest.json` last, so a save
killed midway leaves the previous save of that name, or none, never a mix; a load downloads the
committed objects, checks them against the manifest, and loads the copy as a local one.

A sharded save is staged in one folder on the node (DCP's writer and the header's checksums need
every rank's files in one place): on several nodes it is refused, as a run folder in a bucket is.
Every rank of a load downloads its own copy (DCP reads whichever shards it needs). The folder
mark that refuses a second job saving into the same local folder has no bucket counterpart.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from torch import nn

from ..checkpoint import whole
from ..checkpoint.bucket import REPORT_TIMEOUT_S, owner
from ..errors import DdpkitError
from ..storage.location import Remote, parse
from ..storage.remote import RemoteRun


def _target(url: str) -> tuple[RemoteRun, str]:
    """The bucket folder holding `url`'s object(s) and their name in it."""
    where = parse(url)
    assert isinstance(where, Remote)
    parent, _, name = where.path.rpartition("/")
    if not parent or "/" not in where.path:
        raise DdpkitError(f"{url}: name a file under the bucket (s3://BUCKET/PREFIX/NAME), not the bucket itself")
    return RemoteRun(Remote(where.scheme, parent), folder=""), name


@contextlib.contextmanager
def _staging(rt: Any, shared: bool) -> Iterator[Path]:
    """A temporary folder for this save or load: one for the node (rank 0 makes it and says where)
    when `shared`, else this rank's own; gone afterwards."""
    made = tempfile.mkdtemp(prefix="ddpkit-stage-") if rt.is_main or not shared else None
    folder = Path(rt.broadcast_object(made) if shared and rt.world_size > 1 else made)  # type: ignore[arg-type]
    try:
        yield folder
    finally:
        if shared:
            rt.barrier()  # every rank is done with it
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def _said_as_url(e: DdpkitError, local: Path, url: str) -> DdpkitError:
    return DdpkitError(str(e).replace(str(local), url))


def save_to_url(rt: Any, url: str, model: nn.Module, optimizer: Any, sharded: bool, extra: dict[str, Any]) -> None:
    """Collective: rt.save(url, ...) of the Session `rt`: staged, then committed (the manifest last)."""
    run, name = _target(url)
    if sharded and rt.env.nnodes > 1:
        raise DdpkitError(
            f"rt.save({url!r}, sharded=True) on {rt.env.nnodes} nodes: a sharded save to a bucket is staged on one "
            "node; save it to a shared folder, or save one file (sharded=False)"
        )
    if not sharded:
        with _staging(rt, shared=False) as folder:
            local = folder / name
            try:
                whole.save_whole(local, model, optimizer, extra, rt.is_main)
                if rt.is_main:
                    run.commit(local)
            except DdpkitError as e:
                raise _said_as_url(e, local, url) from None
            finally:
                rt.barrier()  # no rank reads the object before it is committed (nor hangs if rank 0 refused)
        return
    from ..checkpoint.sharded import save_state_dir

    if rt.is_main:
        run.uncommit(name)  # an older save of this name stops existing before its objects change
    with _staging(rt, shared=True) as folder:
        local = folder / name
        try:
            save_state_dir(local, model, optimizer, extra, rt.runtime)
        except DdpkitError as e:
            raise _said_as_url(e, local, url) from None
        own = sorted(p for p in local.iterdir() if p.is_file() and owner(p.name) == rt.rank)
        if rt.is_main:
            run.commit_shards(local, own, rt.world_size, REPORT_TIMEOUT_S)
        else:
            run.upload_shards(local, own, rt.rank)
        rt.barrier()  # committed before any rank goes on (a load right after finds it)


def load_from_url(rt: Any, url: str, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Collective: rt.load(url, ...): the committed save downloaded and checked, then loaded."""
    run, name = _target(url)
    if name not in run.committed():
        raise DdpkitError(
            f"{url}: no committed save of that name (its manifest {PurePosixPath(name).name}.manifest.json is "
            "not there: never saved, or a save that did not finish)"
        )
    with _staging(rt, shared=False) as folder:
        local = run.fetch(name, folder)
        try:
            if local.is_dir():
                from ..checkpoint.sharded import load_state_dir

                return load_state_dir(local, model, optimizer)
            return whole.load_whole(local, model, optimizer)
        except DdpkitError as e:
            raise _said_as_url(e, local, url) from None
