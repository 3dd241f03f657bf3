"""Image cache: content keys, names, locking and atomic publication (the build pipeline is faked)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_forkd.cli import image_cmd
from pytest_forkd.errors import ConfigError, ImageError, UnknownImage
from pytest_forkd.image import builder, catalog, list_images, load_image
from pytest_forkd.image.recipe import load_default_recipe, load_recipe


@pytest.fixture
def guest_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Stand-in guest files, so keys do not depend on the agent under development."""
    directory = tmp_path / "guest"
    directory.mkdir()
    files = {name: directory / name for name in ("agent.py", "wire.py", "init.sh")}
    for name, path in files.items():
        path.write_text(f"# {name}\n")
    monkeypatch.setattr(builder, "guest_files", lambda: files)
    return files


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("FORKD_CACHE_DIR", str(directory))
    return directory


class FakePipeline:
    """Writes a minimal image directory the way the real pipeline lays it out, and counts builds."""

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.delay = delay
        self.fail = fail
        self.builds: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, recipe: Any, name: str, key: str, workdir: Path, progress: Any) -> Path:
        with self._lock:
            self.builds.append(key)
        progress("building (fake)")
        time.sleep(self.delay)
        output = workdir / "image"
        output.mkdir()
        for filename in (catalog.KERNEL_FILE, catalog.INITRD_FILE, catalog.STUB_KERNEL_FILE, catalog.STUB_INITRD_FILE):
            (output / filename).write_bytes(b"x" * 100)
        if self.fail:
            raise ImageError("the fake pipeline failed halfway")
        manifest = {
            "name": name,
            "key": key,
            "created": "2026-01-01T00:00:00+00:00",
            "created_unix": time.time(),
            "build_seconds": self.delay,
            "kernel_args": list(recipe.kernel_args),
            "env": dict(recipe.env),
        }
        (output / catalog.MANIFEST_FILE).write_text(json.dumps(manifest))
        return output


@pytest.fixture
def pipeline(monkeypatch: pytest.MonkeyPatch) -> FakePipeline:
    fake = FakePipeline()
    monkeypatch.setattr(builder, "_run_pipeline", fake)
    return fake


def quiet(message: str) -> None:
    pass


def test_key_is_stable_and_tracks_content(
    tmp_path: Path, guest_sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    default = load_default_recipe()
    key = builder.image_key(default)
    assert key == builder.image_key(load_default_recipe())
    assert len(key) == 16 and int(key, 16) >= 0

    recipe_path = tmp_path / "extra.yaml"
    recipe_path.write_text("packages: [git]\n")
    assert builder.image_key(load_recipe(recipe_path)) != key
    recipe_path.write_text("env: {A: b}\n")
    assert builder.image_key(load_recipe(recipe_path)) != key
    recipe_path.write_text("release: trixie\n")  # another Debian release is another image
    assert builder.image_key(load_recipe(recipe_path)) != key
    recipe_path.write_text("packages: []\n")  # adds nothing to the default: same content, same key
    assert builder.image_key(load_recipe(recipe_path)) == key

    guest_sources["agent.py"].write_text("# a new agent\n")
    assert builder.image_key(default) != key
    guest_sources["agent.py"].write_text("# agent.py\n")
    monkeypatch.setattr(builder, "BUILDER_VERSION", builder.BUILDER_VERSION + 1)
    assert builder.image_key(default) != key


def test_build_publishes_image_and_name(cache: Path, guest_sources: dict[str, Path], pipeline: FakePipeline) -> None:
    image = builder.build_image(progress=quiet)
    assert image.name == "default"
    assert image.path == cache / "images" / image.key
    assert image.fingerprint == image.key
    assert image.kernel.is_file() and image.initrd.is_file()
    assert image.stub_kernel.is_file() and image.stub_initrd.is_file()
    assert (cache / "images" / "names" / "default").read_text().strip() == image.key
    assert load_image("default") == image
    assert list(cache.joinpath("images").glob(".build-*")) == []


def test_second_build_is_a_cache_hit_and_force_rebuilds(
    cache: Path, guest_sources: dict[str, Path], pipeline: FakePipeline
) -> None:
    first = builder.build_image(progress=quiet)
    second = builder.build_image(progress=quiet)
    assert pipeline.builds == [first.key]
    assert second == first
    forced = builder.build_image(progress=quiet, force=True)
    assert pipeline.builds == [first.key, first.key]
    assert forced.key == first.key and forced.initrd.is_file()


def test_concurrent_builds_of_one_key_build_once(
    cache: Path, guest_sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakePipeline(delay=0.15)
    monkeypatch.setattr(builder, "_run_pipeline", fake)
    messages: list[str] = []
    results: list[Any] = []

    def build() -> None:
        results.append(builder.build_image(progress=messages.append))

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fake.builds) == 1
    assert len(results) == 3 and len({image.key for image in results}) == 1
    assert any("waiting for another build" in message for message in messages)


def test_failed_build_leaves_nothing_behind(
    cache: Path, guest_sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(builder, "_run_pipeline", FakePipeline(fail=True))
    with pytest.raises(ImageError, match="failed halfway"):
        builder.build_image(progress=quiet)
    images = cache / "images"
    assert [path.name for path in images.iterdir() if path.name != ".locks"] == []
    with pytest.raises(UnknownImage):
        load_image("default")


def test_stale_build_directory_is_removed_by_the_next_build(
    cache: Path, guest_sources: dict[str, Path], pipeline: FakePipeline
) -> None:
    key = builder.image_key(load_default_recipe())
    stale = cache / "images" / f".build-{key}-killed"
    stale.mkdir(parents=True)
    builder.build_image(progress=quiet)
    assert not stale.exists()


def test_unknown_image_says_how_to_build_it(
    cache: Path, guest_sources: dict[str, Path], pipeline: FakePipeline
) -> None:
    with pytest.raises(
        UnknownImage,
        match=r"no image named 'tools'; build it with `forkd image build --name tools \[--recipe FILE\]`; built images: none yet",
    ):
        load_image("tools")
    builder.build_image(progress=quiet)
    with pytest.raises(UnknownImage, match="built images: default$"):
        load_image("tools")


def test_names_point_at_keys_and_share_images(
    cache: Path, tmp_path: Path, guest_sources: dict[str, Path], pipeline: FakePipeline
) -> None:
    recipe = tmp_path / "tools.yaml"
    recipe.write_text("env: {TOOL: yes-please}\nkernel_args: [loglevel=3]\n")
    tools = builder.build_image(recipe, progress=quiet)
    assert tools.name == "tools"  # from the file name, as the recipe has no name field
    assert dict(tools.env) == {"TOOL": "yes-please"}
    assert tools.kernel_args == load_default_recipe().kernel_args + ("loglevel=3",)
    alias = builder.build_image(recipe, name="tools2", progress=quiet)
    assert alias.path == tools.path and len(pipeline.builds) == 1
    default = builder.build_image(progress=quiet)
    assert [image.name for image in list_images()] == ["default", "tools", "tools2"]
    assert default.key != tools.key


def test_default_name_is_reserved_for_the_builtin_recipe(
    cache: Path, tmp_path: Path, guest_sources: dict[str, Path], pipeline: FakePipeline
) -> None:
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("packages: [git]\n")
    with pytest.raises(ConfigError, match="reserved for the built-in recipe"):
        builder.build_image(recipe, name="default", progress=quiet)
    assert pipeline.builds == []


def test_ensure_image_builds_default_but_not_other_names(
    cache: Path, guest_sources: dict[str, Path], pipeline: FakePipeline
) -> None:
    with pytest.raises(UnknownImage):
        builder.ensure_image("tools", progress=quiet)
    image = builder.ensure_image(progress=quiet)
    assert image.name == "default" and len(pipeline.builds) == 1
    guest_sources["agent.py"].write_text("# upgraded agent\n")
    upgraded = builder.ensure_image(progress=quiet)
    assert upgraded.key != image.key and len(pipeline.builds) == 2


def test_cli_build_and_ls(
    cache: Path, guest_sources: dict[str, Path], pipeline: FakePipeline, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="forkd")
    image_cmd.add_parser(parser.add_subparsers(required=True))

    args = parser.parse_args(["image", "ls"])
    assert args.run(args) == 0
    assert "no images built yet" in capsys.readouterr().out

    args = parser.parse_args(["image", "build"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    key = load_image().key
    assert out.startswith("image default: built in")
    assert key in out and "initrd" in out and str(cache) in out

    assert args.run(args) == 0
    assert capsys.readouterr().out.startswith("image default: cached, nothing to build")

    args = parser.parse_args(["image", "ls"])
    assert args.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "KEY", "INITRD", "CREATED"]
    assert lines[1].split()[:2] == ["default", key[:12]]
