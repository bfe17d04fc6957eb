"""Wire codec: a msgpack header plus numpy buffers as separate zero-copy frames.

A message is ``[header, buf_0, buf_1, ...]`` where ``header`` is a msgpack map::

    {"v": PROTOCOL_VERSION, "type": str, ...fields..., "arrays": [[name, dtype, shape], ...]}

and ``buf_i`` is the raw C-contiguous bytes of array ``i``. Only plain numeric dtypes
(bool, int8..int64, uint8..uint64, float16/32/64) are allowed; strings go in the header.
Nothing is ever unpickled: msgpack decodes to plain Python scalars, lists, dicts, str and
bytes, and arrays are rebuilt with ``np.frombuffer``.

``decode`` checks, in order: total size, frame count, header size, msgpack validity,
protocol version (type-exact: ``1.0`` or ``true`` is not protocol 1), message type, the
type's required header fields (type-exact; with the schema's bounds, as all of Tandem's
messages have: ints within :data:`data.core.schema.FIELD_BOUNDS`, floats finite, lists and
bytes bounded), array metadata (name, dtype allow-list, shape: at most ``MAX_NDIM`` dims of at
most ``MAX_DIM`` each, a size claim within ``max_bytes``) and that each buffer's length
equals ``prod(shape) * itemsize``, all before numpy sees a shape. Any failure raises
:class:`CodecError` (:class:`FieldRangeError` for a number out of bounds) with a message that
names what is wrong; the caller replies with an error and keeps serving.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np
from msgpack import unpackb as _unpackb

_isfinite = math.isfinite


def _check_unpackb_defaults() -> None:
    """decode() calls unpackb without arguments: its defaults must be raw=False (str keys and
    values), strict_map_key=True (str/bytes map keys only) and use_list=True."""
    try:
        _unpackb(b"\x81\x01\x02")  # {1: 2}: an int map key
    except ValueError:
        pass
    else:  # pragma: no cover - msgpack < 1.0
        raise ImportError("msgpack >= 1.0 is required (strict_map_key must default to True)")
    if _unpackb(b"\x91\xa1s") != ["s"]:  # ["s"]: a list of str
        raise ImportError("msgpack >= 1.0 is required (raw=False, use_list=True by default)")


_check_unpackb_defaults()

from data.core.schema import (INT64_BOUNDS, MAX_BYTES_FIELD, MAX_LIST_LEN, MESSAGE_SCHEMAS,  # noqa: E402
                              PROTOCOL_VERSION, MessageSchema)

ALLOWED_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"]
)

# dtype -> wire name, and back. numpy 2's ``dtype.name`` is a slow Python-level property.
_DTYPE_NAME = {np.dtype(n): n for n in ALLOWED_DTYPES}
_NAME_DTYPE = {n: np.dtype(n) for n in ALLOWED_DTYPES}

_RESERVED = frozenset(("v", "type", "arrays"))  # header keys the codec writes itself

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_HEADER_BYTES = 1024 * 1024
MAX_ARRAYS = 4096
MAX_NDIM = 8
#: the largest single dimension of an array on the wire (numpy refuses far larger claims)
MAX_DIM = 2**31 - 1
#: arrays up to this size are encoded as bytes (a copy), larger ones as zero-copy views
SMALL_ARRAY_BYTES = 4096


class CodecError(ValueError):
    """A message that cannot be encoded or was rejected on decode."""


class FieldRangeError(CodecError):
    """A well-formed message whose header number is out of its bounds (or not finite)."""


@dataclass
class Message:
    """A decoded message: its type, header fields and named arrays (read-only views)."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    #: the codec's cached (checked) array layout this message was decoded with, the same
    #: object for every message of that layout (None when not cached): lets a receiver
    #: check a layout's structure once (:func:`learner.wire_guard.check_act_obs`)
    layout: Any = field(default=None, repr=False, compare=False)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def encode(
    msg_type: str,
    fields: Mapping[str, Any] | None = None,
    arrays: Mapping[str, np.ndarray] | None = None,
    *,
    schemas: Mapping[str, MessageSchema] = MESSAGE_SCHEMAS,
) -> list[Any]:
    """Encode a message into frames ``[header_bytes, buffer, ...]`` without copying arrays
    (but those of at most :data:`SMALL_ARRAY_BYTES`, which become bytes).

    Raises CodecError for an unknown type, a reserved field name or a disallowed dtype.
    """
    if msg_type not in schemas:
        raise CodecError(f"unknown message type {msg_type!r}")
    if fields:
        if not _RESERVED.isdisjoint(fields):
            key = next(k for k in fields if k in _RESERVED)
            raise CodecError(f"field name {key!r} is reserved")
        header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg_type, **fields}
    else:
        header = {"v": PROTOCOL_VERSION, "type": msg_type}
    meta = []
    frames: list[Any] = [None]
    if arrays:
        dtype_names = _DTYPE_NAME
        for name, arr in arrays.items():
            if type(arr) is not np.ndarray:
                arr = np.asarray(arr)
            dtype_name = dtype_names.get(arr.dtype)
            if dtype_name is None:
                raise CodecError(f"array {name!r}: dtype {arr.dtype} is not allowed on the wire")
            meta.append([name, dtype_name, list(arr.shape)])
            if arr.nbytes <= SMALL_ARRAY_BYTES:
                # one call instead of a contiguous view chain; ZMQ copies frames this small anyway
                frames.append(arr.tobytes())
            elif arr.flags.c_contiguous:
                frames.append(memoryview(arr).cast("B"))  # a flat byte view, no copy
            else:
                frames.append(memoryview(np.ascontiguousarray(arr)).cast("B"))
    header["arrays"] = meta
    try:
        frames[0] = _packer().pack(header)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"header of {msg_type!r} is not msgpack-serialisable: {exc}") from exc
    return frames


_local = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's msgpack Packer (building one per message costs more than the packing;
    a Packer resets itself after each ``pack``, also after one that raised)."""
    try:
        return _local.packer
    except AttributeError:
        p = _local.packer = msgpack.Packer(use_bin_type=True)
        return p


def _frame_bytes(frame: Any) -> memoryview:
    # zmq.Frame exposes .buffer (a memoryview); bytes / memoryview pass through.
    buf = getattr(frame, "buffer", frame)
    return buf if type(buf) is memoryview else memoryview(buf)


#: validated array metadata -> [(name, dtype, shape tuple, nbytes)]: actors send the same
#: layout message after message, so the per-array checks run once per layout (bounded)
_META_CACHE: dict[tuple, list[tuple[str, np.dtype, tuple[int, ...], int]]] = {}
_META_CACHE_MAX = 256

_MISSING = object()
#: id(schema) -> [schema, ((field, type, lo, hi), ...), last layout]: a schema's field checks,
#: prepared once (lo/hi: an int field's bounds, the length limit of a list or bytes field as
#: hi; lo None when the schema has no bounds, which leaves everything to ``_check_field``),
#: and the (max_bytes, array metadata, layout) of its last message with a cached layout
_PLANS: dict[int, list] = {}


def _plan(schema: MessageSchema) -> list:
    bounds = schema.bounds
    steps = []
    for key, typ in schema.fields.items():
        if bounds is None:
            lo = hi = None
        elif typ is int:
            lo, hi = bounds.get(key, INT64_BOUNDS)
        else:
            lo, hi = 0, MAX_LIST_LEN if typ is list else MAX_BYTES_FIELD
        steps.append((key, typ, lo, hi))
    plan = [schema, tuple(steps), None]
    if len(_PLANS) > 256:
        _PLANS.clear()
    _PLANS[id(schema)] = plan
    return plan


def decode(
    frames: Sequence[Any],
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    schemas: Mapping[str, MessageSchema] = MESSAGE_SCHEMAS,
) -> Message:
    """Decode and validate frames produced by :func:`encode`. Raises CodecError.

    ``schemas`` lets another protocol on the same codec (the robot driver) name its own
    message types.
    """
    nframes = len(frames)
    if nframes == 0:
        raise CodecError("empty message")
    if nframes > MAX_ARRAYS + 1:
        raise CodecError(f"too many frames: {nframes} > {MAX_ARRAYS + 1}")
    # every frame type in use (bytes, memoryview, bytearray, zmq.Frame) has the buffer protocol
    views = [memoryview(f) for f in frames]
    total = sum([v.nbytes for v in views])
    if total > max_bytes:
        raise CodecError(f"message of {total} bytes exceeds the limit of {max_bytes} bytes")
    head = views[0]
    if head.nbytes > max_header_bytes:
        raise CodecError(f"header of {head.nbytes} bytes exceeds the limit of {max_header_bytes}")
    try:
        # msgpack >= 1.0's defaults: raw=False, strict_map_key=True, use_list=True (checked at
        # import); passing them costs a microsecond of keyword parsing per message
        header = _unpackb(head)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CodecError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    if type(header) is not dict:
        raise CodecError("header is not a map")
    pop = header.pop
    version = pop("v", None)
    # type-exact: 1.0 and true compare equal to 1 in Python but are not protocol 1
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise CodecError(
            f"protocol version mismatch: message has {version!r}, this side speaks {PROTOCOL_VERSION}"
        )
    msg_type = pop("type", None)
    schema = schemas.get(msg_type) if type(msg_type) is str else None
    if schema is None:
        raise CodecError(f"unknown message type {msg_type!r}")
    plan = _PLANS.get(id(schema))
    if plan is None or plan[0] is not schema:
        plan = _plan(schema)
    get = header.get
    for key, typ, lo, hi in plan[1]:
        value = get(key, _MISSING)
        # the common case inline (exact type, within bounds); anything else is named below
        if type(value) is typ and lo is not None:  # (lo None: a schema without bounds)
            if typ is int:
                if lo <= value <= hi:
                    continue
            elif typ is float:
                if _isfinite(value):
                    continue
            elif typ is list or typ is bytes:
                if len(value) <= hi:
                    continue
            else:
                continue
        if value is _MISSING:
            raise CodecError(f"{msg_type}: missing field {key!r}")
        _check_field(msg_type, key, typ, value, schema.bounds)
    meta = pop("arrays", [])
    if type(meta) is not list or len(meta) != nframes - 1:
        raise CodecError(
            f"{msg_type}: array metadata lists {len(meta) if isinstance(meta, list) else '?'} "
            f"arrays but the message has {nframes - 1} buffers"
        )
    last = plan[2]  # this type's last cached layout: (max_bytes, metadata, layout)
    if not _meta_exact(meta):  # before any cache: 4.0 == 4 and True == 1 would hit it
        layout = _check_layout(msg_type, meta, max_bytes)  # raises, naming the entry
        cached = None
    elif last is not None and last[1] == meta and last[0] == max_bytes:
        layout = cached = last[2]  # (list equality: no key to build and hash)
    else:
        try:
            key = (max_bytes, tuple([(e[0], e[1], tuple(e[2])) for e in meta]))
            layout = cached = _META_CACHE.get(key)
        except Exception:  # malformed metadata (not hashable, too short): the checks name it
            key, layout, cached = None, None, None
        if layout is None:
            layout = _check_layout(msg_type, meta, max_bytes)
            # bounded: at most _META_CACHE_MAX layouts of at most 64 arrays with short names
            if (key is not None and len(_META_CACHE) < _META_CACHE_MAX and len(layout) <= 64
                    and sum([len(e[0]) for e in layout]) <= 4096):
                _META_CACHE[key] = cached = layout
        if cached is not None:
            plan[2] = (max_bytes, meta, cached)
    arrays: dict[str, np.ndarray] = {}
    ndarray = np.ndarray  # a view of the buffer (np.frombuffer(...).reshape(...) in one call)
    i = 0
    for name, dtype, shape, expected in layout:
        i += 1
        buf = views[i]
        if buf.nbytes != expected:
            raise CodecError(
                f"{msg_type}: array {name!r} {_DTYPE_NAME[dtype]}{shape} needs {expected} bytes, "
                f"buffer has {buf.nbytes}"
            )
        arrays[name] = ndarray(shape, dtype, buf)
    for a in schema.arrays:
        if a not in arrays:
            raise CodecError(f"{msg_type}: missing arrays {[a for a in schema.arrays if a not in arrays]}")
    return Message(msg_type, header, arrays, cached)


def _meta_exact(meta: list) -> bool:
    """Every metadata entry is exactly ``[str, str, [int, ...]]``: no float or bool dims, no
    extra items. Checked before the layout caches are consulted (their keys compare 4.0 and
    True equal to 4 and 1, and ignore items past the third)."""
    for e in meta:
        if type(e) is not list or len(e) != 3:
            return False
        name, dtype_name, shape = e
        if type(name) is not str or type(dtype_name) is not str or type(shape) is not list:
            return False
        for d in shape:
            if type(d) is not int:
                return False
    return True


def _check_layout(msg_type: str, meta: list, max_bytes: int) -> list[tuple[str, np.dtype, tuple[int, ...], int]]:
    """Every array's metadata checked (name, dtype, shape, size claim, no duplicates)."""
    out = []
    names: set[str] = set()
    for i, entry in enumerate(meta):
        name, dtype_name, shape = _check_meta(msg_type, i, entry)
        dtype = _NAME_DTYPE[dtype_name]
        # the size claim is checked before numpy sees the shape
        nonzero = math.prod(d for d in shape if d)
        if nonzero * dtype.itemsize > max_bytes:
            raise CodecError(f"{msg_type}: array {name!r} claims shape {tuple(shape)}, over the "
                             f"limit of {max_bytes} bytes")
        if name in names:
            raise CodecError(f"{msg_type}: duplicate array name {name!r}")
        names.add(name)
        out.append((name, dtype, tuple(shape), math.prod(shape) * dtype.itemsize))
    return out


def _check_field(msg_type: str, key: str, typ: type, value: Any,
                 bounds: Mapping[str, tuple[int, int]] | None) -> None:
    """Type-exact check of a required header field; with ``bounds`` (the schema's), also
    bounds for ints, finiteness for floats and a length limit for lists."""
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise CodecError(f"{msg_type}: field {key!r} must be {getattr(typ, '__name__', typ)}, "
                         f"got {type(value).__name__}")
    if bounds is None:
        return
    if typ is int:
        lo, hi = bounds.get(key, INT64_BOUNDS)
        if not lo <= value <= hi:
            raise FieldRangeError(f"{msg_type}: field {key!r} = {value} is out of range [{lo}, {hi}]")
    elif typ is float and not math.isfinite(value):
        raise FieldRangeError(f"{msg_type}: field {key!r} must be finite, got {value!r}")
    elif typ is list and len(value) > MAX_LIST_LEN:
        raise CodecError(f"{msg_type}: field {key!r} has {len(value)} items, over {MAX_LIST_LEN}")
    elif typ is bytes and len(value) > MAX_BYTES_FIELD:
        raise CodecError(f"{msg_type}: field {key!r} has {len(value)} bytes, over {MAX_BYTES_FIELD}")


def _check_meta(msg_type: str, i: int, entry: Any) -> tuple[str, str, list[int]]:
    if not (isinstance(entry, list) and len(entry) == 3):
        raise CodecError(f"{msg_type}: array metadata #{i} must be [name, dtype, shape]")
    name, dtype_name, shape = entry
    if not isinstance(name, str) or not name:
        raise CodecError(f"{msg_type}: array #{i} has no name")
    if dtype_name not in ALLOWED_DTYPES:
        raise CodecError(f"{msg_type}: array {name!r} has disallowed dtype {dtype_name!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM
                   for d in shape)
    ):
        raise CodecError(f"{msg_type}: array {name!r} has an invalid shape {shape!r}")
    return name, dtype_name, shape


def encode_to_bytes(frames: Sequence[Any], out: bytearray | None = None) -> bytes | bytearray:
    """Length-prefixed concatenation of frames, for storing a message on disk (spool).

    ``out``: a bytearray to write it into (resized to fit; it must have no exported
    buffers; an empty one is replaced by a new one of the right size), returned; without
    one, a new bytes object."""
    views = [_frame_bytes(f) for f in frames]
    if out is None:
        parts: list[Any] = [len(frames).to_bytes(4, "little")]
        for mv in views:
            parts.append(mv.nbytes.to_bytes(8, "little"))
            parts.append(mv)
        return b"".join(parts)  # one copy of the payload (a growing bytearray copied it twice)
    total = 4 + sum([8 + mv.nbytes for mv in views])
    if len(out) > total:
        del out[total:]
    elif not out:
        out = bytearray(total)
    elif len(out) < total:
        out.extend(bytes(total - len(out)))
    with memoryview(out) as dst:
        dst[:4] = len(frames).to_bytes(4, "little")
        pos = 4
        for mv in views:
            n = mv.nbytes
            dst[pos:pos + 8] = n.to_bytes(8, "little")
            dst[pos + 8:pos + 8 + n] = mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
            pos += 8 + n
    return out


def frames_from_bytes(blob: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[memoryview]:
    """Inverse of :func:`encode_to_bytes`; raises CodecError on a truncated or corrupt blob."""
    mv = memoryview(blob)
    if mv.nbytes < 4:
        raise CodecError("stored message is truncated")
    n = int.from_bytes(mv[:4], "little")
    if n > MAX_ARRAYS + 1:
        raise CodecError(f"stored message claims {n} frames")
    pos, frames = 4, []
    for _ in range(n):
        if pos + 8 > mv.nbytes:
            raise CodecError("stored message is truncated")
        size = int.from_bytes(mv[pos:pos + 8], "little")
        pos += 8
        if size > max_bytes or pos + size > mv.nbytes:
            raise CodecError("stored message is truncated")
        frames.append(mv[pos:pos + size])
        pos += size
    if pos != mv.nbytes:
        raise CodecError("stored message has trailing bytes")
    return frames


# ---- frames on a ZMQ socket (passed in; the codec opens none) -------------------------------
# pyzmq's send_multipart/recv_multipart combine flags through Python-level enum code
# (``zmq.SNDMORE | flags``) and check every part's type: several microseconds per message on
# the act path. These take plain ints (libzmq's values) and do no more than the frames need.
_SNDMORE, _RCVMORE = 2, 13  # ZMQ_SNDMORE, ZMQ_RCVMORE


def send_frames(sock: Any, frames: Sequence[Any], flags: int = 0, *, copy: bool = False) -> None:
    """Send ``frames`` (bytes, memoryviews, zmq Frames) as one multipart message; with
    ``copy=False`` frames under the socket's ``copy_threshold`` are still copied (pyzmq)."""
    send = sock.send
    last = len(frames) - 1
    if last < 0:
        raise ValueError("a message needs at least one frame")
    for i, f in enumerate(frames):
        send(f, flags | _SNDMORE if i < last else flags, copy=copy)


def recv_frames(sock: Any, flags: int = 0, *, copy: bool = True) -> list[Any]:
    """Receive one multipart message (bytes with ``copy``, else zmq Frames). Without ``copy``
    each Frame says whether more parts follow (``Frame.more``, filled in by the receive):
    pyzmq's ``getsockopt`` turns every option into an enum first, microseconds per part."""
    recv = sock.recv
    if copy:
        parts = [recv(flags)]
        more = sock.getsockopt
        while more(_RCVMORE):
            parts.append(recv(flags))
        return parts
    frame = recv(flags, copy=False)
    parts = [frame]
    while frame.more:
        frame = recv(flags, copy=False)
        parts.append(frame)
    return parts
