"""The host side of VM.changes(): manifest parsing, comparison, filters, display."""

from __future__ import annotations

import pytest

from pytest_forkd.analysis.changes import Change, Changes, Paths, compare, explain_comparison, resolve_candidates
from pytest_forkd.analysis.manifest import MAGIC, VERSION, Entry, Manifest, ManifestFormatError
from pytest_forkd.errors import ChangesError

FILE, DIR, LINK = 0o100644, 0o040755, 0o120777


def _manifest(*entries: Entry) -> Manifest:
    return Manifest("t", {entry.path: entry for entry in entries})


def test_parse_round_trip_and_bad_headers() -> None:
    data = f"{MAGIC} {VERSION} cp-1\n/a\0{FILE}\x000\x000\x003\x0011\x00123\x00\n/l\0{LINK}\x000\x000\x001\x0012\x00124\x00a"
    manifest = Manifest.parse(data.encode())
    assert manifest.label == "cp-1" and len(manifest) == 2
    assert manifest.entries["/l"].target == "a" and manifest.entries["/l"].kind == "symlink"
    with pytest.raises(ManifestFormatError, match="not a version"):
        Manifest.parse(b"forkd-manifest 0 x\n")
    with pytest.raises(ManifestFormatError, match="malformed"):
        Manifest.parse(f"{MAGIC} {VERSION} x\n/a\0".encode())


def test_compare_reports_each_aspect() -> None:
    old = _manifest(
        Entry("/d", DIR, 0, 0, 4096, 1, 10),
        Entry("/d/same", FILE, 0, 0, 3, 2, 10),
        Entry("/d/grown", FILE, 0, 0, 3, 3, 10),
        Entry("/d/touched", FILE, 0, 0, 3, 4, 10),
        Entry("/d/chmod", FILE, 0, 0, 3, 5, 10),
        Entry("/d/chown", FILE, 0, 0, 3, 6, 10),
        Entry("/d/link", LINK, 0, 0, 1, 7, 10, "a"),
        Entry("/d/gone", FILE, 0, 0, 1, 8, 10),
        Entry("/d/becomes-link", FILE, 0, 0, 1, 9, 10),
    )
    new = _manifest(
        Entry("/d", DIR, 0, 0, 4096, 1, 99),
        Entry("/d/same", FILE, 0, 0, 3, 2, 10),
        Entry("/d/grown", FILE, 0, 0, 4, 3, 11),
        Entry("/d/touched", FILE, 0, 0, 3, 4, 12),
        Entry("/d/chmod", 0o100755, 0, 0, 3, 5, 13),
        Entry("/d/chown", FILE, 1000, 0, 3, 6, 14),
        Entry("/d/link", LINK, 0, 0, 1, 7, 15, "b"),
        Entry("/d/new", FILE, 0, 0, 1, 10, 16),
        Entry("/d/becomes-link", LINK, 0, 0, 1, 11, 17, "x"),
    )
    changes, candidates = compare(old, new)
    assert candidates == ["/d/chmod", "/d/chown", "/d/touched"]
    assert {path: (c.status, set(c.aspects)) for path, c in changes.items()} == {
        "/d/grown": ("modified", {"content"}),
        "/d/chmod": ("modified", {"mode"}),
        "/d/chown": ("modified", {"owner"}),
        "/d/link": ("modified", {"target"}),
        "/d/new": ("added", set()),
        "/d/gone": ("deleted", set()),
        "/d/becomes-link": ("modified", {"type", "content"}),
    }
    resolve_candidates(changes, candidates, old, new, ["h1", "h2", "h3"], ["h1", "h2", "other"])
    assert changes["/d/touched"].aspects == {"content"} and changes["/d/chmod"].aspects == {"mode"}


def test_filters_and_filters_that_match_nothing() -> None:
    old = _manifest(Entry("/srv/a.py", FILE, 0, 0, 1, 1, 1))
    new = _manifest(Entry("/srv/a.py", FILE, 0, 0, 2, 1, 2), Entry("/tmp/x", FILE, 0, 0, 1, 2, 2))
    assert set(compare(old, new, include=("/srv",))[0]) == {"/srv/a.py"}
    assert set(compare(old, new, include=("/srv/*.py",))[0]) == {"/srv/a.py"}
    assert set(compare(old, new, exclude=("/tmp",))[0]) == {"/srv/a.py"}
    assert set(compare(old, new, include="/tmp")[0]) == {"/tmp/x"}
    with pytest.raises(ChangesError, match=r"include filter '/sr' matches no path"):
        compare(old, new, include=("/sr",))
    with pytest.raises(ChangesError, match=r"exclude filter '\*.txt' |absolute"):
        compare(old, new, exclude=("*.txt",))
    with pytest.raises(ChangesError, match="never recorded"):
        compare(old, new, include=("/run/forkd",))


def test_paths_compare_with_sets_and_lists() -> None:
    paths = Paths({"/b", "/a"})
    assert paths == {"/a", "/b"} and paths == ["/a", "/b"] and paths == ("/b", "/a")
    assert paths != ["/a"] and list(paths) == ["/a", "/b"]
    assert repr(paths) == "{'/a', '/b'}" and repr(Paths()) == "Paths()"
    lines = explain_comparison("==", paths, {"/a", "/c"})
    assert "  unexpected: /b" in lines and "  missing:    /c" in lines


class _NoOld:
    def close(self) -> None:
        pass


def test_changes_display() -> None:
    old_entry = Entry("/x", FILE, 0, 0, 3, 1, 1)
    changes = Changes(
        None,
        "checkpoint cp",
        {
            "/x": Change(
                "/x", "modified", frozenset({"content", "mode"}), old_entry, Entry("/x", 0o100700, 0, 0, 5, 1, 2)
            ),
            "/y": Change("/y", "added", new=Entry("/y", LINK, 0, 0, 1, 2, 2, "/x")),
        },
        _NoOld(),
    )
    assert repr(changes).splitlines() == [
        "changes since checkpoint cp: 1 added, 1 modified, 0 deleted",
        "  M /x  [content 3 -> 5 bytes; mode 0644 -> 0700]",
        "  A /y (symlink)  [-> /x]",
    ]
    assert "/x" in changes and len(changes) == 2 and changes.modified == ["/x"]
    with pytest.raises(KeyError, match="did not change"):
        changes["/z"]
    assert explain_comparison("==", changes, None)[0].startswith("changes since checkpoint cp")
