"""Where durable snapshots live on disk, what a complete one is, and which are kept.

No torch here: this is the part the writer, the resume path and the CLI share.

Layout, one directory per job so that jobs sharing a ``snapshot_dir`` never mix::

    <snapshot_dir>/<job>/snap-<lineage:020d>-<commits:012d>-<generation:010d>-<step:010d>-<unix_ns:020d>/
        .metadata, __0_0.distcp     torch.distributed.checkpoint files (the tensors)
        plain.json                  tagged JSON (peer_elastic.state.codec): values, structure
        manifest.json               written last: every file's size and sha256
    <snapshot_dir>/<job>/.tmp-snap-...   a snapshot being written
    <snapshot_dir>/<job>/.tmp-snap-...-shared   a sharded snapshot being written by every rank
    <snapshot_dir>/<job>/.reading-<name>@<host>-<pid>   a resume is reading <name> (kept from pruning)
    <snapshot_dir>/<job>/corrupt-<name>/         a snapshot a resume found corrupt (set aside)

A snapshot is written into a temporary directory, renamed into place, and only then given
its manifest (itself written to a temporary name and renamed). So a directory without a
manifest is torn (the writer died), and one whose files do not match their manifest is
corrupt: both are skipped when resuming.

A name is the :class:`~peer_elastic.state.agreement.StateVersion` of the state it holds (lineage,
commits, generation, step), then the time it was written. Ids order by version, so the
newest snapshot is the newest state: the newest lineage (the job's latest start or resume)
first, then the most commits in it, then the latest generation and step (a final snapshot
taken after the last commit outranks that commit's). The time only keeps two writes of the
same version apart. Names of the older form ``snap-<commits>-<unix_ns>`` (lineage 0) still
load, and rank below every lineage.

A sharded snapshot (:mod:`.sharded`: every rank of the group writes its own shards) has the
same layout with one ``__<rank>_0.distcp`` per writing rank; its manifest says
``"sharded": true``, and it is named, completed, pruned and set aside like the others. Its
ranks write into one temporary directory whose name they all derive from the agreed id
(:meth:`SnapshotDir.shared_temp_dir`), and rank 0 publishes it once every rank has written.

Retention (:meth:`SnapshotDir.prune`) keeps the ``keep`` newest complete snapshots in that
order, and never deletes the snapshot just written or one a resume is reading.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer_elastic.records import valid_name
from peer_elastic.state.agreement import StateVersion

__all__ = [
    "FORMAT",
    "MANIFEST",
    "METADATA",
    "PLAIN",
    "CorruptSnapshot",
    "FileEntry",
    "Manifest",
    "SnapshotDir",
    "SnapshotId",
]

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
PLAIN = "plain.json"
METADATA = ".metadata"  # DCP's own index of the tensor files
_NAME = re.compile(r"^snap-(\d{20})-(\d{12})-(\d{10})-(\d{10})-(\d{20})$")
_LEGACY_NAME = re.compile(r"^snap-(\d{12})-(\d{20})$")
_TMP_PREFIX = ".tmp-"
_READING_PREFIX = ".reading-"
CORRUPT_PREFIX = "corrupt-"
_STALE_TMP_S = 3600.0  # a temporary directory this old belongs to a writer that died


class CorruptSnapshot(Exception):
    """A snapshot directory that is torn (no manifest) or does not match its manifest."""


@dataclass(frozen=True, order=True)
class SnapshotId:
    """Names one snapshot: the version of the state it holds, and when it was written;
    orders oldest first (see the module docstring)."""

    lineage: int
    commits: int
    generation: int
    step: int
    unix_ns: int

    @classmethod
    def of(cls, version: StateVersion, unix_ns: int) -> SnapshotId:
        if version.lineage == 0:  # no lineage: the older name, which has no version parts
            return cls(0, version.commits, 0, 0, unix_ns)
        return cls(*version.as_ints(), unix_ns)

    @property
    def version(self) -> StateVersion:
        return StateVersion(self.lineage, self.commits, self.generation, self.step)

    @property
    def name(self) -> str:
        if self.lineage == 0:
            return f"snap-{self.commits:012d}-{self.unix_ns:020d}"
        return (f"snap-{self.lineage:020d}-{self.commits:012d}-{self.generation:010d}-"
                f"{self.step:010d}-{self.unix_ns:020d}")

    @classmethod
    def parse(cls, name: str) -> SnapshotId | None:
        if m := _NAME.fullmatch(name):
            lineage, commits, generation, step, ns = (int(g) for g in m.groups())
            return cls(lineage, commits, generation, step, ns) if lineage > 0 else None
        if m := _LEGACY_NAME.fullmatch(name):
            return cls(0, int(m.group(1)), 0, 0, int(m.group(2)))
        return None


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a complete snapshot holds; JSON on disk (never pickle)."""

    id: SnapshotId
    job: str
    run_id: str
    generation: int
    world_size: int
    epoch: int
    step: int
    files: dict[str, FileEntry] = field(default_factory=dict)
    # Written by every rank of a group, each its own shards (peer_elastic.durable.sharded),
    # rather than by rank 0 alone with the replicated state: the two load differently.
    sharded: bool = False

    @property
    def unix(self) -> float:
        return self.id.unix_ns / 1e9

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "name": self.id.name, "job": self.job, "run_id": self.run_id,
               "generation": self.generation, "world_size": self.world_size,
               "epoch": self.epoch, "step": self.step,
               "files": {n: {"size": f.size, "sha256": f.sha256}
                         for n, f in sorted(self.files.items())}}
        if self.sharded:  # only then: a replicated snapshot's manifest (and digest) is unchanged
            doc["sharded"] = True
        return json.dumps(doc, indent=1, sort_keys=True).encode("utf-8")

    def digest(self) -> str:
        """sha256 of the manifest: one checksum that covers every file (etcd records)."""
        return hashlib.sha256(self.to_json()).hexdigest()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate; ValueError on anything malformed."""
        try:
            doc = json.loads(data.decode("utf-8"))
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"unknown manifest format {doc.get('format')!r}")
            sid = SnapshotId.parse(str(doc["name"]))
            if sid is None:
                raise ValueError(f"bad snapshot name {doc['name']!r}")
            files = {}
            for name, entry in dict(doc["files"]).items():
                if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
                    raise ValueError(f"bad file name {name!r}")
                sha = str(entry["sha256"])
                if not re.fullmatch(r"[0-9a-f]{64}", sha):
                    raise ValueError(f"bad checksum for {name}")
                files[name] = FileEntry(int(entry["size"]), sha)
            sharded = doc.get("sharded", False)
            if type(sharded) is not bool:
                raise ValueError(f"bad sharded flag {sharded!r}")
            return cls(sid, str(doc["job"]), str(doc["run_id"]), int(doc["generation"]),
                       int(doc["world_size"]), int(doc["epoch"]), int(doc["step"]), files,
                       sharded)
        except (KeyError, TypeError, AttributeError, UnicodeDecodeError,
                json.JSONDecodeError) as exc:
            raise ValueError(f"malformed manifest: {exc}") from None


def file_entry(path: Path, chunk: int = 1 << 22) -> FileEntry:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return FileEntry(size, h.hexdigest())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path``, all or nothing: a temporary file, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class SnapshotDir:
    """The snapshots of one job under ``root``."""

    def __init__(self, root: str | os.PathLike[str], job: str) -> None:
        if not valid_name(job):
            raise ValueError(f"invalid job name {job!r}")
        self.root = Path(root)
        self.job = job
        self.path = self.root / job

    # --- reading ------------------------------------------------------------------------------

    def names(self) -> list[SnapshotId]:
        """Every snapshot directory (complete or not), oldest first; [] if there is none or
        the directory cannot be read (a permission, a stale NFS handle: said in a warning,
        so that a restart goes on without snapshots rather than failing)."""
        try:
            entries = os.listdir(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            log.warning("cannot list snapshot directory %s (%s): no snapshot of it is used",
                        self.path, exc)
            return []
        return sorted(sid for e in entries if (sid := SnapshotId.parse(e)) is not None)

    def manifest(self, sid: SnapshotId) -> Manifest:
        """The manifest of ``sid`` without checking its files (CorruptSnapshot if torn)."""
        try:
            data = (self.path / sid.name / MANIFEST).read_bytes()
        except OSError as exc:
            raise CorruptSnapshot(f"{sid.name}: no manifest ({exc.strerror}): torn") from None
        try:
            manifest = Manifest.from_json(data)
        except ValueError as exc:
            raise CorruptSnapshot(f"{sid.name}: {exc}") from None
        if manifest.id != sid or manifest.job != self.job:
            raise CorruptSnapshot(f"{sid.name}: manifest is for {manifest.job}/{manifest.id.name}")
        return manifest

    def verify(self, sid: SnapshotId) -> Manifest:
        """The manifest of ``sid`` after checking every file's size and checksum."""
        manifest = self.complete(sid)
        for name, want in manifest.files.items():
            try:
                got = file_entry(self.path / sid.name / name)
            except OSError as exc:
                raise CorruptSnapshot(f"{sid.name}/{name}: {exc.strerror}") from None
            if got != want:
                raise CorruptSnapshot(f"{sid.name}/{name}: size or checksum differs from the "
                                      "manifest")
        return manifest

    def complete(self, sid: SnapshotId) -> Manifest:
        """The manifest of ``sid`` after checking that its files exist with their sizes
        (cheap: no reading; :meth:`verify` checks the contents)."""
        manifest = self.manifest(sid)
        for required in (PLAIN, METADATA):
            if required not in manifest.files:
                raise CorruptSnapshot(f"{sid.name}: manifest lists no {required}")
        for name, want in manifest.files.items():
            try:
                size = os.stat(self.path / sid.name / name).st_size
            except OSError as exc:
                raise CorruptSnapshot(f"{sid.name}/{name}: {exc.strerror}") from None
            if size != want.size:
                raise CorruptSnapshot(f"{sid.name}/{name}: {size} bytes, the manifest says "
                                      f"{want.size}")
        return manifest

    def newest_complete(self, skip: frozenset[SnapshotId] = frozenset(),
                        above: StateVersion | None = None,
                        sharded: bool | None = None) -> Manifest | None:
        """The newest snapshot (not in ``skip``, and holding a version newer than ``above``
        when given) that passes :meth:`complete`; torn ones are skipped with a warning.
        ``sharded`` (when not None) keeps only snapshots of that kind: a state loads only
        the kind it writes."""
        for sid in reversed(self.names()):
            if above is not None and sid.version <= above:
                return None  # the rest are older still
            if sid in skip:
                continue
            try:
                manifest = self.complete(sid)
            except CorruptSnapshot as exc:
                log.warning("skipping snapshot %s: %s", self.path / sid.name, exc)
                continue
            if sharded is None or manifest.sharded == sharded:
                return manifest
        return None

    def newest_valid(self) -> Manifest | None:
        """The newest snapshot whose files match its manifest; torn or corrupt ones are
        skipped with a warning."""
        for sid in reversed(self.names()):
            try:
                return self.verify(sid)
            except CorruptSnapshot as exc:
                log.warning("skipping snapshot %s: %s", self.path / sid.name, exc)
        return None

    def snapshot_path(self, sid: SnapshotId) -> Path:
        return self.path / sid.name

    @contextlib.contextmanager
    def reading(self, sid: SnapshotId) -> Iterator[Callable[[], None]]:
        """While a resume reads ``sid``: a marker that keeps retention (on any host sharing
        the directory) from deleting it. Yields a function that renews the marker (call it
        now and then on long reads: a marker not renewed for an hour is a dead reader's)."""
        marker = self.path / f"{_READING_PREFIX}{sid.name}@{socket.gethostname()}-{os.getpid()}"
        try:
            marker.touch()
        except OSError as exc:
            log.warning("cannot mark snapshot %s as being read (%s)", sid.name, exc)

        def renew() -> None:
            with contextlib.suppress(OSError):
                os.utime(marker)

        try:
            yield renew
        finally:
            with contextlib.suppress(OSError):
                marker.unlink()

    def set_aside(self, sid: SnapshotId, why: str) -> None:
        """Move a snapshot found corrupt out of the way (renamed, never deleted: an operator
        may want to look at it): it no longer counts as a snapshot, for resuming or for
        retention, so a corrupt newest can never be the one snapshot kept."""
        target = self.path / f"{CORRUPT_PREFIX}{sid.name}"
        try:
            os.rename(self.snapshot_path(sid), target)
            log.warning("snapshot %s is corrupt (%s): set aside as %s", sid.name, why, target)
        except OSError as exc:
            log.warning("snapshot %s is corrupt (%s), and could not be set aside: %s",
                        sid.name, why, exc)

    def _being_read(self, now: float) -> set[str]:
        """Names of snapshots some resume is reading (a marker renewed within the hour)."""
        names: set[str] = set()
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.path):
                if not entry.name.startswith(_READING_PREFIX):
                    continue
                try:
                    fresh = now - entry.stat().st_mtime <= _STALE_TMP_S
                except OSError:
                    continue
                if fresh:
                    names.add(entry.name[len(_READING_PREFIX):].split("@", 1)[0])
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        return names

    # --- writing ------------------------------------------------------------------------------

    def temp_dir(self, sid: SnapshotId) -> Path:
        """A fresh, empty temporary directory to write ``sid`` into."""
        tmp = self.path / f"{_TMP_PREFIX}{sid.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def shared_temp_dir(self, sid: SnapshotId) -> Path:
        """The temporary directory every rank of a sharded snapshot writes ``sid`` into: the
        same name on every rank (derived from the agreed id only), created by whichever rank
        comes first and never emptied (another rank may be writing in it already). Left
        behind by a failed write, it is removed by :meth:`prune` once stale."""
        tmp = self.path / f"{_TMP_PREFIX}{sid.name}-shared"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp

    def publish(self, tmp: Path, manifest: Manifest) -> Manifest:
        """Move the written ``tmp`` into place, then give it its manifest (with checksums of
        every file in it). Returns the manifest written."""
        files = {p.name: file_entry(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = dataclasses.replace(manifest, files=files)
        _fsync_dir(tmp)
        final = self.snapshot_path(manifest.id)
        os.rename(tmp, final)
        _fsync_dir(self.path)
        try:
            write_atomic(final / MANIFEST, manifest.to_json())
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            raise
        return manifest

    def prune(self, keep: int, now: float | None = None,
              written: SnapshotId | None = None) -> list[SnapshotId]:
        """Delete all but the ``keep`` newest complete snapshots (in version order: see the
        module docstring), every incomplete one older than the oldest kept, and temporary
        directories of writers long gone. Never deleted: ``written`` (the snapshot just
        written, which is known good: its checksums were computed from the files written)
        and any snapshot a resume is reading. Returns what was deleted (snapshots only)."""
        now = time.time() if now is None else now
        complete: list[SnapshotId] = []
        torn: list[SnapshotId] = []
        for sid in self.names():
            try:
                self.complete(sid)
                complete.append(sid)
            except CorruptSnapshot:
                torn.append(sid)
        kept = set(complete[-keep:] if keep > 0 else complete)
        if written is not None:
            kept.add(written)
        reading = self._being_read(now)
        kept |= {s for s in complete + torn if s.name in reading}
        oldest_kept = min(kept) if kept else None
        doomed = [s for s in complete if s not in kept]
        doomed += [s for s in torn if s not in kept and oldest_kept is not None
                   and s < oldest_kept]
        for sid in doomed:
            shutil.rmtree(self.snapshot_path(sid), ignore_errors=True)
        try:
            for entry in os.scandir(self.path):
                if entry.name.startswith(_TMP_PREFIX) and \
                        now - entry.stat().st_mtime > _STALE_TMP_S:
                    shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            pass
        return sorted(doomed)


def describe(manifest: Manifest) -> dict[str, Any]:
    """A manifest as a small dict (for the CLI and logs)."""
    return {"name": manifest.id.name, "lineage": manifest.id.lineage,
            "commits": manifest.id.commits, "epoch": manifest.epoch,
            "step": manifest.step, "unix": manifest.unix, "bytes": manifest.total_bytes,
            "run_id": manifest.run_id, "world_size": manifest.world_size,
            "sharded": manifest.sharded}
