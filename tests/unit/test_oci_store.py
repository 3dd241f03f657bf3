"""The container image store without a registry: its lock (a deadline, a line naming the holder) and blobs hashed
once (per process, and for the next processes through a stamp they trust only while the blob's stat matches)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_forkd.errors import DigestMismatch, ImageError, ImageStoreFull
from pytest_forkd.image.oci import store

_SHA256 = hashlib.sha256  # the test's own hashing, not counted

HOLDER = r"""
import sys, time
from pytest_forkd.image.oci.store import StoreLock
with StoreLock("pulling docker://127.0.0.1:5000/held:1") as lock:
    print("held", flush=True)
    for _ in range(int(float(sys.argv[1]) * 10)):
        time.sleep(0.1)
        if sys.argv[2] == "progress":
            lock.alive()
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "_HASHED_HERE", {})
    return tmp_path / "cache"


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times a blob was hashed (sha256 objects made by the store)."""
    made: list[int] = []
    real = hashlib.sha256

    def counting(*args: Any) -> Any:
        made.append(1)
        return real(*args)

    monkeypatch.setattr(store.hashlib, "sha256", counting)
    yield made


def put_blob(data: bytes) -> str:
    digest = "sha256:" + _SHA256(data).hexdigest()
    path = store.blob_path(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def test_a_blob_is_hashed_once_per_process_and_the_next_processes_trust_the_stamp(
    cache: Path, hashes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "RACY_NS", 0)
    digest = put_blob(b"layer " * 1000)
    store.verify_blob(digest, 6000)
    store.verify_blob(digest, 6000)
    assert len(hashes) == 1
    assert (cache / "oci" / "verified" / digest.split(":")[1]).is_file()
    monkeypatch.setattr(store, "_HASHED_HERE", {})  # as a new process (another pytest-xdist worker)
    store.verify_blob(digest, 6000)
    assert len(hashes) == 1


def test_a_blob_changed_in_place_or_replaced_is_hashed_again(
    cache: Path, hashes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "RACY_NS", 0)
    data = b"layer " * 1000
    digest = put_blob(data)
    store.verify_blob(digest)
    path = store.blob_path(digest)
    replacement = path.with_name("replacement")
    replacement.write_bytes(data)
    os.replace(replacement, path)  # the same content, another file: hashed again, and fine
    store.verify_blob(digest)
    assert len(hashes) == 2
    time.sleep(0.02)  # past a clock tick of the file times
    damaged = bytearray(data)
    damaged[10] ^= 0xFF
    with open(path, "r+b") as handle:  # same inode, same size
        handle.write(bytes(damaged))
    monkeypatch.setattr(store, "_HASHED_HERE", {})
    with pytest.raises(DigestMismatch, match=digest):
        store.verify_blob(digest)
    assert len(hashes) == 3 and not path.exists()


def test_a_blob_changed_in_the_tick_it_was_stamped_is_never_trusted(cache: Path, hashes: list[int]) -> None:
    """A stat taken within a clock tick of the blob's last change proves nothing: such a blob is hashed again."""
    digest = put_blob(b"fresh")
    store.verify_blob(digest)  # hashed at once: its change time is a few microseconds old
    store.verify_blob(digest)
    assert len(hashes) == 2
    assert not (cache / "oci" / "verified").exists()


def test_a_size_that_differs_is_refused_without_hashing(cache: Path, hashes: list[int]) -> None:
    digest = put_blob(b"short")
    with pytest.raises(DigestMismatch, match="5 bytes instead of 6"):
        store.verify_blob(digest, 6)
    assert hashes == []


def hold(seconds: float, mode: str = "progress") -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(seconds), mode], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.slow  # a process of its own holds the lock
def test_waiting_for_the_store_lock_names_the_process_that_holds_it(cache: Path) -> None:
    holder = hold(1.5)
    try:
        lines: list[str] = []
        started = time.monotonic()
        with store.StoreLock("pulling docker://127.0.0.1:5000/waiting:1", progress=lines.append):
            waited = time.monotonic() - started
            owner = (cache / "oci" / store.OWNER_FILE).read_text()
        assert waited > 0.5
        assert lines[0].startswith(
            f"waiting for the image store lock held by PID {holder.pid} (pulling docker://127.0.0.1:5000/held:1, for "
        ), lines
        assert owner.startswith(f"{os.getpid()} ") and owner.endswith("pulling docker://127.0.0.1:5000/waiting:1\n")
        assert not (cache / "oci" / store.OWNER_FILE).exists()  # gone with the lock
    finally:
        holder.wait(timeout=30)


@pytest.mark.slow  # a process of its own holds the lock
def test_a_holder_that_shows_no_progress_is_given_up_on(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "LOCK_STALL_SECONDS", 1.0)
    holder = hold(20, mode="silent")
    try:
        with pytest.raises(ImageError, match=rf"held by PID {holder.pid} \(pulling .*\), which has shown no progress"):
            with store.StoreLock("pulling y"):
                pass
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow  # a process of its own holds the lock
def test_the_lock_is_waited_for_with_a_deadline(cache: Path) -> None:
    holder = hold(20)
    try:
        with pytest.raises(ImageError, match=rf"timed out after 1 s waiting for .* held by PID {holder.pid}"):
            with store.StoreLock("pulling y", timeout=1):
                pass
    finally:
        holder.kill()
        holder.wait()


def test_unwritable_folders_are_named_with_the_fix(tmp_path: Path) -> None:
    full = store.unwritable_error(OSError(28, os.strerror(28)), tmp_path, "writing the image index")
    assert isinstance(full, ImageStoreFull)
    assert str(full).startswith(f"writing the image index failed: no space left in {tmp_path}, on ")
    assert "forkd image prune" in str(full)
    read_only = store.unwritable_error("mke2fs: Read-only file system while ...", tmp_path, "writing an image disk")
    assert type(read_only) is ImageError and f"{tmp_path} is on a read-only filesystem" in str(read_only)
    assert "FORKD_CACHE_DIR" in str(read_only)
    assert store.unwritable_error(OSError(13, "Permission denied"), tmp_path, "x") is None


def test_skopeo_failures_for_want_of_room_or_write_access_name_the_store(tmp_path: Path) -> None:
    from pytest_forkd.image.oci import skopeo

    said = 'time="..." level=fatal msg="writing blob: write /x/oci-put-blob123: no space left on device"'
    full = skopeo.classify(said, source="docker://r/app:1", registry="r", store=tmp_path)
    assert isinstance(full, ImageStoreFull) and str(full).startswith(
        f"pulling docker://r/app:1 failed: no space left in {tmp_path}"
    )
    said = 'time="..." level=fatal msg="mkdir /x/blobs: read-only file system"'
    read_only = skopeo.classify(said, source="docker://r/app:1", registry="r", store=tmp_path)
    assert type(read_only) is ImageError and f"{tmp_path} is on a read-only filesystem" in str(read_only)
