"""Recipe parsing: merging with the default recipe, and errors that name the field path."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_forkd.errors import ConfigError, InvalidTagError
from pytest_forkd.image.recipe import load_default_recipe, load_recipe


def write_recipe(directory: Path, text: str) -> Path:
    path = directory / "recipe.yaml"
    path.write_text(text)
    return path


def test_default_recipe_has_kernel_busybox_and_python() -> None:
    recipe = load_default_recipe()
    assert recipe.name == "default"
    assert recipe.base == "debian"
    assert recipe.kernel == "linux-image-cloud-amd64"
    assert recipe.release == "bookworm"
    assert {"busybox-static", "python3-minimal", "libpython3-stdlib"} <= set(recipe.packages)
    # The Python version comes from the release's packages, never from the recipe.
    assert not any(package.startswith(("python3.", "libpython3.")) for package in recipe.packages)
    assert "perl-base" in recipe.exclude


def test_a_recipe_names_its_debian_release(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, "name: t13\nrelease: trixie\n"))
    assert recipe.release == "trixie"
    assert recipe.packages == load_default_recipe().packages
    assert recipe.normalized()["release"] == "trixie"
    assert load_recipe(write_recipe(tmp_path, "name: t12\n")).release == "bookworm"
    scratch = load_recipe(
        write_recipe(tmp_path, "extends: none\nbase: debian\nkernel: linux-image-amd64\npackages: [busybox-static]\n")
    )
    assert scratch.release == "bookworm"


@pytest.mark.parametrize("value", ["Trixie", "", "trixie main", 13, "../x"])
def test_a_malformed_release_names_the_field(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match="recipe.yaml: release: expected a Debian release name such as bookworm"):
        load_recipe(write_recipe(tmp_path, f"release: {value!r}\n"))


def test_user_recipe_extends_the_default(tmp_path: Path) -> None:
    (tmp_path / "tool.py").write_text("print('tool')\n")
    path = write_recipe(
        tmp_path,
        """
name: tools
packages: [git]
exclude: [git-man]
files:
  - {src: ./tool.py, dest: /usr/local/bin/tool, mode: 0o755}
kernel_args: [loglevel=3]
env: {FOO: bar, RETRIES: 3}
""",
    )
    recipe = load_recipe(path)
    default = load_default_recipe()
    assert recipe.name == "tools"
    assert recipe.packages == default.packages + ("git",)
    assert recipe.exclude == default.exclude + ("git-man",)
    assert recipe.kernel == default.kernel
    assert recipe.kernel_args == default.kernel_args + ("loglevel=3",)
    assert dict(recipe.env) == {"FOO": "bar", "RETRIES": "3"}
    (spec,) = recipe.files
    assert spec.src == tmp_path / "tool.py"
    assert spec.dest == "/usr/local/bin/tool"
    assert spec.mode == 0o755


def test_extends_none_starts_from_scratch(tmp_path: Path) -> None:
    path = write_recipe(
        tmp_path,
        "extends: none\nbase: debian\nkernel: linux-image-amd64\npackages: [busybox-static]\n",
    )
    recipe = load_recipe(path)
    assert recipe.packages == ("busybox-static",)
    assert recipe.exclude == ()
    assert recipe.kernel_args == ()
    assert recipe.kernel == "linux-image-amd64"


def test_extends_none_requires_a_kernel(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, "extends: none\nbase: debian\npackages: [busybox-static]\n")
    with pytest.raises(ConfigError, match=r"^recipe.yaml: kernel: missing"):
        load_recipe(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "files:\n  - {src: ./a.txt, dest: /a}\n  - {src: ./a.txt, dest: tmp/x}\n",
            "recipe.yaml: files[1].dest: expected an absolute guest path, got 'tmp/x'",
        ),
        ("packagez: [git]\n", "recipe.yaml: packagez: unknown field; allowed fields are"),
        ("packages: git\n", "recipe.yaml: packages: expected a list, got str 'git'"),
        ("packages: [git, 42]\n", "recipe.yaml: packages[1]: expected a non-empty string, got 42"),
        ("packages: [Not_A_Package]\n", "recipe.yaml: packages[0]: expected a Debian package name"),
        ("files:\n  - {src: ./missing.txt, dest: /x}\n", "recipe.yaml: files[0].src: no such file"),
        ("files:\n  - {src: ./a.txt}\n", "recipe.yaml: files[0].dest: missing"),
        ("files:\n  - {src: ./a.txt, dest: /x, owner: root}\n", "recipe.yaml: files[0].owner: unknown field"),
        (
            "files:\n  - {src: ./a.txt, dest: /x, mode: rwx}\n",
            "recipe.yaml: files[0].mode: expected an octal file mode such as '0o755', got 'rwx'",
        ),
        (
            "files:\n  - {src: ./a.txt, dest: /x, mode: 0o17777}\n",
            "recipe.yaml: files[0].mode: expected a file mode between",
        ),
        ("files:\n  - ./a.txt\n", "recipe.yaml: files[0]: expected a mapping with src, dest"),
        ("files:\n  - {src: ., dest: /x}\n", "recipe.yaml: files[0].src: "),
        ("kernel_args: ['a b']\n", "recipe.yaml: kernel_args[0]: expected one argument without spaces"),
        ("env: {1BAD: x}\n", "recipe.yaml: env.1BAD: expected a variable name"),
        ("env: {GOOD: [1, 2]}\n", "recipe.yaml: env.GOOD: expected a string, got list"),
        ("env: [A]\n", "recipe.yaml: env: expected a mapping of NAME: value"),
        ("base: alpine\n", "recipe.yaml: base: expected one of debian, got 'alpine'"),
        ("extends: ubuntu\n", "recipe.yaml: extends: expected one of default, none, got 'ubuntu'"),
        ("kernel: 7\n", "recipe.yaml: kernel: expected a non-empty string, got 7"),
        ("- just\n- a list\n", "recipe.yaml: expected a mapping of recipe fields at the top level, got list"),
        ("packages: [unclosed\n", "recipe.yaml: not valid YAML"),
    ],
)
def test_malformed_recipes_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(ConfigError) as caught:
        load_recipe(write_recipe(tmp_path, text))
    assert str(caught.value).startswith(message), str(caught.value)


def test_directory_source_is_refused_with_advice(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    path = write_recipe(tmp_path, "files:\n  - {src: data, dest: /data}\n")
    with pytest.raises(ConfigError, match="is a directory; list the files in it one by one"):
        load_recipe(path)


def test_invalid_image_name_is_an_invalid_tag(tmp_path: Path) -> None:
    with pytest.raises(InvalidTagError, match="invalid image name 'has space'"):
        load_recipe(write_recipe(tmp_path, "name: has space\n"))


def test_missing_recipe_file_says_which(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope.yaml does not exist; check the --recipe path"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize(("written", "mode"), [("0o755", 0o755), ("0755", 0o755), ("'644'", 0o644), ("'0o600'", 0o600)])
def test_file_modes_are_octal(tmp_path: Path, written: str, mode: int) -> None:
    (tmp_path / "a.txt").write_text("a")
    recipe = load_recipe(write_recipe(tmp_path, f"files:\n  - {{src: a.txt, dest: /a, mode: {written}}}\n"))
    assert recipe.files[-1].mode == mode


def test_normalized_recipe_tracks_file_content_not_location(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one")
    path = write_recipe(tmp_path, "name: x\nfiles:\n  - {src: a.txt, dest: /a}\n")
    before = load_recipe(path).normalized()
    (tmp_path / "a.txt").write_text("two")
    after = load_recipe(path).normalized()
    assert before != after
    assert "name" not in before
    assert str(tmp_path) not in repr(before)
