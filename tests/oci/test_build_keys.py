"""Build keys without a builder: what a Dockerfile build is made of, and ``.dockerignore`` read as Docker reads it.

The builds themselves (two arguments, two images; a .dockerignore'd ``logs/``
that builds nothing again) are in tests/oci/test_oci_builders.py, with the
host's real podman.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_forkd.image.oci.build_context import IgnoreRules, build_key, ignore_file
from pytest_forkd.image.oci.reference import parse_reference

# (pattern lines, path, excluded?) as moby's patternmatcher decides (the code Docker, BuildKit and buildah use).
IGNORE_CASES = [
    (["logs"], "logs", True),
    (["logs"], "logs/run.eval", True),  # a folder that matches excludes all of it
    (["logs/"], "logs/run.eval", True),
    (["/logs"], "logs/run.eval", True),  # rooted at the context either way
    (["./logs"], "logs/run.eval", True),
    (["logs"], "sub/logs/run.eval", False),  # no implicit **/ (unlike .gitignore)
    (["*.pyc"], "a.pyc", True),
    (["*.pyc"], "pkg/a.pyc", False),  # * stays within one path part
    (["**/*.pyc"], "pkg/deep/a.pyc", True),
    (["**/*.pyc"], "a.pyc", True),  # ** is zero parts too
    (["a/**/b"], "a/b", True),
    (["a/**/b"], "a/x/y/b", True),
    (["data/**"], "data/x/y", True),
    (["data/**"], "data", False),
    (["**"], "anything/at/all", True),
    (["**.md"], "docs/guide.md", True),  # a leading ** is a suffix match
    (["a?c"], "abc", True),
    (["a?c"], "a/c", False),
    (["[xy].txt"], "x.txt", True),
    (["[xy].txt"], "z.txt", False),
    (["a\\*b"], "a*b", True),
    (["a\\*b"], "axb", False),
    (["file.txt"], "fileXtxt", False),  # a dot is a dot
    (["*.md", "!README.md"], "README.md", False),
    (["*.md", "!README.md"], "NOTES.md", True),
    (["*.md", "!README.md", "README.md"], "README.md", True),  # the last matching line wins
    (["data", "!data/keep"], "data/keep", False),
    (["data", "!data/keep"], "data/other", True),
    (["# a comment", "  ", "build"], "build/x", True),
    (["# a comment"], "# a comment", False),
    ([" spaced "], "spaced", True),  # lines are trimmed
]


@pytest.mark.parametrize(("lines", "path", "excluded"), IGNORE_CASES)
def test_dockerignore_is_read_as_docker_reads_it(lines: list[str], path: str, excluded: bool) -> None:
    assert IgnoreRules(lines).excluded(path) is excluded


def context(tmp_path: Path, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "context"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    dockerfile = root / "Dockerfile"
    if not dockerfile.exists():
        dockerfile.write_text("FROM scratch\nCOPY . /\n")
    return dockerfile, root


def key(dockerfile: Path, root: Path, *, builder: str = "podman", **inputs: object) -> str:
    args = inputs.pop("args", {})
    return build_key(
        dockerfile,
        root,
        args=args,  # type: ignore[arg-type]
        target=inputs.get("target"),  # type: ignore[arg-type]
        platform=inputs.get("platform"),  # type: ignore[arg-type]
        builder=builder,
    )


def test_the_key_is_what_is_built_arguments_target_platform_and_contents(tmp_path: Path) -> None:
    dockerfile, root = context(tmp_path, {"app.py": "print(1)\n"})
    base = key(dockerfile, root)
    assert key(dockerfile, root, args={"V": "1"}) != base
    assert key(dockerfile, root, args={"V": "1"}) != key(dockerfile, root, args={"V": "2"})
    assert key(dockerfile, root, args={"V": "1"}) == key(dockerfile, root, args={"V": "1"})
    assert key(dockerfile, root, target="test") != base
    assert key(dockerfile, root, platform="linux/amd64") != base
    (root / "app.py").write_text("print(2)\n")
    changed = key(dockerfile, root)
    assert changed != base
    (root / "app.py").chmod(0o700)
    assert key(dockerfile, root) != changed  # modes are copied into the image
    dockerfile.write_text("FROM scratch\nCOPY app.py /\n")
    assert key(dockerfile, root) not in (base, changed)


def test_times_and_excluded_files_change_nothing(tmp_path: Path) -> None:
    dockerfile, root = context(tmp_path, {"app.py": "x\n", ".dockerignore": "logs/\n*.tmp\n"})
    base = key(dockerfile, root)
    os.utime(root / "app.py", (1, 1))  # a touch: BuildKit's cache ignores it, so does the key
    (root / "logs").mkdir()
    (root / "logs" / "2026.eval").write_text("{}")  # what Inspect writes beside its task
    (root / "scratch.tmp").write_text("x")
    assert key(dockerfile, root) == base
    (root / "logs.txt").write_text("not ignored")
    assert key(dockerfile, root) != base


def test_each_builder_reads_its_own_ignore_file(tmp_path: Path) -> None:
    dockerfile, root = context(tmp_path, {".dockerignore": "a\n", "a": "1", "b": "2"})
    assert ignore_file(dockerfile, root, "podman") == root / ".dockerignore"
    (root / ".containerignore").write_text("b\n")  # podman and buildah read it first
    assert ignore_file(dockerfile, root, "podman") == root / ".containerignore"
    assert ignore_file(dockerfile, root, "docker") == root / ".dockerignore"
    (root / "Dockerfile.dockerignore").write_text("*\n")  # BuildKit's, beside the Dockerfile
    assert ignore_file(dockerfile, root, "docker") == root / "Dockerfile.dockerignore"
    assert key(dockerfile, root, builder="docker") != key(dockerfile, root, builder="podman")


def test_a_build_reference_carries_its_key() -> None:
    text = "dockerfile:/task/Dockerfile@sha256:" + "ab" * 32
    reference = parse_reference(text)
    assert (reference.location, reference.digest) == ("/task/Dockerfile", "sha256:" + "ab" * 32)
    assert str(reference) == text
    assert str(parse_reference("dockerfile:/task/Dockerfile")) == "dockerfile:/task/Dockerfile"
