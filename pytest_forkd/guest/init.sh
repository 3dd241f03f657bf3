#!/bin/sh
# /init of a forkd guest: PID 1, run by busybox sh straight from the initramfs.
#
# It mounts the kernel filesystems, loads the virtio modules the agent's port
# needs, finds that port and keeps the agent running on it. Everything it
# prints goes to the console, which users see when a guest fails to start,
# so each failure says what is missing.

export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# Fix fds 0-2 before anything else: without a usable console the kernel
# starts init with them closed, and with `-serial none` ttyS0 still exists
# but every write to it fails with EIO, which kills programs that log (the
# agent). So probe the console with a real write; nobody types on it, so
# stdin is always /dev/null. devtmpfs provides /dev/console and /dev/null.
mount -t devtmpfs devtmpfs /dev 2>/dev/null
if (echo "forkd-init: started" >/dev/console) 2>/dev/null; then
    exec </dev/null >/dev/console 2>&1
else
    exec </dev/null >/dev/null 2>&1
fi

log() { echo "forkd-init: $*"; }

mount -t proc proc /proc
mount -t sysfs sysfs /sys
# The kernel sizes the initramfs root at half of guest memory, minus what the
# unpacked image already takes: about 48 MiB free in a 256 MiB guest, too
# little for a project tree copied in. Pages are only used once written, and
# every command runs under its cgroup's memory limit.
mount -o remount,size=75%,nr_inodes=65536 / 2>/dev/null || log "cannot grow the root filesystem; it stays at half of guest memory"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mkdir -p /dev/shm /dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
mount -t devpts -o gid=5,mode=620 devpts /dev/pts 2>/dev/null
# The agent runs each command in its own cgroup (memory, process count, kill
# on timeout); Debian's kernels have cgroup2 built in. favordynmods (Linux
# 6.1+) makes moving a process into a cgroup cheap: without it every move
# waits for an RCU grace period, about 10 ms per command under emulation.
mount -t cgroup2 -o nsdelegate,favordynmods cgroup2 /sys/fs/cgroup 2>/dev/null ||
    mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup ||
    log "cannot mount cgroup2 on /sys/fs/cgroup: commands run without memory and process limits"

hostname forkd
if command -v ip >/dev/null; then
    ip link set lo up
else
    ifconfig lo 127.0.0.1 up
fi

# The build wrote the modules' load order, dependencies first.
while read -r module; do
    insmod "/lib/modules/forkd/$module.ko" || log "cannot load kernel module $module"
done </etc/forkd/modules

# A network card exists only when the host started the VM with a network. It
# sits on QEMU's user-mode network: a static address (children restored from
# a snapshot keep it), slirp's gateway and its DNS relay.
if [ -d /sys/class/net/eth0 ]; then
    if command -v ip >/dev/null; then
        ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 && ip route add default via 10.0.2.2
    else
        ifconfig eth0 10.0.2.15 netmask 255.255.255.0 up && route add default gw 10.0.2.2
    fi || log "cannot configure the network card eth0"
    echo "nameserver 10.0.2.3" >/etc/resolv.conf
fi

# The host names its virtio-serial port "agent"; its device node is /dev/<port dir>.
# It appears shortly after virtio_console loads: wait for it, boundedly (500
# polls, 5-10 s under emulation), then give up loudly.
find_agent_port() {
    for name_file in /sys/class/virtio-ports/*/name; do
        [ -r "$name_file" ] || continue
        read -r port_name <"$name_file" || continue
        if [ "$port_name" = agent ]; then
            port_dir=${name_file%/name}
            port=/dev/${port_dir##*/}
            [ -c "$port" ] && return 0
        fi
    done
    return 1
}
port=
attempts=0
until find_agent_port; do
    attempts=$((attempts + 1))
    if [ "$attempts" -ge 500 ]; then
        log "no virtio-serial port named 'agent' appeared; start QEMU with" \
            "-device virtio-serial-device -device virtserialport,chardev=...,name=agent"
        log "virtio ports present: $(ls /sys/class/virtio-ports 2>/dev/null)"
        exit 1  # PID 1 exiting panics the kernel; with panic=-1 and -no-reboot QEMU exits
    fi
    sleep 0.01
done

export HOME=/root LANG=C.UTF-8
[ -r /etc/forkd/env ] && . /etc/forkd/env
cd /root || cd /

# The agent is imported rather than run as a script so that its byte-compiled
# form is used: a script is compiled at every start, which under emulation
# costs about 0.1 s. -I: the agent neither reads PYTHON* variables meant for
# the user's commands nor imports from the working directory; -S: it needs
# no site-packages, and importing site costs about as much again.
while :; do
    echo "forkd-agent: starting on $port"
    /usr/bin/python3 -I -S -c 'import sys; sys.path.insert(0, "/opt/forkd"); import agent; sys.exit(agent.main())' "$port"
    echo "forkd-agent: exited with status $?; restarting in 0.1 s"
    sleep 0.1
done
