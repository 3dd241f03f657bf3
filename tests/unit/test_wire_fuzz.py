"""Property-based tests of the frame decoder: whatever bytes arrive, it yields valid frames or
MalformedFrame, never another exception, never more memory than a frame, and it finds the
valid frames that follow the garbage."""

from __future__ import annotations

import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_forkd.guest import wire

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
FIELDS = st.fixed_dictionaries({"id": st.integers(min_value=0, max_value=2**53)}, optional={"x": JSON_VALUES})

# Hostile pieces a guest may send: plain garbage, broken headers, unreadable or deep JSON.
HOSTILE = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda n, p: wire.HEADER.pack(wire.MAGIC, n, p), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
    st.builds(lambda body: wire.HEADER.pack(wire.MAGIC, len(body), 0) + body, st.binary(min_size=1, max_size=200)),
    st.builds(
        lambda depth: (lambda body: wire.HEADER.pack(wire.MAGIC, len(body), 0) + body)(
            b'{"id": 1, "x": ' + b"[" * depth + b"]" * depth + b"}"
        ),
        st.integers(1, 50_000),
    ),
    st.just(wire.HEADER.pack(wire.MAGIC, 3, 0) + b"\xff\xfe\xfd"),
)


def reader_over(data: bytes, read_size: int) -> wire.FrameReader:
    stream = io.BytesIO(data)
    return wire.FrameReader(lambda n: stream.read(min(n, read_size)))


def drain(reader: wire.FrameReader) -> tuple[list[wire.Frame], list[str]]:
    frames, kinds = [], []
    for _ in range(100_000):  # each call consumes input: this bounds a runaway loop
        try:
            frame = reader.read_frame()
        except wire.MalformedFrame as exc:
            kinds.append(exc.kind)
            continue
        if frame is None:
            return frames, kinds
        frames.append(frame)
    raise AssertionError("the reader never reached the end of its input")


@pytest.mark.slow  # hypothesis examples
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(HOSTILE, max_size=6), read_size=st.integers(1, 70_000))
def test_any_bytes_give_frames_or_malformed_frame_only(pieces: list[bytes], read_size: int) -> None:
    frames, kinds = drain(reader_over(b"".join(pieces), read_size))

    assert all(isinstance(frame.fields, dict) and type(frame.fields["id"]) is int for frame in frames)
    assert set(kinds) <= {"garbage", "json", "id", "truncated"}


@settings(max_examples=200, deadline=None)
@given(
    garbage=st.binary(max_size=3000).filter(lambda data: wire.MAGIC not in data),
    messages=st.lists(st.tuples(FIELDS, st.binary(max_size=2000)), min_size=1, max_size=5),
    read_size=st.integers(1, 5000),
)
@pytest.mark.slow  # hypothesis examples
def test_valid_frames_after_garbage_are_found(garbage: bytes, messages, read_size: int) -> None:
    valid = b"".join(wire.encode_header(fields, len(payload)) + payload for fields, payload in messages)

    frames, kinds = drain(reader_over(garbage + valid, read_size))

    assert [(f.fields, f.payload) for f in frames] == messages
    assert kinds == (["garbage"] if garbage else [])


@given(depth=st.integers(900, 200_000))
@settings(max_examples=20, deadline=None)
def test_deeply_nested_json_is_a_malformed_frame(depth: int) -> None:
    body = b"[" * depth + b"]" * depth
    data = wire.HEADER.pack(wire.MAGIC, len(body), 0) + body if len(body) <= wire.MAX_JSON_SIZE else b""
    data += wire.encode_header({"id": 7}, 2) + b"ok"

    frames, kinds = drain(reader_over(data, 65536))

    assert [(f.fields, f.payload) for f in frames] == [({"id": 7}, b"ok")]
    assert kinds in ([], ["json"], ["id"])  # too deep, or a list that is no frame
