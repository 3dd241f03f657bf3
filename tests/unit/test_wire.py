from __future__ import annotations

import json

import pytest

from pytest_forkd.guest import wire


def encode(fields: dict, payload: bytes = b"") -> bytes:
    return wire.encode_header(fields, len(payload)) + payload


def reader_over(data: bytes, read_size: int | None = None) -> wire.FrameReader:
    """A reader over fixed bytes; ``read_size`` caps every read to exercise partial reads."""
    position = 0

    def read(size: int) -> bytes:
        nonlocal position
        size = min(size, read_size or size)
        chunk = data[position : position + size]
        position += len(chunk)
        return chunk

    return wire.FrameReader(read)


def test_frame_round_trip_keeps_binary_payload_intact() -> None:
    payload = bytes(range(256)) * 3
    reader = reader_over(encode({"id": 7, "op": "x", "text": "é"}, payload))

    frame = reader.read_frame()

    assert frame.fields == {"id": 7, "op": "x", "text": "é"}
    assert frame.payload == payload
    assert reader.read_frame() is None


def test_header_layout_is_magic_then_lengths() -> None:
    header = wire.encode_header({"id": 1}, 5)

    magic, json_length, payload_length = wire.HEADER.unpack_from(header)

    assert (magic, payload_length) == (wire.MAGIC, 5)
    assert json.loads(header[wire.HEADER.size :]) == {"id": 1}
    assert json_length == len(header) - wire.HEADER.size


def test_reader_assembles_frames_from_one_byte_reads() -> None:
    stream = encode({"id": 1}, b"abc") + encode({"id": 2}) + encode({"id": 3}, b"z" * 1000)
    reader = reader_over(stream, read_size=1)

    frames = [reader.read_frame() for _ in range(3)]

    assert [(f.fields["id"], f.payload) for f in frames] == [(1, b"abc"), (2, b""), (3, b"z" * 1000)]
    assert reader.read_frame() is None


def test_message_frames_split_large_payload_into_chunks() -> None:
    payload = bytes(range(256)) * (wire.CHUNK_SIZE // 256 * 2 + 3)

    frames = list(wire.message_frames({"id": 9, "op": "write_file", "path": "/x"}, payload))

    assert len(frames) == 3
    assert frames[0][0] == {"id": 9, "op": "write_file", "path": "/x", "more": True}
    assert frames[1][0] == {"id": 9, "more": True}
    assert frames[2][0] == {"id": 9, "more": False}
    assert all(len(chunk) <= wire.CHUNK_SIZE for _, chunk in frames)
    assert b"".join(bytes(chunk) for _, chunk in frames) == payload


def test_message_that_fits_in_one_frame_has_no_more_flag() -> None:
    frames = list(wire.message_frames({"id": 1, "op": "ping"}))

    assert [(fields, bytes(chunk)) for fields, chunk in frames] == [({"id": 1, "op": "ping"}, b"")]


def test_reader_skips_garbage_and_resynchronises() -> None:
    stream = b"\x00garbage FKD" + encode({"id": 1}, b"ok") + encode({"id": 2})
    reader = reader_over(stream, read_size=5)

    with pytest.raises(wire.MalformedFrame, match="skipped 12 bytes"):
        reader.read_frame()

    assert reader.read_frame().fields == {"id": 1}
    assert reader.read_frame().fields == {"id": 2}


def test_reader_rejects_header_with_absurd_lengths() -> None:
    bogus = wire.HEADER.pack(wire.MAGIC, 10, wire.MAX_PAYLOAD_SIZE + 1)
    reader = reader_over(bogus + encode({"id": 5}))

    with pytest.raises(wire.MalformedFrame, match="skipped"):
        reader.read_frame()

    assert reader.read_frame().fields == {"id": 5}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "unreadable"),
        (b"[1, 2]", "integer id"),
        (b'{"id": "7"}', "integer id"),
        (b'{"id": true}', "integer id"),
    ],
)
def test_reader_drops_frames_with_bad_json_and_continues(body: bytes, reason: str) -> None:
    bad = wire.HEADER.pack(wire.MAGIC, len(body), 3) + body + b"pay"
    reader = reader_over(bad + encode({"id": 8}, b"next"))

    with pytest.raises(wire.MalformedFrame, match=reason):
        reader.read_frame()

    frame = reader.read_frame()
    assert (frame.fields, frame.payload) == ({"id": 8}, b"next")


def test_stream_ending_inside_a_frame_is_reported_once() -> None:
    reader = reader_over(encode({"id": 1}, b"payload")[:-3])

    with pytest.raises(wire.MalformedFrame, match="ended inside a frame"):
        reader.read_frame()

    assert reader.read_frame() is None


def test_reader_continues_after_end_of_stream_when_data_arrives_again() -> None:
    pieces = [encode({"id": 1}), b"", encode({"id": 2})]
    reader = wire.FrameReader(lambda size: pieces.pop(0))

    assert reader.read_frame().fields == {"id": 1}
    assert reader.read_frame() is None
    assert reader.read_frame().fields == {"id": 2}


def test_encode_refuses_oversized_payload() -> None:
    with pytest.raises(ValueError, match="limited to"):
        wire.encode_header({"id": 1}, wire.MAX_PAYLOAD_SIZE + 1)
