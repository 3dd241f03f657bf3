"""forkd.yaml: workdir, shared snapshots, lifecycle settings and the ``images:`` section (no VM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_forkd.errors import ConfigError
from pytest_forkd.image import load_default_recipe
from pytest_forkd.project.config import EMPTY_PROJECT, parse_project
from pytest_forkd.project.images import image_recipe


def parse(tmp_path: Path, data: object):
    return parse_project(data, path=tmp_path / "forkd.yaml")


def test_workdir_shared_and_a_redeclared_base(tmp_path: Path) -> None:
    project = parse(
        tmp_path,
        {
            "snapshots": {
                "base": {"setup": ["echo mine > /etc/mine"]},
                "web": {"workdir": "/srv/app", "env": {"A": 1}},
                "common": {"shared": True},
            }
        },
    )

    assert project.snapshots["base"].source == "image:default"
    assert (project.snapshots["web"].workdir, dict(project.snapshots["web"].env)) == ("/srv/app", {"A": "1"})
    assert project.snapshot_names() == ["base", "common", "web"]
    assert [project.is_shared(name) for name in ("base", "web", "common", "failed-x")] == [False, False, True, False]
    assert parse(tmp_path, {}).is_shared("base") and EMPTY_PROJECT.is_shared("web")
    assert project.root == tmp_path


def test_lifecycle_settings(tmp_path: Path) -> None:
    settings = parse(
        tmp_path, {"settings": {"keep_failed_count": 2, "keep_failed_age": "12h", "store_max_size": "20GiB"}}
    ).settings
    assert dict(settings) == {"keep_failed_count": 2, "keep_failed_age": 43200.0, "store_max_size": 20 << 30}


def test_images_section_becomes_an_image_recipe(tmp_path: Path) -> None:
    (tmp_path / "tools").mkdir()
    tool = tmp_path / "tools" / "lint.sh"
    tool.write_text("#!/bin/sh\necho lint\n")
    tool.chmod(0o755)
    project = parse(
        tmp_path,
        {
            "images": {
                "tools": {
                    "packages": ["jq", "python3-yaml"],
                    "files": {"tools/lint.sh": "/usr/local/bin/lint"},
                    "setup": ["lint"],
                }
            },
            "snapshots": {"work": {"from": "image:tools", "memory_mib": 384}},
        },
    )

    image = project.images["tools"]
    assert (image.recipe, image.packages, image.setup) == (None, ("jq", "python3-yaml"), ("lint",))
    recipe = image_recipe(image)
    default = load_default_recipe()
    assert recipe.name == "tools"
    assert recipe.packages == (*default.packages, "jq", "python3-yaml")
    assert recipe.kernel == default.kernel and recipe.kernel_args == default.kernel_args
    assert [(spec.src, spec.dest, spec.mode) for spec in recipe.files] == [(tool, "/usr/local/bin/lint", 0o755)]
    assert project.snapshots["work"].source_image == "tools"


def test_an_image_can_start_from_a_recipe_file(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "slim.yaml").write_text("name: slim\npackages: [file]\n")
    project = parse(tmp_path, {"images": {"slim": {"recipe": "images/slim.yaml", "packages": ["jq"]}}})

    recipe = image_recipe(project.images["slim"])
    assert project.images["slim"].recipe == tmp_path / "images" / "slim.yaml"
    assert recipe.packages[-2:] == ("file", "jq") and recipe.name == "slim"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"images": []}, "forkd.yaml: images: expected a mapping of image name to image description"),
        ({"images": {"default": {}}}, "forkd.yaml: images.default: the image name 'default' is the built-in image"),
        ({"images": {"bad name": {}}}, "forkd.yaml: images.bad name: invalid image name"),
        (
            {"images": {"t": {"packages": "jq"}}},
            "forkd.yaml: images.t.packages: expected a list of Debian package names",
        ),
        (
            {"images": {"t": {"packages": ["jq", "Bad_Name"]}}},
            "forkd.yaml: images.t.packages[1]: 'Bad_Name' is not a Debian package name",
        ),
        ({"images": {"t": {"recipe": "nope.yaml"}}}, "forkd.yaml: images.t.recipe: no such recipe file"),
        ({"images": {"t": {"files": {"missing": "/x"}}}}, "forkd.yaml: images.t.files.missing: no such file"),
        ({"images": {"t": {"setup": [1]}}}, "forkd.yaml: images.t.setup[0]: expected a string"),
        ({"images": {"t": {"colour": 1}}}, "forkd.yaml: images.t.colour: unknown key; valid keys: recipe, packages"),
        (
            {"snapshots": {"web": {"workdir": "srv"}}},
            "forkd.yaml: snapshots.web.workdir: expected an absolute guest path",
        ),
        ({"snapshots": {"web": {"workdir": 3}}}, "forkd.yaml: snapshots.web.workdir: expected a string"),
        ({"snapshots": {"web": {"shared": "yes"}}}, "forkd.yaml: snapshots.web.shared: expected true or false"),
        (
            {"settings": {"keep_failed_count": -1}},
            "forkd.yaml: settings.keep_failed_count: expected a whole number >= 0",
        ),
        ({"settings": {"keep_failed_age": "forever"}}, "forkd.yaml: settings.keep_failed_age: expected an age"),
        ({"settings": {"store_max_size": "big"}}, "forkd.yaml: settings.store_max_size: expected a size"),
    ],
)
def test_errors_name_the_field_path(tmp_path: Path, data: object, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse(tmp_path, data)
    assert str(error.value).startswith(message), str(error.value)
