"""Settings precedence and validation (no VM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_forkd.errors import ConfigError
from pytest_forkd.project.settings import VMChoice, choose_vm, config_path, resolve

BACKENDS = ["diff", "full", "uffd"]


def settings(cli=None, env=None, ini=None, project=None, rootdir=Path("/project")):
    return resolve(
        cli=cli or {},
        env=env or {},
        ini=ini or {},
        project_settings=project or {},
        backends=lambda: BACKENDS,
        rootdir=rootdir,
    )


def test_defaults():
    resolved = settings()
    assert (
        resolved.snapshot,
        resolved.backend,
        resolved.store,
        resolved.accel,
        resolved.pool,
        resolved.keep_failed,
    ) == ("base", "diff", None, "auto", 1, False)
    assert resolved.sources["pool"] == "default"


def test_precedence_cli_over_env_over_ini_over_project():
    layers = dict(
        cli={"snapshot": "from-cli"},
        env={"PYTEST_FORKD_SNAPSHOT": "from-env", "PYTEST_FORKD_POOL": "3"},
        ini={"snapshot": "from-ini", "pool": "2", "backend": "full"},
        project={"snapshot": "from-yaml", "pool": 5, "backend": "uffd", "accel": "tcg"},
    )
    resolved = settings(**layers)
    assert (resolved.snapshot, resolved.pool, resolved.backend, resolved.accel) == ("from-cli", 3, "full", "tcg")
    assert resolved.sources["snapshot"] == "--forkd-snapshot"
    assert resolved.sources["pool"] == "PYTEST_FORKD_POOL"
    assert resolved.sources["backend"] == "ini forkd_backend"
    assert resolved.sources["accel"] == "forkd.yaml settings.accel"
    assert settings(env=layers["env"], ini=layers["ini"]).snapshot == "from-env"
    assert settings(ini=layers["ini"], project=layers["project"]).snapshot == "from-ini"
    assert settings(project=layers["project"]).snapshot == "from-yaml"


def test_marker_beats_everything():
    resolved = settings(cli={"snapshot": "cli", "backend": "full"})
    choice = choose_vm(resolved, (), {"snapshot": "tools", "memory_mib": 512}, backends=BACKENDS, test="t")
    assert choice == VMChoice(snapshot="tools", backend="full", memory_mib=512)
    assert choose_vm(resolved, (), {}, backends=BACKENDS, test="t") == VMChoice("cli", "full", None)


def test_flags_and_paths():
    resolved = settings(env={"PYTEST_FORKD_KEEP_FAILED": "yes"}, ini={"store": "snaps"}, rootdir=Path("/project"))
    assert resolved.keep_failed is True
    assert resolved.store == Path("/project/snaps")
    assert settings(cli={"keep_failed": True}, env={"PYTEST_FORKD_KEEP_FAILED": "0"}).keep_failed is True
    assert settings(env={"PYTEST_FORKD_STORE": "/abs/store"}).store == Path("/abs/store")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"env": {"PYTEST_FORKD_POOL": "many"}}, "PYTEST_FORKD_POOL: expected a whole number >= 0"),
        ({"cli": {"accel": "fast"}}, "--forkd-accel: expected one of auto, kvm, tcg, got 'fast'"),
        (
            {"cli": {"backend": "zfs"}},
            "--forkd-backend: unknown storage backend 'zfs'; registered backends: diff, full",
        ),
        ({"ini": {"keep_failed": "maybe"}}, "ini forkd_keep_failed: expected one of 1, true"),
        ({"cli": {"snapshot": "no/slash"}}, "--forkd-snapshot: invalid snapshot name 'no/slash'"),
        ({"project": {"backend": "zfs"}}, "forkd.yaml settings.backend: unknown storage backend 'zfs'"),
    ],
)
def test_invalid_values_name_their_source(kwargs, message):
    with pytest.raises(ConfigError) as error:
        settings(**kwargs)
    assert str(error.value).startswith(message), str(error.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"snapshot": "a b"}, "forkd marker on t: snapshot: invalid snapshot name"),
        ({"backend": "zfs"}, "forkd marker on t: backend: unknown storage backend 'zfs'"),
        ({"memory_mib": "big"}, "forkd marker on t: memory_mib: expected a whole number of MiB >= 64"),
        (
            {"colour": 1},
            "forkd marker on t: unknown argument(s) colour; valid arguments: snapshot, backend, memory_mib",
        ),
    ],
)
def test_invalid_markers(kwargs, message):
    with pytest.raises(ConfigError) as error:
        choose_vm(settings(), (), kwargs, backends=BACKENDS, test="t")
    assert str(error.value).startswith(message), str(error.value)


def test_marker_takes_keywords_only():
    with pytest.raises(ConfigError, match="keyword arguments only"):
        choose_vm(settings(), ("tools",), {}, backends=BACKENDS, test="t")


def test_config_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_path(None, {}, "", tmp_path) == (None, "default")
    (tmp_path / "forkd.yaml").write_text("")
    assert config_path(None, {}, "", tmp_path) == (tmp_path / "forkd.yaml", "rootdir")
    (tmp_path / "other.yaml").write_text("")
    assert config_path(None, {"PYTEST_FORKD_CONFIG": "other.yaml"}, "", tmp_path) == (
        tmp_path / "other.yaml",
        "PYTEST_FORKD_CONFIG",
    )
    assert config_path("other.yaml", {}, "forkd.yaml", tmp_path)[1] == "--forkd-config"
    with pytest.raises(ConfigError, match="--forkd-config: no such file .*absent.yaml"):
        config_path("absent.yaml", {}, "", tmp_path)
