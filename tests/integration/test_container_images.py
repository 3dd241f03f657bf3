"""Container images as guests, end to end: a real registry on 127.0.0.1, real pulls, real VMs.

The images are made by the tests (:mod:`oci_images`) and pushed with skopeo
to Debian's ``docker-registry`` (:mod:`registry`); the guest then sees the
image's layers, config and users, forks and rolls back like any VM, and keeps
running images pulled before when the registry is gone.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from oci_images import BUSYBOX_FACTS, push, write_busybox_image
from registry import Registry

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.errors import AgentError, ImageError
from pytest_forkd.guest.client import GuestOSError
from pytest_forkd.image import ensure_container_image
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

FORKD = str(Path(sys.executable).parent / "forkd")


def forkd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FORKD, *args], capture_output=True, text=True, timeout=600)


# What the guest reports of the busybox image: one "key=value" line per fact.
FACTS_SCRIPT = r"""
echo "cwd=$(pwd)"
echo "greeting=$GREETING"
echo "image=$FORKD_IMAGE"
for path in {absent}; do [ -e "$path" ] || [ -L "$path" ] && echo "present=$path"; done
for path in {files}; do echo "file:$path=$(cat "$path" | tr '\n' '|')"; done
echo "links=$(stat -c '%i:%h' {hardlinks} | tr '\n' ' ')"
for path in {symlinks}; do echo "symlink:$path=$(readlink "$path")"; done
echo "setuid=$(stat -c '%a' {setuid})"
echo "owned=$(stat -c '%u:%g' {owned})"
echo "home=$(stat -c '%u:%g' {home})"
command -v python3 || echo "python=none"
"""


def facts_script() -> str:
    return FACTS_SCRIPT.format(
        absent=" ".join(BUSYBOX_FACTS["absent"]),
        files=" ".join(BUSYBOX_FACTS["files"]),
        hardlinks=" ".join(BUSYBOX_FACTS["hardlinks"]),
        symlinks=" ".join(BUSYBOX_FACTS["symlinks"]),
        setuid=BUSYBOX_FACTS["setuid"],
        owned=BUSYBOX_FACTS["owned"][0],
        home=BUSYBOX_FACTS["home"][0],
    )


def test_forkd_exec_runs_a_busybox_only_image_exactly_as_its_layers_and_config_say(busybox_image: str) -> None:
    result = forkd("exec", "--image", busybox_image, "--", "sh", "-c", facts_script())
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    facts = dict(line.split("=", 1) for line in lines if "=" in line)
    assert facts["cwd"] == BUSYBOX_FACTS["working_dir"]
    assert facts["greeting"] == "hello from the image" and facts["image"] == "busybox-only"
    assert not [line for line in lines if line.startswith("present=")], "whiteouts and opaque dirs hide these"
    for path, content in BUSYBOX_FACTS["files"].items():
        assert facts[f"file:{path}"] == content.replace("\n", "|")
    inodes = {entry.split(":")[0] for entry in facts["links"].split()}
    assert len(inodes) == 1 and all(entry.endswith(":2") for entry in facts["links"].split()), facts["links"]
    for path, target in BUSYBOX_FACTS["symlinks"].items():
        assert facts[f"symlink:{path}"] == target
    assert facts["setuid"] == "4755"
    _, uid, gid = BUSYBOX_FACTS["owned"]
    assert facts["owned"] == f"{uid}:{gid}"
    assert facts["home"] == "1000:1000"
    assert facts["python"] == "none"


def test_an_image_user_runs_commands_as_that_user_and_exec_user_overrides_it(busybox_user_image: str) -> None:
    factory = VMFactory()
    try:
        vm = factory.boot(busybox_user_image)
        assert vm.exec("id -u; id -g; echo $HOME").stdout.split() == ["1000", "1000", "/home/app"]
        assert vm.exec(["id", "-u"], user="root").stdout.strip() == "0"
        assert vm.exec("id -u; id -g", user="1234:5").stdout.split() == ["1234", "5"]
        with pytest.raises(AgentError, match="unable to find user nobody-here"):
            vm.exec("true", user="nobody-here")
    finally:
        factory.close()


@pytest.fixture(scope="module")
def busybox_base(busybox_image: str) -> Iterator[tuple[VMFactory, Snapshot]]:
    factory = VMFactory()
    try:
        root = factory.boot(busybox_image)
        root.exec("echo parent > /srv/work/state")
        base = root.freeze("container-busybox", keep_running=False)
        yield factory, base
        SnapshotStore(base.path.parent).remove(base.tag, cascade=True)
    finally:
        factory.close()


def test_children_of_an_image_are_isolated_and_a_checkpoint_rolls_back_the_image_root(
    busybox_base: tuple[VMFactory, Snapshot],
) -> None:
    factory, base = busybox_base
    first, second = factory.fork_snapshot(base, 2)
    try:
        assert first.exec("cat /srv/work/state").stdout == "parent\n"
        first.exec("echo first > /srv/work/state; rm /etc/motd", check=True)
        assert second.exec("cat /srv/work/state /etc/motd").stdout == "parent\nlayer 3 replaced this\n"
        checkpoint = second.checkpoint()
        second.exec("rm -rf /bin/busybox /opt", check=False)
        assert second.exec(["/bin/busybox", "true"]).exit_code != 0
        checkpoint.rollback()
        assert second.exec("cat /etc/motd; ls /opt").stdout.startswith("layer 3 replaced this\n")
    finally:
        first.close()
        second.close()


def test_images_pulled_before_run_with_the_registry_stopped_and_always_names_it(
    private_registry: Registry, tmp_path: Path
) -> None:
    reference = private_registry.reference("forkd-tests/offline:1")
    push(write_busybox_image(tmp_path / "layout", tag="1"), reference)
    ensure_container_image(reference)
    with private_registry.stopped():
        result = forkd("exec", "--image", reference, "--", "cat", "/etc/motd")
        assert result.returncode == 0, result.stderr
        assert result.stdout == "layer 3 replaced this\n"
        with pytest.raises(ImageError, match=private_registry.host):
            ensure_container_image(reference, policy="always")


def test_bad_references_fail_in_one_line_and_a_good_pull_works_afterwards(busybox_image: str) -> None:
    registry_host = busybox_image.removeprefix("docker://").split("/", 1)[0]
    unknown_tag = forkd("exec", "--image", f"docker://{registry_host}/forkd-tests/busybox:missing", "--", "true")
    assert unknown_tag.returncode == 1
    assert "Traceback" not in unknown_tag.stderr and "missing" in unknown_tag.stderr
    malformed = forkd("exec", "--image", "docker://UPPER/Case", "--", "true")
    assert malformed.returncode == 4 and "Traceback" not in malformed.stderr
    good = forkd("exec", "--image", busybox_image, "--", "sh", "-c", shlex.quote("true") + " && echo ok")
    assert good.returncode == 0 and good.stdout == "ok\n", good.stderr


def test_forkd_exec_reads_a_bare_reference_as_forkd_image_does_and_names_an_unknown_transport(
    busybox_image: str,
) -> None:
    bare = busybox_image.removeprefix("docker://")  # 127.0.0.1:PORT/forkd-tests/busybox:1
    result = forkd("exec", "--image", bare, "--", "cat", "/etc/motd")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "layer 3 replaced this\n"
    typo = forkd("exec", "--image", f"dokcer://{bare}", "--", "true")
    assert typo.returncode == 4 and "Traceback" not in typo.stderr
    assert "unknown transport 'dokcer'" in typo.stderr and "docker://, oci:, oci-archive:" in typo.stderr


# -- an image that points its names out of its root, carries a device node and runs as a user -----------------

#: The image's traps for /init: absolute symlinks where init writes or mounts, a device node anyone may open.
GUARDED_LINKS = {
    "etc/resolv.conf": "/run/systemd/resolve/stub-resolv.conf",  # as systemd images have it
    "tmp": "/opt/forkd",  # followed from outside the root, init's chmod would open forkd's own agent folder
    "proc": "/opt/forkd",  # and a mount would land on it
}


@pytest.fixture(scope="module")
def guarded_vm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VM, Path]]:
    """One VM (default memory, a network card) of a busybox image with :data:`GUARDED_LINKS` and User app.

    Booted from an ``oci:`` layout, so the image's reference is a path of this host; the layout is yielded too.
    """
    from oci_images import LayerTar, busybox_config, busybox_layers, write_layout

    traps = LayerTar().dir("opt/forkd", mode=0o755).dir("opt/devices")
    traps.device("opt/devices/null", "char", 1, 3, mode=0o666)  # /dev/null's numbers, open to everyone
    traps.whiteout("tmp")
    for name, target in GUARDED_LINKS.items():
        traps.symlink(name, target)
    layout = tmp_path_factory.mktemp("guarded-image") / "layout"
    written = write_layout(layout, [*busybox_layers(), (traps, "gzip")], config=busybox_config(user="app"), tag="1")
    factory = VMFactory()
    try:
        yield factory.boot(written.reference, network="host"), layout
    finally:
        factory.close()


def test_init_keeps_its_writes_and_mounts_inside_an_image_whose_names_are_absolute_symlinks(
    guarded_vm: tuple[VM, Path],
) -> None:
    vm, layout = guarded_vm
    facts = vm.exec(
        "stat -c '%F' /etc/resolv.conf /proc; cat /etc/resolv.conf; readlink /tmp; stat -c '%a' /opt/forkd;"
        " stat -c '%a' /.forkd/opt/forkd; test -e /.forkd/run/systemd && echo escaped; cat /proc/self/comm",
        user="root",
    )
    assert facts.exit_code == 0, facts.stderr
    lines = facts.stdout.splitlines()
    assert lines[:5] == [
        "regular file",  # the image's link replaced, inside its root, with the guest's resolver
        "directory",  # a mount point of the image root, not the image's link to /opt/forkd
        "nameserver 10.0.2.3",
        "/opt/forkd",  # the image's own /tmp link is kept...
        "1777",  # ...and resolved inside the image root
    ]
    assert lines[5] != "1777", "init's chmod reached forkd's runtime (the initramfs) through the image's link"
    assert lines[6:] == ["cat"]  # procfs mounted on the image's /proc
    # No path of this host reaches the guest: the oci: layout's folder is nowhere in what init copied (the disk is
    # shared by digest, so it may come from an earlier run: none of the runs' folders may show).
    image_json = vm.exec(["cat", "/.forkd/etc/forkd/image.json"], user="root")
    assert image_json.exit_code == 0, image_json.stderr
    assert str(layout.parents[2]) not in image_json.stdout, image_json.stdout
    # The agent's use of image.json stands: the image's User, WorkingDir and Env.
    who = vm.exec("id -un; pwd; echo $GREETING")
    assert who.stdout.splitlines() == ["app", BUSYBOX_FACTS["working_dir"], "hello from the image"]


def test_a_device_node_of_the_image_opens_for_nobody(guarded_vm: tuple[VM, Path]) -> None:
    vm, _ = guarded_vm
    listed = vm.exec("stat -c '%F %a %t:%T' /opt/devices/null")
    assert listed.stdout == "character special file 666 1:3\n"  # kept in the image as it was
    for user in ("app", "root"):
        opened = vm.exec("echo x > /opt/devices/null", user=user)
        assert opened.exit_code != 0 and "Permission denied" in opened.stderr, (user, opened)
    assert vm.exec("echo x > /dev/null && echo ok").stdout == "ok\n"  # the kernel's own nodes work


def test_a_50_mib_file_written_as_the_images_user_at_the_default_memory(guarded_vm: tuple[VM, Path]) -> None:
    import hashlib
    import os

    vm, _ = guarded_vm
    assert vm.memory_mib == 256
    data = os.urandom(50 << 20)
    for _ in range(2):  # written twice: in place, the second write replaces the first without a copy
        vm.write_file("/home/app/large.bin", data, user="app")
    described = vm.exec("stat -c '%s %U %G' /home/app/large.bin; sha256sum /home/app/large.bin")
    assert described.exit_code == 0, described.stderr
    size_owner, digest = described.stdout.splitlines()
    assert size_owner == f"{len(data)} app app"
    assert digest.split()[0] == hashlib.sha256(data).hexdigest()
    refused = vm.exec("touch /etc/by-app")  # the image's user, not root: /etc is root's
    assert refused.exit_code != 0
    with pytest.raises(GuestOSError) as denied:
        vm.write_file("/etc/by-app", data[: 2 << 20], user="app")
    assert denied.value.errno == 13 and vm.exec("test -e /etc/by-app", user="root").exit_code == 1
