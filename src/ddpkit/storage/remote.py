"""A run's copy in an object store: checkpoints committed by a manifest written last.

The commit rule: every object of a checkpoint is uploaded first (a sharded one's by the rank
that wrote it, each rank then reporting its objects' sums), its manifest
(`checkpoints/NAME.manifest.json`: the size and CRC-32 of each object) last, by rank 0 once
every rank reported; a checkpoint whose manifest is missing does not exist, whatever objects are there. Re-saving a name
deletes its manifest before any object is overwritten, retention deletes a manifest before
its objects, so a reader never trusts a mix. Downloads are checked against the manifest
before anything loads them (and loading is weights-only, as for local files).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable

from ..util.checksum import crc32_of
from .errors import StoreError, explained
from .location import Remote, filesystem

CKPT = "checkpoints"
MANIFEST_SUFFIX = ".manifest.json"
REPORTS_SUFFIX = ".reports"  # checkpoints/NAME.reports/RANK.json: a rank's shards are up (sharded saves)
FORMAT = "ddpkit-remote-checkpoint"


def order(name: str) -> tuple[int, ...]:
    """epoch-000002 < epoch-000002-step-000003 < epoch-000003(.pt): by the numbers in the name."""
    return tuple(int(n) for n in re.findall(r"\d+", name.removesuffix(MANIFEST_SUFFIX).removesuffix(".pt")))


def _safe_relative(name: Any) -> str:
    """An object's name from a manifest: relative, inside the checkpoint (a crafted manifest
    names no file outside the folder it is downloaded into)."""
    if not isinstance(name, str) or not name:
        raise ValueError("an object name that is not a string")
    parts = PurePosixPath(name).parts
    if name.startswith("/") or any(p in ("..", ".", "") for p in parts) or "\\" in name:
        raise ValueError(f"an object name outside its checkpoint ({name[:80]!r})")
    return name


def _checkpoint_object(rel: str) -> bool:
    """Under checkpoints/ and committed by a manifest, not one of the run's files: all but
    checkpoints/metrics.json (the scores --keep-best keeps by, which a resume needs back)."""
    return rel.startswith(CKPT + "/") and rel != f"{CKPT}/metrics.json"


def _checked_objects(objects: Any, what: str) -> dict[str, list[int]]:
    """A manifest's or a rank's report's objects: relative names, each with [size, CRC-32]."""
    try:
        if not isinstance(objects, dict):
            raise ValueError("no objects listed")
        for rel, sums in objects.items():
            _safe_relative(rel)
            if not (isinstance(sums, list) and len(sums) == 2 and all(isinstance(v, int) for v in sums)):
                raise ValueError(f"a malformed entry for {rel[:80]!r}")
    except ValueError as e:
        raise StoreError(f"{what} is unreadable: {e}") from None
    return objects


class RemoteRun:
    """One run folder in a bucket (`remote`), read and written through fsspec; its checkpoints
    under `folder` (a run's checkpoints/; "" for an own loop's saves beside each other)."""

    def __init__(self, remote: Remote, fs: Any = None, folder: str = CKPT) -> None:
        self.remote = remote
        self.fs = fs if fs is not None else filesystem(remote)
        self.folder = folder

    @property
    def url(self) -> str:
        return self.remote.url

    def key(self, *parts: str) -> str:
        return self.remote.join(*parts)

    # -- checks ----------------------------------------------------------------------
    def preflight(self) -> None:
        """Before any worker starts: the bucket answers, exists and takes a write (an object
        written and deleted again); each failure one line."""
        probe = self.key(f".ddpkit-write-test-{uuid.uuid4().hex}")
        with explained(self.remote, "checking the bucket"):
            self.fs.ls(self.remote.bucket, refresh=True)
        with explained(self.remote, "writing a test object"):
            self.fs.pipe(probe, b"")
            self.fs.rm(probe)

    def holds_run(self) -> bool:
        """A committed checkpoint or a final model is there."""
        with explained(self.remote, "listing the run"):
            return bool(self.committed()) or self.fs.exists(self.key("model.pt"))

    # -- checkpoints -----------------------------------------------------------------
    def committed(self) -> list[str]:
        """The names of the committed checkpoints (their manifest is there), newest first."""
        with explained(self.remote, "listing the checkpoints"):
            try:
                entries = self.fs.ls(self.key(self.folder), detail=False, refresh=True)
            except FileNotFoundError:
                return []
        names = [PurePosixPath(e).name for e in entries]
        found = [n.removesuffix(MANIFEST_SUFFIX) for n in names if n.endswith(MANIFEST_SUFFIX)]
        return sorted(found, key=order, reverse=True)

    def _report_key(self, name: str, rank: int) -> str:
        return self.key(self.folder, name + REPORTS_SUFFIX, f"{rank}.json")

    def uncommit(self, name: str) -> None:
        """Before `name` is saved again: its manifest and the ranks' reports go first, so no reader
        trusts a mix of the old and the new objects."""
        with explained(self.remote, f"preparing {name}"):
            self.fs.invalidate_cache()  # a listing cached earlier in this process may predate that manifest
            for key in (self.key(self.folder, name + MANIFEST_SUFFIX), self.key(self.folder, name + REPORTS_SUFFIX)):
                if self.fs.exists(key):
                    self.fs.rm(key, recursive=True)

    def upload_shards(self, folder: Path, files: Iterable[Path], rank: int) -> dict[str, list[int]]:
        """One rank's own files of the sharded checkpoint `folder`, straight to the bucket, then
        its report (each object's size and CRC-32): what rank 0's manifest waits for."""
        name, sums = folder.name, {}
        with explained(self.remote, f"uploading {name}"):
            for path in files:
                self.fs.put_file(str(path), self.key(self.folder, name, path.name))
                sums[path.name] = list(crc32_of(path))
            if rank != 0:
                self.fs.pipe(self._report_key(name, rank), json.dumps(sums).encode())
        return sums

    def commit_shards(self, folder: Path, own: Iterable[Path], world_size: int, timeout_s: float) -> str:
        """Rank 0: its own files, then every other rank's report (bounded wait), then the manifest
        listing every object: the checkpoint exists from that write on. Returns its URL."""
        name = folder.name
        objects = self.upload_shards(folder, own, 0)
        waiting, deadline, pause = set(range(1, world_size)), time.monotonic() + timeout_s, 0.02
        while waiting:
            for rank in sorted(waiting):
                with explained(self.remote, f"reading rank {rank}'s report of {name}"):
                    try:
                        report = json.loads(self.fs.cat_file(self._report_key(name, rank)))
                    except FileNotFoundError:
                        continue
                objects.update(_checked_objects(report, f"rank {rank}'s report of {name}"))
                waiting.discard(rank)
            if waiting and time.monotonic() > deadline:
                raise StoreError(
                    f"{self.remote.url_of(self.key(self.folder, name))}: ranks {sorted(waiting)} did not report their "
                    f"upload within {timeout_s:.0f} s; the checkpoint is not committed (the previous one stands)"
                )
            if waiting:
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
        self._write_manifest(name, True, objects)
        with explained(self.remote, f"tidying {name}"):
            self.fs.rm(self.key(self.folder, name + REPORTS_SUFFIX), recursive=True)
        return self.remote.url_of(self.key(self.folder, name))

    def _write_manifest(self, name: str, folder: bool, objects: dict[str, list[int]]) -> None:
        body = {"format": FORMAT, "name": name, "folder": folder, "objects": objects}
        with explained(self.remote, f"committing {name}"):
            self.fs.pipe(self.key(self.folder, name + MANIFEST_SUFFIX), json.dumps(body, indent=1).encode())

    def commit(self, local: Path, side: Iterable[tuple[Path, str]] = ()) -> str:
        """Upload the checkpoint `local` (a file, or a folder of shards) object by object, its
        manifest last; then the `side` files (local path, key in the run). Returns the URL."""
        name = local.name
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        objects: dict[str, list[int]] = {}
        manifest = self.key(self.folder, name + MANIFEST_SUFFIX)
        with explained(self.remote, f"uploading {name}"):
            if self.fs.exists(manifest):  # the same name saved again: it stops existing before it changes
                self.fs.rm(manifest)
            for path in files:
                rel = path.relative_to(local).as_posix() if local.is_dir() else ""
                self.fs.put_file(str(path), self.key(self.folder, name, rel) if rel else self.key(self.folder, name))
                objects[rel or name] = list(crc32_of(path))
        self._write_manifest(name, local.is_dir(), objects)
        self.put_files(side)
        return self.remote.url_of(self.key(self.folder, name))

    def put_files(self, files: Iterable[tuple[Path, str]]) -> None:
        for path, key in files:
            if path.is_file():
                with explained(self.remote, f"uploading {key}"):
                    self.fs.put_file(str(path), self.key(key))

    def delete(self, name: str) -> None:
        """A committed checkpoint: its manifest first (it stops existing), then its objects."""
        with explained(self.remote, f"deleting {name}"):
            self.fs.rm(self.key(self.folder, name + MANIFEST_SUFFIX))
            target = self.key(self.folder, name)
            if self.fs.exists(target):
                self.fs.rm(target, recursive=True)

    def remove_orphans(self) -> list[str]:
        """Objects under checkpoints/ that no manifest lists (what a killed upload left): before
        the workers start, when nothing else writes there."""
        keep = set(self.committed())
        with explained(self.remote, "listing the checkpoints"):
            try:
                entries = self.fs.ls(self.key(self.folder), detail=False, refresh=True)
            except FileNotFoundError:
                return []
            gone = []
            for entry in entries:
                name = PurePosixPath(entry).name
                if name.endswith(MANIFEST_SUFFIX) or name in keep or not name.startswith("epoch-"):
                    continue
                with contextlib.suppress(FileNotFoundError):  # another node's launcher, doing the same
                    self.fs.rm(entry, recursive=True)
                gone.append(name)
        return gone

    def manifest(self, name: str) -> dict[str, Any]:
        """A checkpoint's manifest, checked (plain JSON: a crafted one names data, never code)."""
        with explained(self.remote, f"reading the manifest of {name}"):
            raw = self.fs.cat_file(self.key(self.folder, name + MANIFEST_SUFFIX))
        try:
            body = json.loads(raw)
            if not isinstance(body, dict) or body.get("format") != FORMAT:
                raise ValueError("not a ddpkit manifest")
        except (ValueError, TypeError) as e:
            raise StoreError(
                f"{self.remote.url_of(self.key(self.folder, name))}: its manifest is unreadable: {e}"
            ) from None
        _checked_objects(body.get("objects"), f"the manifest of {self.remote.url_of(self.key(self.folder, name))}")
        return body

    def fetch(self, name: str, folder: Path) -> Path:
        """Download the committed checkpoint `name` into `folder` (its checkpoints/ folder) and
        check every object against its manifest; a damaged one raises, leaving nothing."""
        body = self.manifest(name)
        url = self.remote.url_of(self.key(self.folder, name))
        tmp = folder / f".{name}.download"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for rel, (size, crc) in sorted(body["objects"].items()):
                key = self.key(self.folder, name, rel) if body.get("folder") else self.key(self.folder, name)
                dest = tmp / rel if body.get("folder") else tmp / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                with explained(self.remote, f"downloading {name}"):
                    try:
                        self.fs.get_file(key, str(dest))
                    except FileNotFoundError:
                        raise StoreError(f"{url}: object {rel} is missing (its manifest lists it)") from None
                have = crc32_of(dest)
                if have[0] != size:
                    raise StoreError(f"{url}: object {rel} is {have[0]:,} bytes, its manifest says {size:,}")
                if have[1] != crc:
                    raise StoreError(f"{url}: object {rel} fails its CRC-32 check (changed after it was written)")
            final = folder / name
            if final.is_dir():
                shutil.rmtree(final)
            os.replace(tmp / name if not body.get("folder") else tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def fetch_newest(self, folder: Path, say: Callable[[str], None]) -> Path | None:
        """The newest committed checkpoint that downloads intact, into `folder`; each one
        skipped (damaged, unreadable manifest) is one line through `say`. None: none usable."""
        for name in self.committed():
            try:
                return self.fetch(name, folder)
            except StoreError as e:
                if "cannot reach" in str(e) or "access denied" in str(e):
                    raise
                say(f"ddpkit: skipping checkpoint: {e}")
        return None

    # -- the rest of the run folder --------------------------------------------------
    def get_run_files(self, local: Path) -> list[str]:
        """Everything of the run outside checkpoints/ (config.json, metrics.jsonl, ...) into `local`."""
        got = []
        with explained(self.remote, "downloading the run's files"):
            base = self.key()
            for key in self.fs.find(base):
                rel = key[len(base) :].lstrip("/")
                if not rel or _checkpoint_object(rel) or rel.startswith(".ddpkit-write-test-"):
                    continue
                dest = local / _safe_relative(rel)
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(key, str(dest))
                got.append(rel)
        return got

    def put_run_files(self, local: Path, skip: Callable[[str], bool] = lambda rel: False) -> list[str]:
        """Everything of the local run folder outside checkpoints/ (but checkpoints/metrics.json)."""
        sent = []
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            rel = path.relative_to(local).as_posix()
            if _checkpoint_object(rel) or skip(rel):
                continue
            with explained(self.remote, f"uploading {rel}"):
                self.fs.put_file(str(path), self.key(rel))
            sent.append(rel)
        return sent
