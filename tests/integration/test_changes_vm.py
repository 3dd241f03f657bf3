"""VM.changes() against real guests: a host-side model of 100 file operations, diffs, lineage, filters."""

from __future__ import annotations

import random
import shlex
import stat

import pytest

from pytest_forkd.analysis.changes import Changes
from pytest_forkd.errors import ChangesError, ForkdError

WORK = "/srv/work"


class Model:
    """What the guest's WORK directory should hold: path -> (kind, content, mode, target)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, bytes, int, str]] = {}

    def snapshot(self) -> dict[str, tuple[str, bytes, int, str]]:
        return dict(self.files)


def _apply(vm, model: Model, rng: random.Random, index: int) -> str:
    regular = sorted(p for p, v in model.files.items() if v[0] == "file")
    existing = sorted(model.files)
    op = rng.choice(["create", "create", "modify", "modify", "chmod", "symlink", "delete", "rename"])
    if op != "create" and not existing:
        op = "create"
    if op in ("modify", "chmod") and not regular:
        op = "create"
    if op == "create":
        path = f"{WORK}/f{index}.txt"
        content = f"created at {index}\n".encode()
        vm.exec(f"printf %s {shlex.quote(content.decode())} > {path}", check=True)
        model.files[path] = ("file", content, 0o644, "")
    elif op == "modify":
        path = rng.choice(regular)
        kind, old, mode, _ = model.files[path]
        choice = rng.random()
        if choice < 0.3:  # same size, different bytes: only a content hash tells
            content = bytes(b ^ 1 if i == 0 else b for i, b in enumerate(old)) if old else b"x"
        elif choice < 0.45:  # rewritten with the same bytes: not a change
            content = old
        else:
            content = old + f"line {index}\n".encode()
        vm.exec(f"printf %s {shlex.quote(content.decode())} > {path}", check=True)
        model.files[path] = ("file", content, mode, "")
    elif op == "chmod":
        path = rng.choice(regular)
        mode = rng.choice([0o600, 0o640, 0o755, 0o644, 0o700])
        vm.exec(["chmod", f"{mode:o}", path], check=True)
        kind, content, _, target = model.files[path]
        model.files[path] = (kind, content, mode, target)
    elif op == "symlink":
        target = rng.choice(["f1.txt", "/etc/hostname", "missing", f"f{index - 1}.txt"])
        path = rng.choice(existing) if rng.random() < 0.3 else f"{WORK}/l{index}"
        vm.exec(["ln", "-sfn", target, path], check=True)
        model.files[path] = ("symlink", b"", 0o777, target)
    elif op == "delete":
        path = rng.choice(existing)
        vm.exec(["rm", "-f", path], check=True)
        del model.files[path]
    else:  # rename, sometimes over an existing path
        source = rng.choice(existing)
        others = [p for p in existing if p != source]
        target = rng.choice(others) if others and rng.random() < 0.3 else f"{WORK}/r{index}"
        vm.exec(["mv", "-f", source, target], check=True)
        model.files[target] = model.files.pop(source)
    return op


def _expected(before: dict, after: dict) -> tuple[set[str], set[str], set[str]]:
    added = set(after) - set(before)
    deleted = set(before) - set(after)
    modified = set()
    for path in set(before) & set(after):
        old, new = before[path], after[path]
        if old[0] != new[0] or old[1] != new[1] or old[3] != new[3] or (new[0] == "file" and old[2] != new[2]):
            modified.add(path)
    return added, modified, deleted


def test_changes_match_a_host_model_of_100_file_operations(vm) -> None:
    rng = random.Random(14)
    model = Model()
    vm.exec(["mkdir", "-p", WORK], check=True)
    for index in range(10):  # a starting population, present at the checkpoint
        path = f"{WORK}/f{index}.txt"
        vm.exec(f"printf 'seed {index}\\n' > {path}", check=True)
        model.files[path] = ("file", f"seed {index}\n".encode(), 0o644, "")
    checkpoint = vm.checkpoint(manifest=True)
    before = model.snapshot()
    ops = [_apply(vm, model, rng, index) for index in range(10, 110)]
    assert set(ops) == {"create", "modify", "chmod", "symlink", "delete", "rename"}
    added, modified, deleted = _expected(before, model.files)

    with checkpoint.changes(include=(WORK,)) as changes:
        assert changes.added == added
        assert changes.modified == modified
        assert changes.deleted == deleted
        for path in modified:
            old, new = before[path], model.files[path]
            aspects = changes[path].aspects
            assert ("content" in aspects) == (old[0] != new[0] or old[1] != new[1]), path
            if old[0] == new[0] == "symlink":
                assert ("target" in aspects) == (old[3] != new[3]), path
            if old[0] == new[0] == "file":
                assert ("mode" in aspects) == (old[2] != new[2]), path
        for path in added:
            entry = changes[path].new
            assert entry.kind == model.files[path][0]
            if entry.kind == "file":
                assert changes.read(path) == model.files[path][1]
                assert stat.S_IMODE(entry.mode) == model.files[path][2]
            else:
                assert entry.target == model.files[path][3]


def test_diff_read_and_repr(vm) -> None:
    vm.exec(["mkdir", "-p", WORK], check=True)
    vm.write_file(f"{WORK}/notes.txt", "one\ntwo\nthree\n")
    vm.write_file(f"{WORK}/gone.txt", "bye\n")
    with vm.checkpoint(manifest=True) as checkpoint:
        vm.write_file(f"{WORK}/notes.txt", "one\n2\nthree\n")  # same size: found by hashing
        vm.exec(["rm", f"{WORK}/gone.txt"], check=True)
        vm.exec(["ln", "-s", "notes.txt", f"{WORK}/link"], check=True)
        changes = checkpoint.changes(include=(f"{WORK}/*",))
        assert isinstance(changes, Changes)
        assert changes.modified == [f"{WORK}/notes.txt"]
        assert changes.deleted == {f"{WORK}/gone.txt"}
        assert changes.added == {f"{WORK}/link"}
        diff = changes.diff(f"{WORK}/notes.txt")
        assert "-two\n" in diff and "+2\n" in diff and diff.startswith(f"--- a{WORK}/notes.txt")
        assert changes.read(f"{WORK}/notes.txt") == b"one\n2\nthree\n"
        assert changes.read_old(f"{WORK}/gone.txt") == b"bye\n"
        text = repr(changes)
        assert "1 added, 1 modified, 1 deleted" in text
        assert f"M {WORK}/notes.txt" in text and f"D {WORK}/gone.txt" in text
        assert f"A {WORK}/link (symlink)" in text
        with pytest.raises(ChangesError, match="was deleted"):
            changes.read(f"{WORK}/gone.txt")
        with pytest.raises(ChangesError, match="not a regular file"):
            changes.diff(f"{WORK}/link")
        changes.close()
    # the context manager rolled back: the VM still works and the file is as before
    assert vm.read_file(f"{WORK}/notes.txt") == b"one\ntwo\nthree\n"


def test_changes_since_the_origin_and_a_checkpoint_without_manifest(vm) -> None:
    vm.write_file("/root/new.txt", "new\n")
    vm.exec(["chmod", "600", "/root/marker"], check=True)
    with vm.changes(include=("/root",)) as changes:  # since vm.origin: the old manifest comes from a child
        assert changes.added == {"/root/new.txt"}
        assert changes.modified == {"/root/marker"}
        assert changes["/root/marker"].aspects == {"mode"}
    checkpoint = vm.checkpoint(manifest=False)
    vm.exec(["rm", "/root/new.txt"], check=True)
    with checkpoint.changes(exclude=("/tmp",)) as changes:
        assert changes.paths == {"/root/new.txt"} and changes.deleted == {"/root/new.txt"}


def test_bad_input_is_a_forkd_error_and_the_vm_stays_usable(vm, base_snapshot) -> None:
    other = base_snapshot.fork(1)[0]
    try:
        foreign = other.checkpoint()
        with pytest.raises(ChangesError, match="not in the lineage"):
            vm.changes(foreign)
    finally:
        other.close()
    checkpoint = vm.checkpoint()
    with pytest.raises(ChangesError, match="matches no path"):
        checkpoint.changes(include=("/no/such/dir",))
    with pytest.raises(ChangesError, match="matches no path"):
        checkpoint.changes(exclude=("/srv/*.nothing",))
    with pytest.raises(ChangesError, match="never recorded"):
        checkpoint.changes(include=("/proc/1",))
    with pytest.raises(ForkdError, match="Checkpoint or a Snapshot"):
        vm.changes("yesterday")  # type: ignore[arg-type]
    # An older checkpoint is not in the lineage after restoring to a state before it.
    later = vm.checkpoint()
    vm.restore(checkpoint.snapshot)
    with pytest.raises(ChangesError, match="not in the lineage"):
        vm.changes(later)
    assert vm.exec(["echo", "ok"]).stdout == "ok\n"
    assert not checkpoint.changes(include=("/root",))
