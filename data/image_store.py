"""Per-slot camera-frame stores of the replay ring (:mod:`data.replay`).

``raw`` (default) keeps uint8 arrays: the fastest sampling, 1/8 of the memory of float32
images stored twice (lerobot's RL buffer) plus one final frame per episode. ``lz4`` (needs
the ``lz4`` package; ``auto`` picks it when installed) and ``zlib`` keep each frame as a
lossless blob (vertical-delta filter + codec): simulator renders shrink 10-40x, noisy camera
images 1.0-1.8x; decoding costs ~60 us (lz4) or ~300 us (zlib) per 128x128 frame at sample
time. Frames that do not compress are kept as they are (lz4: those its fast pass cannot
shrink by 5%, without trying its far slower high-compression mode).

A store is either eager (``lazy = False``: ``put`` / ``get`` arrays under the buffer's lock)
or lazy (``lazy = True``: ``encode`` and ``decode`` run outside the lock, only ``put`` and
``refs`` take it).
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

IMAGE_CODECS = ("raw", "lz4", "zlib", "auto")


class RawImages:
    """uint8 [C, H, W, 3]; gathered under the buffer's lock."""

    lazy = False

    def __init__(self, capacity: int, shape: tuple[int, int, int]):
        self.shape = tuple(shape)
        self.data = np.zeros((capacity, *shape), dtype=np.uint8)

    def put(self, slots, arr: np.ndarray) -> None:
        self.data[slots] = arr

    def get(self, slots: np.ndarray, out: np.ndarray) -> None:
        np.take(self.data, slots, axis=0, out=out)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def close(self) -> None:
        pass


def _up_filter(img: np.ndarray) -> np.ndarray:
    """Vertical delta (PNG's "up" filter): smooth images become mostly small values."""
    d = np.array(img, dtype=np.uint8, copy=True)
    d[1:] -= img[:-1]
    return d


class BlobImages:
    """One lossless blob per slot (vertical-delta filter + a byte codec), decoded outside the
    buffer's lock in a small thread pool (the codecs and numpy release the GIL)."""

    lazy = True
    _OBJ_OVERHEAD = 33 + 8  # bytes object header + list pointer

    def __init__(self, capacity: int, shape: tuple[int, int, int], threads: int):
        self.shape = tuple(shape)
        self.raw_size = int(np.prod(shape))
        self.blobs: list[bytes | None] = [None] * capacity
        self._size = 0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="replay-decode") \
            if threads > 1 else None
        self._zero = self.encode(np.zeros(self.shape, np.uint8))

    def encode(self, img: np.ndarray) -> bytes:
        raise NotImplementedError

    def _inflate(self, blob: bytes) -> bytes:
        raise NotImplementedError

    def decode_into(self, blob: bytes, out: np.ndarray) -> None:
        if len(blob) == self.raw_size + 1 and blob[-1:] == b"R":  # stored uncompressed
            out[...] = np.frombuffer(blob, np.uint8, self.raw_size).reshape(self.shape)
            return
        d = np.frombuffer(self._inflate(blob), np.uint8).reshape(self.shape)
        np.cumsum(d, axis=0, dtype=np.uint8, out=out)

    def put(self, slots, blobs: list[bytes]) -> None:
        """Store blobs made by :meth:`encode` (outside the buffer's lock)."""
        slot_list = range(slots.start, slots.stop) if isinstance(slots, slice) else slots.tolist()
        for s, new in zip(slot_list, blobs):
            old = self.blobs[s]
            self._size += len(new) - (len(old) if old is not None else 0)
            self.blobs[s] = new

    def refs(self, slots: np.ndarray) -> list[bytes]:
        b = self.blobs
        return [b[s] if b[s] is not None else self._zero for s in slots]

    def decode(self, refs: list[bytes], out: np.ndarray) -> None:
        if self._pool is None or len(refs) < 16:
            for i, blob in enumerate(refs):
                self.decode_into(blob, out[i])
            return
        parts = np.array_split(np.arange(len(refs)), self._pool._max_workers)

        def run(ix):
            for i in ix:
                self.decode_into(refs[i], out[i])

        list(self._pool.map(run, parts))

    @property
    def nbytes(self) -> int:
        n = sum(1 for b in self.blobs if b is not None)
        return self._size + n * self._OBJ_OVERHEAD + len(self.blobs) * 8

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class ZlibImages(BlobImages):
    """zlib level 1: the smallest, decoding ~5x slower than lz4."""

    def encode(self, img: np.ndarray) -> bytes:
        return zlib.compress(_up_filter(img), 1)

    def _inflate(self, blob: bytes) -> bytes:
        return zlib.decompress(blob)


class Lz4Images(BlobImages):
    """lz4 (fast mode, then high-compression mode if that saves little); a frame that does
    not compress is kept uncompressed (tagged), so it costs a copy to read, no decoding."""

    def __init__(self, capacity: int, shape: tuple[int, int, int], threads: int):
        import lz4.block

        self._lz4 = lz4.block
        super().__init__(capacity, shape, threads)

    def encode(self, img: np.ndarray) -> bytes:
        d = _up_filter(img).tobytes()
        blob = self._lz4.compress(d, store_size=True)
        # high compression only where the fast pass found something but saved little: on a
        # frame it cannot shrink at all (a camera's sensor noise) it costs ~50x the fast pass
        # (5-6 ms per 224x224 frame on the socket thread: ~80 camera records/s in all) for
        # ~20% (image_codec=zlib: ~40% at half that cost, slower sampling)
        if 0.8 * self.raw_size < len(blob) <= 0.95 * self.raw_size:
            blob = min(blob, self._lz4.compress(d, mode="high_compression", compression=3,
                                                store_size=True), key=len)
        if len(blob) > 0.95 * self.raw_size:
            return np.ascontiguousarray(img, np.uint8).tobytes() + b"R"
        return blob

    def _inflate(self, blob: bytes) -> bytes:
        return self._lz4.decompress(blob)


def resolve_codec(codec: str) -> str:
    """``auto``: lz4 when the ``lz4`` package is installed, else raw."""
    if codec not in IMAGE_CODECS:
        raise ValueError(f"image_codec must be one of {IMAGE_CODECS}, got {codec!r}")
    if codec != "auto":
        return codec
    try:
        import lz4.block  # noqa: F401
    except ImportError:
        return "raw"
    return "lz4"


def make_image_store(codec: str, capacity: int, shape: tuple[int, int, int], *,
                     threads: int = 2) -> RawImages | BlobImages:
    """The store of one camera for a resolved codec (``raw``, ``lz4`` or ``zlib``)."""
    if codec == "raw":
        return RawImages(capacity, shape)
    cls = {"lz4": Lz4Images, "zlib": ZlibImages}.get(codec)
    if cls is None:
        raise ValueError(f"unknown image codec {codec!r} (resolve 'auto' first)")
    return cls(capacity, shape, threads)
