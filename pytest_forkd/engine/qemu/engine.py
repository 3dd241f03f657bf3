"""The QEMU engine: forkd's :class:`~pytest_forkd.engine.base.Engine` on QEMU ``microvm``.

It resolves the accelerator (KVM where it works, else TCG, cached per host),
builds guest images on first use, and starts :class:`~.machine.Machine`
processes: a booted root VM maps a fresh RAM file shared, a restored child
maps its snapshot's memory file copy-on-write with a stub kernel (children
never boot) and waits for its device state (``-incoming defer``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pytest_forkd.engine.base import AcceleratedEngine, Capabilities, ProbeBoot
from pytest_forkd.engine.memory import pagemap_scan_problem
from pytest_forkd.engine.network import NetworkSpec
from pytest_forkd.engine.qemu.accel import PROBE_TIMEOUT_S, AccelVerdict, resolve_accel, validate_accel
from pytest_forkd.engine.qemu.host import Qemu, find_qemu, userfaultfd_problem
from pytest_forkd.engine.qemu.machine import Machine, MachineSpec, boot_kernel
from pytest_forkd.errors import ForkdError

#: Memory of the KVM probe VM when the image's initramfs needs no more.
PROBE_MEMORY_MIB = 128


class QemuEngine:
    """Starts QEMU ``microvm`` machines; one per factory (the accelerator verdict is kept here)."""

    name = "qemu"

    def __init__(self, *, accel: str = "auto") -> None:
        self.requested_accel = validate_accel(accel)
        self._qemu: Qemu | None = None
        self._verdict: AccelVerdict | None = None

    # -- host facts -----------------------------------------------------------------
    @property
    def qemu(self) -> Qemu:
        """The QEMU binary and version (HostNotReady with the fix when missing or too old)."""
        if self._qemu is None:
            self._qemu = find_qemu()
        return self._qemu

    @staticmethod
    def host_capabilities() -> Capabilities:
        """What QEMU can do on this host, without starting it."""
        dirty = pagemap_scan_problem()
        uffd = userfaultfd_problem()
        reasons = {}
        if dirty:
            reasons["dirty_page_tracking"] = dirty
        if uffd:
            reasons["live_snapshot"] = reasons["uffd_write_protect"] = uffd
        return Capabilities(
            live_snapshot=uffd is None,
            dirty_page_tracking=dirty is None,
            uffd_write_protect=uffd is None,
            incoming_restore=True,
            network=True,
            memory_remap=True,
            memory_file_layout="file",
            reasons=reasons,
            engine="qemu",
        )

    def capabilities(self) -> Capabilities:
        return self.host_capabilities()

    def unavailable_reason(self) -> str | None:
        try:
            _ = self.qemu
        except ForkdError as exc:
            return str(exc)
        return None

    def accel_verdict(self, image: Any, probe: ProbeBoot | None = None) -> AccelVerdict:
        """KVM or TCG for this host; ``probe`` boots a throwaway KVM machine when the verdict is not cached."""
        if self._verdict is None:

            def probe_kvm() -> None:
                if probe is None:
                    raise ForkdError("no probe boot was given")
                # The caller raises the memory to what the image needs (see ProbeBoot).
                probe(
                    MachineSpec(
                        qemu=self.qemu,
                        accel="kvm",
                        memory_mib=PROBE_MEMORY_MIB,
                        vcpus=1,
                        kernel_args=tuple(image.kernel_args),
                    ),
                    PROBE_TIMEOUT_S,
                )

            self._verdict = resolve_accel(self.requested_accel, self.qemu, probe_kvm)
        return self._verdict

    # -- images -------------------------------------------------------------------
    def image(self, name: str, *, progress: Callable[[str], None] | None = None) -> Any:
        from pytest_forkd.image import ensure_image

        return ensure_image(name, progress=progress)

    def image_for(self, name: str, key: str | None) -> Any:
        from pytest_forkd.image import load_image
        from pytest_forkd.image.catalog import image_at, image_directory, is_published

        if key and is_published(key):
            return image_at(name, image_directory(key))
        return load_image(name)  # the fingerprint check then explains a mismatch

    # -- machines -----------------------------------------------------------------
    def machine_spec(
        self, image: Any, *, memory_mib: int, vcpus: int, network_card: bool = False, probe: ProbeBoot | None = None
    ) -> MachineSpec:
        return MachineSpec(
            qemu=self.qemu,
            accel=self.accel_verdict(image, probe).accel,
            memory_mib=memory_mib,
            vcpus=vcpus,
            kernel_args=tuple(image.kernel_args),
            network_card=network_card,
            disk=getattr(image, "disk", None),
        )

    def fingerprint(self, image: Any, spec: MachineSpec) -> dict[str, str]:
        fingerprint = {"qemu": spec.qemu.version, "machine": spec.fingerprint(), "image": image.key}
        if getattr(image, "digest", None):  # a container image: the snapshot records what it was made of
            fingerprint["image_digest"] = image.digest
        if spec.accel == "kvm":  # -cpu host: the guest saw this CPU's features; another CPU must refuse it
            from pytest_forkd.engine.cpu import host_cpu_id

            fingerprint["host_cpu"] = host_cpu_id()
        return fingerprint

    def machine_record(self, spec: MachineSpec) -> dict[str, Any]:
        return spec.record()

    def boot(
        self,
        spec: MachineSpec,
        image: Any,
        *,
        directory: Path,
        name: str,
        ram_path: Path,
        network: NetworkSpec | None = None,
    ) -> Machine:
        return Machine.launch(
            spec,
            directory,
            name,
            kernel=boot_kernel(spec.qemu, image.kernel, image.bzimage),
            initrd=image.initrd,
            ram_path=ram_path,
            share=True,
            owns_ram=True,
            network=network,
        )

    def restore(
        self,
        spec: MachineSpec,
        image: Any,
        *,
        directory: Path,
        name: str,
        memory_file: Path,
        network: NetworkSpec | None = None,
    ) -> Machine:
        return Machine.launch(
            spec,
            directory,
            name,
            kernel=image.stub_kernel,
            initrd=image.stub_initrd,
            ram_path=memory_file,
            share=False,
            owns_ram=False,
            incoming=True,
            network=network,
        )

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"engine": self.name, "version": self.qemu.version}
        if self._verdict is not None:
            facts.update(accel=self._verdict.accel, accel_reason=self._verdict.reason)
        return facts


def _is_an_engine(engine: QemuEngine) -> AcceleratedEngine[MachineSpec, Any]:
    """Never called: mypy checks here that QemuEngine has the engine interface (engine/base.py)."""
    return engine
