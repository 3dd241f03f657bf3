"""``files:`` in forkd.yaml copies whole directories into a snapshot (with VM.copy_in)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_forkd.errors import ConfigError
from pytest_forkd.project.config import parse_project
from pytest_forkd.project.snapshot_builder import _file_digest


@pytest.mark.vm
def test_a_snapshot_copies_directories_in_with_modes_links_and_excludes(pytester, run_forkd, tmp_path):
    app = pytester.path / "app"
    (app / "pkg").mkdir(parents=True)
    (app / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (app / "pkg" / "__init__.pyc").write_bytes(b"left out")
    (app / "run.sh").write_text("#!/bin/sh\necho ran\n")
    os.chmod(app / "run.sh", 0o755)
    os.symlink("pkg/__init__.py", app / "link.py")
    (pytester.path / "single.txt").write_text("one file\n")
    pytester.makefile(
        ".yaml",
        forkd="""
        snapshots:
          app:
            from: base
            files:
              single.txt: /etc/single.txt
              app:
                to: /srv/app
                exclude: ["*.pyc"]
            setup: ["/srv/app/run.sh > /srv/ran"]
    """,
    )
    pytester.makepyfile(
        test_app="""
        import pytest

        @pytest.mark.forkd(snapshot="app")
        def test_tree_is_there(forkd_vm):
            run = forkd_vm.exec
            assert run("cat /srv/ran /etc/single.txt").stdout == "ran\\none file\\n"
            assert run("readlink /srv/app/link.py").stdout == "pkg/__init__.py\\n"
            assert run("stat -c %a /srv/app/run.sh").stdout == "755\\n"
            assert run("cd /srv/app && python3 -c 'import pkg; print(pkg.VALUE)'").stdout == "42\\n"
            assert run("test -e /srv/app/pkg/__init__.pyc").exit_code == 1
    """
    )
    result = run_forkd("-s", store=tmp_path / "store")
    result.assert_outcomes(passed=1)


def test_files_name_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    cases = [
        ({"snapshots": {"s": {"files": {"missing": "/x"}}}}, "snapshots.s.files.missing: no such file or directory"),
        (
            {"images": {"i": {"files": {"dir": "/x"}}}},
            "images.i.files.dir: " + str(tmp_path / "dir") + " is a directory; an image's files are single files",
        ),
        ({"snapshots": {"s": {"files": {"dir": {"exclude": []}}}}}, "snapshots.s.files.dir: missing 'to'"),
        ({"snapshots": {"s": {"files": {"dir": {"to": "/x", "bogus": 1}}}}}, "snapshots.s.files.dir.bogus: unknown"),
        ({"snapshots": {"s": {"files": {"dir": {"to": "rel"}}}}}, "snapshots.s.files.dir.to: expected an absolute"),
    ]
    for document, message in cases:
        with pytest.raises(ConfigError) as caught:
            parse_project(document, path=tmp_path / "forkd.yaml")
        assert message in str(caught.value)


def test_a_directory_digest_follows_contents_modes_links_and_excludes(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a.py").write_text("a")
    (tree / "b.pyc").write_text("b")
    first = _file_digest(tree)
    (tree / "sub" / "a.py").write_text("changed")
    second = _file_digest(tree)
    os.chmod(tree / "sub" / "a.py", 0o700)
    third = _file_digest(tree)
    os.symlink("sub", tree / "link")
    fourth = _file_digest(tree)
    assert len({first, second, third, fourth}) == 4
    excluded = _file_digest(tree, ("*.pyc",))
    (tree / "b.pyc").write_text("ignored change")
    assert _file_digest(tree, ("*.pyc",)) == excluded != fourth
