"""Bounded on-disk spool of transition batches the learner has not acknowledged yet.

Each batch is one file ``<first_seq>-<last_seq>.msg`` holding the wire message exactly as
sent (codec frames, length-prefixed), written to a temporary name, optionally fsynced and
renamed, so a killed actor leaves only whole files. An ack of seq S removes every file whose
records are all <= S. ``meta.json`` keeps the next sequence number and episode id, so a
restarted actor continues numbering where it stopped and resends what is pending.

Removed files are recycled, up to ``spare_bytes``: an acknowledged file is renamed to
``<n>.spare`` (a rename, cheaper than unlinking a few MB of fresh page cache), and
the next append renames a spare to its ``.tmp`` name and overwrites it in place (pages and
blocks already allocated: a fraction of a fresh file's cost). A spare is never a pending
batch (only ``*.msg`` files are); spares left by a killed actor are deleted at start-up.

The in-memory copies (``cache_bytes``) are recycled too: an acknowledged blob's bytearray is
kept (within the same budget) and the next append encodes into it, once nothing else holds
it (a zero-copy send still in flight keeps a reference: then it is let go). Blobs of a few MB
are beyond malloc's mmap threshold, so each new one costs page faults and each freed one an
munmap on the actor's thread.

Dead letters: a batch the learner refused (``batch_rejected``: it consumed the records and
will never store them) is copied to ``dead/`` with a ``.why.json`` naming the reason, counted
(:attr:`Spool.dead_letters`, shown in the actor's status) and otherwise treated as every
batch: deleted from the spool once an ack covers it. ``dead/`` is kept to ``dead_max_bytes``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from data.core.codec import CodecError, encode_to_bytes, frames_from_bytes
from data.core.transitions import TransitionBatch

log = logging.getLogger("tandem.actor.spool")


class SpoolFull(RuntimeError):
    pass


SPARE_SUFFIX = ".spare"
DEAD_DIR = "dead"


class Spool:
    def __init__(self, directory: str | Path, *, max_bytes: int = 512 << 20, fsync: bool = True,
                 cache_bytes: int = 64 << 20, spare_bytes: int = 64 << 20,
                 dead_max_bytes: int = 64 << 20):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        #: dead letters: copies of batches the learner refused (``dead/<first>-<last>.msg`` with
        #: ``.why.json``), kept up to ``dead_max_bytes`` (beyond it the oldest go, counted)
        self.dead_dir = self.dir / DEAD_DIR
        self.dead_max_bytes = int(dead_max_bytes)
        self.dead_letters = len(list(self.dead_dir.glob("*.msg"))) if self.dead_dir.is_dir() else 0
        self.dead_discarded = 0
        self.last_dead: dict | None = None
        self._dead_keys: set[tuple[int, int]] = set()  # dead-lettered by this process
        self.max_bytes = int(max_bytes)
        self.fsync = fsync
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink()  # half-written by a killed actor: never acknowledged, never sent
        for spare in self.dir.glob("*" + SPARE_SUFFIX):
            spare.unlink()
        #: recycled files of acknowledged batches (path, size), reused by append
        self.spare_bytes = int(spare_bytes)
        self._spares: list[tuple[Path, int]] = []
        self._spare_total = 0
        self._spare_seq = 0
        # Blobs appended by this process, kept until acknowledged (up to cache_bytes), so that
        # streaming them does not read back from disk what was just written.
        self.cache_bytes = int(cache_bytes)
        self._cache: dict[tuple[int, int], bytes | bytearray] = {}
        self._cached = 0
        self._free: list[bytearray] = []  # acknowledged blobs' memory, for the next appends
        self._free_bytes = 0
        self._files: dict[tuple[int, int], Path] = {}
        self._sizes: dict[tuple[int, int], int] = {}
        for p in self.dir.glob("*.msg"):
            try:
                first, last = (int(x) for x in p.stem.split("-"))
            except ValueError:
                log.warning("ignoring unexpected spool file %s", p)
                continue
            self._files[(first, last)] = p
            self._sizes[(first, last)] = p.stat().st_size
        self._nbytes = sum(self._sizes.values())
        self._records = sum(last - first + 1 for first, last in self._files)
        meta = self._read_meta()
        top = max((last for _, last in self._files), default=-1)
        self.next_seq = max(int(meta.get("next_seq", 0)), top + 1)
        self.next_episode = int(meta.get("next_episode", 0))
        self.acked = -1  # highest ack seen by this process (the files are the durable record)

    def _read_meta(self) -> dict:
        path = self.dir / "meta.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (json.JSONDecodeError, OSError) as exc:
            log.warning("spool meta unreadable (%s); recovering from file names", exc)
            return {}

    def _write_meta(self) -> None:
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps({"next_seq": self.next_seq, "next_episode": self.next_episode}))
        os.replace(tmp, self.dir / "meta.json")

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def full(self) -> bool:
        return self.nbytes >= self.max_bytes

    def __len__(self) -> int:
        """Number of pending (unacknowledged) records."""
        return self._records

    def pending(self) -> list[tuple[int, int]]:
        return sorted(self._files)

    @property
    def resend_from(self) -> int:
        """Lowest sequence number this actor can still send."""
        pend = self.pending()
        return pend[0][0] if pend else self.next_seq

    def append(self, batch: TransitionBatch) -> None:
        if batch.first_seq != self.next_seq:
            raise ValueError(f"spool expects seq {self.next_seq}, batch starts at {batch.first_seq}")
        if self.full:
            raise SpoolFull(f"spool {self.dir} holds {self.nbytes} bytes >= {self.max_bytes}")
        blob = encode_to_bytes(batch.to_frames(), self._reuse())
        key = (batch.first_seq, batch.last_seq)
        path = self.dir / f"{key[0]:012d}-{key[1]:012d}.msg"
        tmp = path.with_suffix(".tmp")
        with self._open_tmp(tmp) as f:
            f.write(blob)
            f.truncate()  # a recycled file may be longer than this blob
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        self._files[key] = path
        self._sizes[key] = len(blob)
        self._nbytes += len(blob)
        self._records += key[1] - key[0] + 1
        if self._cached + len(blob) <= self.cache_bytes:
            self._cache[key] = blob
            self._cached += len(blob)
        self.next_seq = batch.last_seq + 1
        self._write_meta()

    def _reuse(self) -> bytearray:
        """A recycled blob buffer nothing else references (else a new one)."""
        while self._free:
            buf = self._free.pop()
            self._free_bytes -= len(buf)
            if sys.getrefcount(buf) <= 2:  # this name and the call's argument: no view is alive
                return buf
        return bytearray()

    def _open_tmp(self, tmp: Path):
        """``tmp`` opened for writing: a spare renamed to it when there is one, else new."""
        while self._spares:
            spare, size = self._spares.pop()
            self._spare_total -= size
            try:
                os.replace(spare, tmp)
                return open(tmp, "r+b")
            except OSError:  # gone or unusable: try the next one
                continue
        return open(tmp, "wb")

    def _remove(self, path: Path, size: int) -> None:
        """Drop an acknowledged batch's file: kept as a spare while there is room, else unlinked."""
        if self._spare_total + size <= self.spare_bytes:
            spare = self.dir / f"{self._spare_seq}{SPARE_SUFFIX}"
            self._spare_seq += 1
            try:
                os.replace(path, spare)
            except FileNotFoundError:
                return
            except OSError:
                pass
            else:
                self._spares.append((spare, size))
                self._spare_total += size
                return
        path.unlink(missing_ok=True)

    def read(self, key: tuple[int, int]) -> list:
        blob = self._cache.get(key)
        if blob is None:
            blob = self._files[key].read_bytes()
        try:
            return frames_from_bytes(blob)
        except CodecError as exc:
            raise CodecError(f"spool file {self._files[key]} is corrupt: {exc}") from exc

    def ack(self, seq: int) -> int:
        """Drop batches whose records are all <= seq; returns how many files were removed."""
        if seq <= self.acked:
            return 0
        self.acked = seq
        done = [k for k in self._files if k[1] <= seq]
        for k in done:
            size = self._sizes.pop(k, 0)
            self._remove(self._files.pop(k), size)
            self._nbytes -= size
            self._records -= k[1] - k[0] + 1
            blob = self._cache.pop(k, None)
            if blob is not None:
                self._cached -= len(blob)
                if (type(blob) is bytearray
                        and self._cached + self._free_bytes + len(blob) <= self.cache_bytes):
                    self._free.append(blob)
                    self._free_bytes += len(blob)
        # meta.json is not rewritten per ack (write + rename over the old file: 0.3-10 ms of
        # blocking ext4 metadata work each time): pending = the files; next_seq/next_episode
        # change only in append/set_next_episode, which write it.
        return len(done)

    def dead_letter(self, first: int, last: int, code: str, message: str) -> int:
        """The learner refused the records ``first..last`` (and consumed them): keep a copy of
        each pending batch overlapping them in the dead-letter folder with the reason, once
        (a batch refused again after a resend is not counted twice). The batch itself stays
        pending until an ack covers it, as every batch does, so a restarted learner that never
        saw it gets it again. Returns how many batches were newly dead-lettered."""
        import shutil

        n = 0
        for key in [k for k in self.pending() if k[0] <= last and k[1] >= first]:
            dst = self.dead_dir / self._files[key].name
            if key in self._dead_keys or dst.exists():
                continue
            self._dead_keys.add(key)
            self.dead_dir.mkdir(exist_ok=True)
            blob = self._cache.get(key)
            if blob is not None:
                dst.write_bytes(blob)
            else:
                shutil.copyfile(self._files[key], dst)
            why = {"first_seq": key[0], "last_seq": key[1], "code": code, "message": message}
            dst.with_suffix(".why.json").write_text(json.dumps(why))
            self.dead_letters += 1
            self.last_dead = why
            n += 1
            log.warning("the learner refused batch %d..%d (%s: %s): kept as dead letter %s",
                        key[0], key[1], code, message[:300], dst)
        if n:
            self._trim_dead()
        return n

    def _trim_dead(self) -> None:
        files = sorted(self.dead_dir.glob("*.msg"))
        total = sum(p.stat().st_size for p in files)
        while files and total > self.dead_max_bytes:
            p = files.pop(0)
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
            p.with_suffix(".why.json").unlink(missing_ok=True)
            self.dead_discarded += 1
            log.warning("dead letters over %d bytes: deleted the oldest, %s (%d deleted so far)",
                        self.dead_max_bytes, p.name, self.dead_discarded)

    def set_next_episode(self, episode: int) -> None:
        self.next_episode = episode
        self._write_meta()
