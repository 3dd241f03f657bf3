"""Assemble the guest's root tree: unpacked packages, busybox applets, the agent, /init.

The tree becomes the initramfs, so it is the whole guest filesystem: it lives
in RAM in every VM and in every memory snapshot, and the kernel copies every
byte of it into place at each cold boot, which under TCG emulation costs
5-10 ms per MB. What the guest never reads (documentation, translations,
iconv modules, the parts of Python's standard library that serve only its
own test suite or a desktop) is dropped, and the Python standard library is
byte-compiled here, its sources dropped (see :func:`byte_compile`), because
Debian ships no .pyc files and compiling imports under TCG emulation doubles
the agent's start time (DESIGN.md section 3b).
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import stat
import subprocess
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable, Mapping

from ..errors import ImageError
from ..guest import agent_files
from .deb import unpack
from .kernel import IMAGE_MODULES, KernelParts
from .recipe import FileSpec

AGENT_DIR = "opt/forkd"
MODULES_DIR = "lib/modules/forkd"
CONFIG_DIR = "etc/forkd"
MULTIARCH = "x86_64-linux-gnu"
# Never read in the guest. gconv holds glibc's iconv charset modules (8 MB, a
# seventh of the image); Python has its own codecs and never loads them.
# Debian's sitecustomize only tries to import apport's crash hook, a failed
# import that every Python start would pay for.
PRUNED_PATHS = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/locale",
    "usr/share/info",
    "usr/share/lintian",
    f"usr/lib/{MULTIARCH}/gconv",
    "etc/python3*/sitecustomize.py",
    "usr/lib/python3*/sitecustomize.py",
)
# Parts of the standard library (globs under usr/lib/python3.X) that only
# CPython's own test suite, an interactive help() or a desktop would use.
PRUNED_PYTHON_LIBRARY = (
    "test",  # the regression-test package; unittest and doctest stay
    "pydoc_data",  # help() topic texts (1.2 MB); pydoc says they are not available
    "turtle.py",  # draws with tkinter, which the image does not have
    "_pydecimal.py",  # decimal's pure-Python fallback; the C _decimal is there
    "lib-dynload/_test*",
    "lib-dynload/_ctypes_test.*",
    "lib-dynload/_xxtestfuzz.*",
    "lib-dynload/xxlimited*",
)
# The guest's layout is merged /usr whatever the release: Debian 13 packages
# ship their files under usr/ only and rely on these links, Debian 12 packages
# still ship /bin and /lib paths, which land in usr/ through them.
MERGED_USR_LINKS = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
# Mount points and home that init expects; device nodes are added by the archive writer.
SKELETON_DIRS = ("dev", "proc", "sys", "tmp", "run", "root", "mnt", CONFIG_DIR, MODULES_DIR, AGENT_DIR)


def guest_files() -> dict[str, Path]:
    """The package's files that run inside the guest, by their name in the guest.

    They are part of the image key: editing the agent or init rebuilds the image.
    """
    guest_package = resources.files("pytest_forkd.guest")
    files = {**agent_files(), "init.sh": Path(str(guest_package / "init.sh"))}
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        raise ImageError(
            f"the guest files {', '.join(missing)} are missing from the installed pytest-forkd; "
            "reinstall it (pip install --force-reinstall pytest-forkd)"
        )
    return files


def assemble_root(
    root: Path,
    debs: Iterable[Path],
    kernel: KernelParts,
    files: Iterable[FileSpec],
    env: Mapping[str, str],
    progress: Callable[[str], None],
    python_version: str | None = None,
) -> None:
    """Fill ``root`` with everything the guest needs, ready to be archived.

    ``python_version`` ("3.11") is the interpreter the packages provide, as
    read from the release's index; None takes the newest one found.
    """
    debs, files = list(debs), list(files)
    progress(f"unpacking {len(debs)} packages")
    make_merged_usr(root)
    for deb in debs:
        unpack(deb, root)
    prune(root, PRUNED_PATHS)
    packaged = tree_paths(root)
    for directory in SKELETON_DIRS:
        (root / directory).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    os.chmod(root / "root", 0o700)

    install_busybox_links(root)
    use_static_bash(root)
    python = link_python3(root, python_version)
    prune(root / "usr" / "lib" / python.name, PRUNED_PYTHON_LIBRARY)
    install_modules(root, kernel)
    write_env_file(root / CONFIG_DIR / "env", env)

    sources = guest_files()
    for name in agent_files():
        (root / AGENT_DIR / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sources[name], root / AGENT_DIR / name)
    shutil.copyfile(sources["init.sh"], root / "init")
    os.chmod(root / "init", 0o755)

    install_recipe_files(root, files)

    progress("byte-compiling the guest's Python library")
    byte_compile(root, python)
    open_builder_modes(root, keep=packaged | {"root", "tmp"} | {spec.dest.strip("/") for spec in files if spec.mode})


def tree_paths(root: Path) -> set[str]:
    """Every path under ``root``, relative to it."""
    found: set[str] = set()
    for directory, subdirectories, names in os.walk(root):
        for name in (*subdirectories, *names):
            found.add(os.path.relpath(os.path.join(directory, name), root))
    return found


def open_builder_modes(root: Path, *, keep: set[str]) -> None:
    """Give what the builder itself created the modes a 022 umask would: read (and search) for everyone.

    forkd builds its cache under umask 077 (its files are the user's alone),
    and that umask is the whole process's: without this, the directories,
    agent files and byte-compiled library the builder makes would reach the
    guest as 0700/0600, and every non-root user in the guest would find
    Python unable to import its own standard library. The packages' own
    files (``keep``: unpacked with the modes their .deb records) and a
    recipe file given an explicit mode are left as they are.
    """
    for relative in sorted(tree_paths(root) - keep):
        path = root / relative
        status = path.lstat()
        if stat.S_ISLNK(status.st_mode):
            continue
        mode = stat.S_IMODE(status.st_mode)
        if mode & 0o077 == 0:
            readable = mode & 0o500
            os.chmod(path, mode | readable >> 3 | readable >> 6)


def prune(directory: Path, patterns: Iterable[str]) -> None:
    """Remove what matches the glob ``patterns`` under ``directory``: files, links and whole trees.

    glob.glob rather than Path.glob: links into the guest's tree (absolute
    targets) dangle on the host, and Path.glob skips dangling links.
    """
    for pattern in patterns:
        for match in glob.glob(glob.escape(str(directory)) + "/" + pattern):
            path = Path(match)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def install_recipe_files(root: Path, files: Iterable[FileSpec]) -> None:
    """Copy the recipe's host files in, replacing whatever the packages put there."""
    for spec in files:
        target = root / spec.dest.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():  # e.g. a busybox applet: replace the link, never write through it
            target.unlink()
        elif target.is_dir():
            raise ImageError(f"the recipe copies {spec.src} to {spec.dest}, which is a directory in the image")
        shutil.copy2(spec.src, target)
        if spec.mode is not None:
            os.chmod(target, spec.mode)


def make_merged_usr(root: Path) -> None:
    """Create usr/{bin,sbin,lib,lib64} and the top-level links to them."""
    for name, target in MERGED_USR_LINKS.items():
        (root / target).mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(target)
    for directory in ("usr", *MERGED_USR_LINKS.values()):
        os.chmod(root / directory, 0o755)  # the guest's view, whatever the builder's umask


def find_busybox(root: Path) -> Path:
    """Busybox wherever its package put it (/bin in Debian 12, /usr/bin in Debian 13, or sbin)."""
    for directory in ("usr/bin", "usr/sbin", "bin", "sbin"):
        candidate = root / directory / "busybox"
        if candidate.is_file():
            return candidate
    raise ImageError(
        "the image has no busybox (looked in /usr/bin, /usr/sbin, /bin, /sbin); the guest's /init needs it: "
        "keep busybox-static in the recipe's packages"
    )


def install_busybox_links(root: Path) -> None:
    """Symlink every busybox applet (sh, mount, insmod...) that no package already provides."""
    busybox = find_busybox(root)
    guest_path = "/" + busybox.relative_to(root).as_posix()
    listing = subprocess.run([str(busybox), "--list-full"], capture_output=True, text=True, check=False)
    if listing.returncode != 0:
        raise ImageError(f"cannot list busybox applets ({busybox} --list-full): {listing.stderr.strip()}")
    for applet in listing.stdout.split():
        link = root / applet
        if os.path.lexists(link):
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(guest_path)


def use_static_bash(root: Path) -> None:
    """Make /usr/bin/bash Debian's statically linked bash when the image has it (package bash-static).

    Same bash, same version; only the dynamic loader's work at every start is
    gone, which under TCG is most of a short command's cost (the default
    recipe says what was measured). The dynamically linked binary is dropped,
    so the image carries one bash.
    """
    static = root / "usr/bin/bash-static"
    if not static.is_file():
        return
    bash = root / "usr/bin/bash"
    if os.path.lexists(bash):
        bash.unlink()
    bash.symlink_to(static.name)


def link_python3(root: Path, version: str | None = None) -> Path:
    """Point /usr/bin/python3 at the image's interpreter, unless a package (python3-minimal) already does.

    ``version`` ("3.11") is the one the release's packages name; without it
    the newest interpreter in the tree is taken.
    """
    interpreters = sorted(
        (path for path in (root / "usr" / "bin").glob("python3.*") if path.name[len("python3.") :].isdigit()),
        key=lambda path: int(path.name[len("python3.") :]),
    )
    if version is not None:
        interpreters = [path for path in interpreters if path.name == f"python{version}"]
    if not interpreters:
        raise ImageError(
            f"the image has no Python interpreter (usr/bin/python{version or '3.X'}); the agent needs one: "
            "keep python3-minimal and libpython3-stdlib in the recipe's packages"
        )
    python = interpreters[-1]
    link = root / "usr" / "bin" / "python3"
    if not os.path.lexists(link):
        link.symlink_to(python.name)
    return python


def install_modules(root: Path, kernel: KernelParts) -> None:
    """Copy the modules and write their load order, one name per line, for /init.

    The modules of a container image's disk go to a list of their own, which
    /init loads only when the VM boots an image (after the others, which they
    depend on): every other boot is spared them.
    """
    names = []
    for module in kernel.modules:
        shutil.copyfile(module, root / MODULES_DIR / module.name)
        names.append(module.stem)
    image_names = [name for name in names if name in IMAGE_MODULES]
    (root / CONFIG_DIR / "modules").write_text("".join(f"{name}\n" for name in names if name not in image_names))
    (root / CONFIG_DIR / "modules.image").write_text("".join(f"{name}\n" for name in image_names))


def write_env_file(path: Path, env: Mapping[str, str]) -> None:
    """The recipe's environment as a shell snippet that /init sources before starting the agent."""
    path.write_text("".join(f"export {name}={shlex.quote(value)}\n" for name, value in sorted(env.items())))


def byte_compile(root: Path, python: Path) -> None:
    """Compile the guest's Python files with the guest's own interpreter, run on the host.

    The interpreter is started through the tree's dynamic loader with the
    tree's libraries, so the result does not depend on the host's Python.
    The .pyc files record guest paths (``-s root -p /``) and use unchecked
    hashes, so no source timestamp check can invalidate them in the guest.

    The standard library is left without its sources: each module's .pyc
    takes the place of its .py (Python imports such "sourceless" files),
    which spares every cold boot copying 9 MB that only tracebacks read.
    A traceback through the standard library still names the file, line
    and function; it just cannot quote the line. Packages and the agent
    keep their sources, in ``__pycache__`` as usual.
    """
    library = root / "usr" / "lib" / python.name
    _compileall(root, python, [library], sourceless=True)
    remove_compiled_sources(library)
    _compileall(
        root, python, [path for path in (root / "usr/lib/python3/dist-packages", root / AGENT_DIR) if path.is_dir()]
    )


def remove_compiled_sources(directory: Path) -> None:
    """Delete each X.py under ``directory`` that has an X.pyc beside it; sources that did not compile stay."""
    for compiled in directory.rglob("*.pyc"):
        compiled.with_suffix(".py").unlink(missing_ok=True)


def _compileall(root: Path, python: Path, targets: list[Path], *, sourceless: bool = False) -> None:
    if not targets:
        return  # compileall without targets would compile its own sys.path
    loader = root / "lib" / MULTIARCH / "ld-linux-x86-64.so.2"
    if not loader.is_file():
        raise ImageError(f"the image has no dynamic loader at {loader}; keep libc6 in the image")
    library_path = f"{root / 'lib' / MULTIARCH}:{root / 'usr/lib' / MULTIARCH}"
    # compileall's worker processes start the interpreter again by its path
    # (Python 3.13 uses a forkserver), which would run it with the host's C
    # library: point multiprocessing at a launcher that goes through the
    # tree's loader too.
    launcher = root.parent / f".{root.name}-python"
    launcher.write_text(
        "#!/bin/sh\n"
        f"exec {shlex.quote(str(loader))} --library-path {shlex.quote(library_path)} "
        f'{shlex.quote(str(python))} "$@"\n'
    )
    launcher.chmod(0o755)
    arguments = [
        "compileall",
        "-q",
        "-j0",
        *(["-b"] if sourceless else []),  # X.pyc beside X.py instead of __pycache__/X.cpython-3N.pyc
        "-s",
        str(root),
        "-p",
        "/",
        "--invalidation-mode",
        "unchecked-hash",
        *map(str, targets),
    ]
    program = (
        "import compileall, multiprocessing, sys; "
        f"multiprocessing.set_executable({str(launcher)!r}); "
        f"sys.argv = {arguments!r}; "
        "sys.exit(int(not compileall.main()))"
    )
    command = [str(launcher), "-S", "-c", program]
    completed = subprocess.run(
        command,
        env={"PYTHONHOME": str(root / "usr"), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        capture_output=True,
        text=True,
        check=False,
    )
    if completed.returncode != 0:
        output = (completed.stdout + completed.stderr).strip()[-2000:]
        raise ImageError(f"byte-compiling the guest's Python library failed: {output}")
