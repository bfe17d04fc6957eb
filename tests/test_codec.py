import pickle

import msgpack
import numpy as np
import pytest

from data.core.codec import CodecError, decode, encode, encode_to_bytes, frames_from_bytes
from data.core.schema import PROTOCOL_VERSION


def _act_arrays():
    return {
        "observation.state": np.arange(6, dtype=np.float32).reshape(1, 6),
        "observation.images.front": np.random.default_rng(0).integers(0, 255, (1, 224, 224, 3), dtype=np.uint8),
    }


def test_round_trip_keeps_values_dtypes_and_is_zero_copy():
    arrays = _act_arrays()
    arrays["observation.state"] = arrays["observation.state"].astype(np.float32)
    frames = encode("act", {"req_id": 7, "deterministic": False, "tasks": ["pick the cube"]}, arrays)
    # the image buffer is sent as a view, not a copy
    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.uint8), arrays["observation.images.front"])
    msg = decode([bytes(f) for f in frames])
    assert msg.type == "act" and msg["req_id"] == 7 and msg["tasks"] == ["pick the cube"]
    for k, v in arrays.items():
        assert msg.arrays[k].dtype == v.dtype and msg.arrays[k].shape == v.shape
        np.testing.assert_array_equal(msg.arrays[k], v)


@pytest.mark.parametrize("dtype", ["bool", "int8", "int64", "uint16", "float16", "float64"])
def test_round_trip_dtypes_and_empty(dtype):
    a = (np.arange(12) % 2).astype(dtype).reshape(3, 4)
    empty = np.zeros((0, 5), dtype=dtype)
    msg = decode(encode("weights", {"policy_version": 3}, {"a": a, "e": empty}))
    np.testing.assert_array_equal(msg.arrays["a"], a)
    assert msg.arrays["e"].shape == (0, 5)


def test_non_contiguous_input_is_encoded_correctly():
    a = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    msg = decode(encode("weights", {"policy_version": 1}, {"a": a}))
    np.testing.assert_array_equal(msg.arrays["a"], a)


def test_encode_refuses_object_arrays_and_unknown_types():
    with pytest.raises(CodecError, match="dtype object"):
        encode("weights", {"policy_version": 1}, {"a": np.array([{"x": 1}], dtype=object)})
    with pytest.raises(CodecError, match="unknown message type"):
        encode("exec_this", {})


def _header(**over):
    h = {"v": PROTOCOL_VERSION, "type": "ping", "t": 1.0, "arrays": []}
    h.update(over)
    return msgpack.packb(h)


@pytest.mark.parametrize(
    "frames,match",
    [
        ([], "empty message"),
        ([b"\xc1\xff\x00garbage"], "not valid msgpack"),
        ([msgpack.packb([1, 2, 3])], "not a map"),
        ([_header(v=PROTOCOL_VERSION + 1)], "protocol version mismatch"),
        ([_header(type="run_shell")], "unknown message type"),
        ([_header(t="soon")], "field 't' must be float"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "ping", "arrays": []})], "missing field 't'"),
        ([_header(arrays=[["x", "float32", [2]]])], "lists 1 arrays but the message has 0"),
        ([_header(arrays=[["x", "object", [1]]]), b"\x00" * 8], "disallowed dtype 'object'"),
        ([_header(arrays=[["x", "float32", [3]]]), b"\x00" * 8], "needs 12 bytes, buffer has 8"),
        ([_header(arrays=[["x", "float32", [-1]]]), b""], "invalid shape"),
        ([_header(arrays=[["x", "uint8", [2]], ["x", "uint8", [2]]]), b"ab", b"cd"], "duplicate array"),
    ],
)
def test_decode_rejects_bad_frames_with_a_named_reason(frames, match):
    with pytest.raises(CodecError, match=match):
        decode(frames)


def test_pickle_payload_is_rejected_not_executed():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pickle executed')",))

    with pytest.raises(CodecError):
        decode([pickle.dumps(Boom())])


def test_size_limits():
    big = np.zeros(1000, dtype=np.uint8)
    frames = encode("weights", {"policy_version": 1}, {"a": big})
    with pytest.raises(CodecError, match="exceeds the limit of 500 bytes"):
        decode(frames, max_bytes=500)
    with pytest.raises(CodecError, match="header of"):
        decode(frames, max_header_bytes=10)
    decode(frames, max_bytes=2000)


def test_missing_required_array():
    frames = encode("act", {"req_id": 1, "deterministic": True, "tasks": [""]}, {})
    with pytest.raises(CodecError, match="missing arrays"):
        decode(frames)


def test_spool_blob_round_trip_and_truncation():
    frames = encode("weights", {"policy_version": 2}, {"w": np.ones((2, 3), np.float32)})
    blob = encode_to_bytes(frames)
    msg = decode(frames_from_bytes(blob))
    np.testing.assert_array_equal(msg.arrays["w"], np.ones((2, 3), np.float32))
    with pytest.raises(CodecError, match="truncated"):
        frames_from_bytes(blob[:-3])
    with pytest.raises(CodecError, match="trailing"):
        frames_from_bytes(blob + b"x")


def test_a_cached_layout_still_checks_every_buffer_and_limit():
    import numpy as np

    frames = encode("act", {"req_id": 1, "deterministic": False, "tasks": [""]},
                    {"observation.state": np.zeros((1, 4), np.float32)})
    decode(frames)  # the layout is now cached
    short = [frames[0], bytes(memoryview(frames[1]))[:-4]]
    with pytest.raises(CodecError, match="needs 16 bytes"):
        decode(short)
    big = encode("act", {"req_id": 2, "deterministic": False, "tasks": [""]},
                 {"observation.state": np.zeros((1, 0, 1 << 20), np.float32)})
    decode(big, max_bytes=64 << 20)
    with pytest.raises(CodecError, match="over the limit"):
        decode(big, max_bytes=1 << 20)  # the size claim is checked per limit


def test_encode_to_bytes_into_a_reused_buffer():
    import numpy as np

    frames = encode("ping", {"t": 1.0}, {"a": np.arange(600, dtype=np.float32).reshape(20, 30)})
    blob = encode_to_bytes(frames)
    for buf in (bytearray(), bytearray(5), bytearray(len(blob) + 100)):
        out = encode_to_bytes(frames, buf)
        assert bytes(out) == blob and isinstance(out, bytearray)
        assert [bytes(f) for f in frames_from_bytes(out)] == [bytes(memoryview(f)) for f in frames]


def test_a_cached_layout_does_not_let_inexact_shape_entries_through():
    """Shape entries 4.0 / True and extra items in an array entry are refused also once the
    layout they resemble is cached (the caches compare 4.0 == 4 and ignore a fourth item)."""
    import msgpack
    import numpy as np

    state = np.zeros((1, 4), np.float32)
    frames = encode("act", {"req_id": 1, "deterministic": False, "tasks": [""]},
                    {"observation.state": state})
    for _ in range(2):
        decode(frames)  # cached twice over: the type's last layout and the layout cache
    header = msgpack.unpackb(frames[0])
    for entry in (["observation.state", "float32", [1, 4.0]], ["observation.state", "float32", [True, 4]],
                  ["observation.state", "float32", [1, 4], "extra"]):
        bad = [msgpack.packb(dict(header, arrays=[entry]), use_bin_type=True), state.tobytes()]
        with pytest.raises(CodecError, match="observation.state|metadata #0"):
            decode(bad)
    assert decode(frames).arrays["observation.state"].shape == (1, 4)  # the real layout still decodes
