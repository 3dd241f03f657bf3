"""Which compose keys forkd honours, accepts without meaning, warns about, or refuses.

Every key of a compose service falls in exactly one of these tables (a key in
none is one Compose does not know either, refused as a typo), so what forkd
does with a compose file is never a guess:

- :data:`HONOURED`: applied as Docker applies it;
- :data:`NO_MEANING`: about how Docker manages a container, or already what a
  VM gives (its root has every capability and device): listed once at INFO;
- :data:`NOT_HONOURED`: they change what the sample sees and forkd does not
  give them: named once in a WARNING;
- :data:`UNSUPPORTED`: a meaning a VM cannot give: refused with one line
  saying what to do instead.

``tests/integrations/test_compose_config.py`` checks that the tables do not
overlap and that the docs list the same keys.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BUILD_HONOURED",
    "BUILD_NO_MEANING",
    "HONOURED",
    "NOT_HONOURED",
    "NO_MEANING",
    "TOP_LEVEL",
    "UNSUPPORTED",
]

#: Service keys forkd applies (their meaning is in :class:`ComposeService`).
HONOURED: Final = frozenset(
    {
        "image",
        "build",
        "working_dir",
        "environment",
        "env_file",
        "user",
        "mem_limit",
        "cpus",
        "network_mode",
        "networks",
        "deploy",
        "platform",
        "command",
        "entrypoint",
        "healthcheck",
        "tty",
        "stdin_open",
        "scale",
    }
)
#: Service keys about how Docker manages a container, or that a VM gives anyway: accepted, listed once at INFO.
NO_MEANING: Final = frozenset(
    {
        "annotations",
        "attach",
        "blkio_config",
        "cap_add",
        "cgroup",
        "cgroup_parent",
        "container_name",
        "cpu_count",
        "cpu_percent",
        "cpu_period",
        "cpu_quota",
        "cpu_rt_period",
        "cpu_rt_runtime",
        "cpu_shares",
        "cpuset",
        "credential_spec",
        "develop",
        "expose",
        "init",
        "isolation",
        "labels",
        "label_file",
        "logging",
        "mac_address",
        "mem_reservation",
        "mem_swappiness",
        "memswap_limit",
        "oom_kill_disable",
        "oom_score_adj",
        "ports",
        "privileged",
        "profiles",
        "pull_policy",
        "pull_refresh_after",
        "restart",
        "stop_grace_period",
        "stop_signal",
        "volumes",
    }
)
#: Service keys that change what the sample sees and that forkd does not give: accepted, named in a WARNING.
NOT_HONOURED: Final = frozenset(
    {
        "cap_drop",
        "device_cgroup_rules",
        "devices",
        "dns",
        "dns_opt",
        "dns_search",
        "domainname",
        "extra_hosts",
        "gpus",
        "group_add",
        "hostname",
        "ipc",
        "pid",
        "pids_limit",
        "read_only",
        "runtime",
        "security_opt",
        "shm_size",
        "storage_opt",
        "sysctls",
        "tmpfs",
        "ulimits",
        "use_api_socket",
        "userns_mode",
        "uts",
    }
)
#: Service keys whose meaning a VM cannot give (yet), and what to do instead.
UNSUPPORTED: Final = {
    "configs": "mount the files with the sample's files or COPY them in a Dockerfile",
    "secrets": "mount the files with the sample's files or COPY them in a Dockerfile",
    "depends_on": "forkd starts the default service only; remove the dependency",
    "links": "forkd starts the default service only; remove the link",
    "external_links": "forkd starts the default service only; remove the link",
    "extends": "write the service out in full",
    "volumes_from": "forkd starts the default service only; COPY the files in a Dockerfile",
    "post_start": "run the commands in the sample's setup instead",
    "pre_stop": "remove it (a sample's VM is killed, not stopped)",
    "provider": "give the service an image or a build",
    "models": "remove it",
}
#: Top-level keys of a compose file.
TOP_LEVEL: Final = frozenset({"services", "volumes", "networks", "configs", "secrets", "name", "version", "include"})
#: Keys of a ``build:`` mapping that forkd applies.
BUILD_HONOURED: Final = frozenset({"context", "dockerfile", "args", "target", "platforms"})
#: Keys of a ``build:`` mapping that change nothing in the image forkd gets (cache and registry settings).
BUILD_NO_MEANING: Final = frozenset(
    {"cache_from", "cache_to", "labels", "network", "no_cache", "pull", "shm_size", "tags", "isolation", "privileged"}
)
