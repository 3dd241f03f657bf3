"""The door to tarfile's private API (pytest_forkd/image/oci/tarfile_door.py): it holds on this Python, and a
change of tarfile's private shape is caught with a message that says what changed, before any layer is read."""

from __future__ import annotations

import io
import sys
import tarfile

import pytest

from pytest_forkd.errors import ImageError
from pytest_forkd.image.oci import tarfile_door
from pytest_forkd.image.oci.tarfile_door import HeaderLimits, Refused, entries, open_stream


def test_the_door_holds_on_this_python() -> None:
    problems = tarfile_door.door_problems()
    assert problems == [], (
        f"tarfile of Python {sys.version.split()[0]} no longer has the private shape pytest_forkd/image/oci/"
        f"tarfile_door.py relies on to refuse hostile layers before reading them: {problems}. Adapt the hooks "
        "there (and only there) to this Python's tarfile."
    )


def test_a_missing_private_method_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(tarfile.TarInfo, "_proc_gnusparse_10")
    assert tarfile_door.door_problems() == ["tarfile.TarInfo._proc_gnusparse_10 is gone"]


def test_a_hook_tarfile_no_longer_calls_is_caught_by_what_it_lets_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if a new tarfile read a 1.0 sparse map in another method: the hook would never run."""
    monkeypatch.delattr(tarfile_door._GuardedTarInfo, "_proc_gnusparse_10")
    problems = tarfile_door.door_problems()
    assert any(problem.startswith("PAX sparse 1.0: tarfile read it before the hook") for problem in problems)


def test_reading_a_layer_through_a_broken_door_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tarfile_door, "door_problems", lambda: ["tarfile.TarInfo._proc_member is gone"])
    tarfile_door._checked.cache_clear()
    try:
        with pytest.raises(ImageError, match=r"no longer works the way .* \(tarfile.TarInfo._proc_member is gone\)"):
            open_stream(io.BytesIO(b""), limits=HeaderLimits(1024, 512, 1 << 20), bufsize=10240)
    finally:
        tarfile_door._checked.cache_clear()


def test_a_stream_keeps_no_entry_it_returned() -> None:
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w") as tar:
        for number in range(50):
            info = tarfile.TarInfo(f"f{number}")
            tar.addfile(info)
    stream.seek(0)
    with open_stream(stream, limits=HeaderLimits(1024, 512, 1 << 20), bufsize=10240) as tar:
        names = []
        for member in entries(tar):
            names.append(member.name)
            assert len(tar.members) <= 1
    assert names == [f"f{number}" for number in range(50)]


def test_a_refusal_is_no_tarfile_error_and_keeps_the_name() -> None:
    """tarfile rewraps its own HeaderErrors into a bare ReadError; a Refused passes through with the entry's name."""
    assert not issubclass(Refused, tarfile.TarError)
    stream = io.BytesIO()
    info = tarfile.TarInfo("GNUSparseFile.0/real-name")
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "real-name"}
    with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info)
    stream.seek(0)
    with pytest.raises(Refused) as refused, open_stream(stream, limits=HeaderLimits(1024, 512, 1 << 20), bufsize=10240):
        pass
    assert refused.value.name == "real-name" and "version 1.0" in refused.value.problem
