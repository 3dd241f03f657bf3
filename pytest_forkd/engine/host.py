"""Facts about this host that the CLI, the plugin and the reports ask about, named once for all of them.

Which accelerators a run may ask for, what was found out about KVM, the
hypervisor binary and its version, the host checks ``forkd doctor`` runs:
the machine a snapshot archive describes. The modules above the engine ask
here rather than reaching into the QEMU engine's modules, so that those stay
the engine's own business.
"""

from __future__ import annotations

from pytest_forkd.engine.memory import filesystem_type, pagemap_scan_problem
from pytest_forkd.engine.qemu.accel import ACCELS, AccelVerdict, cached_verdict
from pytest_forkd.engine.qemu.host import (
    KVM_DEVICE,
    MACHINE_TYPE,
    MIN_QEMU_VERSION,
    QEMU_PACKAGE,
    Qemu,
    find_qemu,
    kvm_access_problem,
    machine_type_problem,
    tsc_khz,
    userfaultfd_problem,
)
from pytest_forkd.engine.qemu.machine import has_network_card, machine_record, machine_record_of_hash

__all__ = [
    "ACCELS",
    "KVM_DEVICE",
    "MACHINE_TYPE",
    "MIN_QEMU_VERSION",
    "QEMU_PACKAGE",
    "AccelVerdict",
    "Qemu",
    "cached_verdict",
    "filesystem_type",
    "find_qemu",
    "has_network_card",
    "kvm_access_problem",
    "machine_record",
    "machine_record_of_hash",
    "machine_type_problem",
    "pagemap_scan_problem",
    "tsc_khz",
    "userfaultfd_problem",
]
