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
load_modules() {
    while read -r module; do
        insmod "/lib/modules/forkd/$module.ko" || log "cannot load kernel module $module"
    done <"$1"
}
load_modules /etc/forkd/modules

# A container image: the host attached its read-only disk (virtio-blk) and put
# forkd.image on the command line. The image's root becomes an overlay (the disk
# below, guest memory above, so snapshots stay memory-only), and the agent runs
# inside it with its own runtime, this initramfs, bind-mounted at /.forkd.
#
# The image is not trusted: any name in it may be a symlink, and an absolute
# one would take init's writes and mounts out of the image root (into this
# initramfs, the agent's own runtime). So a mount point is made a directory of
# the image root itself, replacing whatever link the image put there, and every
# other write goes through in_image: busybox chrooted in the image root, where
# symlinks resolve inside it. Device nodes in an image give nobody a device
# (nodev on every mount made of the image), as Docker's device cgroup denies them.
IMAGE_ROOT=
# mount_point NAME: $IMAGE_ROOT/NAME as a directory of the image root (a symlink or file there is replaced).
mount_point() {
    if [ -L "$IMAGE_ROOT/$1" ] || { [ -e "$IMAGE_ROOT/$1" ] && [ ! -d "$IMAGE_ROOT/$1" ]; }; then
        rm -f "$IMAGE_ROOT/$1" || return 1
    fi
    [ -d "$IMAGE_ROOT/$1" ] || mkdir "$IMAGE_ROOT/$1"
}
# in_image COMMAND...: a busybox applet run chrooted in the image root (needs /.forkd mounted).
in_image() {
    chroot "$IMAGE_ROOT" /.forkd/usr/bin/busybox "$@"
}
case " $(cat /proc/cmdline) " in
*" forkd.image "*)
    [ -r /etc/forkd/modules.image ] && load_modules /etc/forkd/modules.image
    attempts=0
    until [ -b /dev/vda ]; do
        attempts=$((attempts + 1))
        if [ "$attempts" -ge 500 ]; then
            log "the image disk /dev/vda did not appear (block devices: $(ls /sys/class/block 2>/dev/null))"
            exit 1
        fi
        sleep 0.01
    done
    mkdir -p /mnt/image /mnt/rw /sysroot
    # The writable layer gets the room the initramfs root would have had.
    if mount -t ext4 -o ro,noload,nodev /dev/vda /mnt/image &&
        mount -t tmpfs -o mode=0755,size=75%,nodev tmpfs /mnt/rw &&
        mkdir -p /mnt/rw/upper /mnt/rw/work &&
        mount -t overlay -o nodev,lowerdir=/mnt/image/rootfs,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work overlay /sysroot; then
        IMAGE_ROOT=/sysroot
    else
        log "cannot mount the image disk /dev/vda as the root filesystem"
        exit 1
    fi
    cp /mnt/image/forkd/image.json /etc/forkd/image.json
    for dir in .forkd proc sys dev; do
        mount_point "$dir" || log "cannot make /$dir a directory of the image root"
    done
    mount --bind / "$IMAGE_ROOT/.forkd" && mount -o remount,bind,ro,nodev,nosuid "$IMAGE_ROOT/.forkd" ||
        log "cannot mount forkd's runtime at /.forkd in the image"
    # /tmp and /run only where the image has nothing of that name (a symlink there stays the image's,
    # resolved inside the image root).
    for dir in tmp run; do
        [ -e "$IMAGE_ROOT/$dir" ] || [ -L "$IMAGE_ROOT/$dir" ] || mkdir "$IMAGE_ROOT/$dir"
    done
    in_image chmod 1777 /tmp 2>/dev/null
    mount -t proc proc "$IMAGE_ROOT/proc"
    mount -t sysfs sysfs "$IMAGE_ROOT/sys" &&
        { mount --bind /sys/fs/cgroup "$IMAGE_ROOT/sys/fs/cgroup" 2>/dev/null ||
            log "cannot mount cgroup2 in the image: commands run without memory and process limits"; }
    # devtmpfs: the kernel's own device nodes, the only ones an image's commands may open.
    mount -t devtmpfs devtmpfs "$IMAGE_ROOT/dev" && {
        mkdir -p "$IMAGE_ROOT/dev/shm" "$IMAGE_ROOT/dev/pts"
        mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$IMAGE_ROOT/dev/shm"
        mount -t devpts -o gid=5,mode=620 devpts "$IMAGE_ROOT/dev/pts" 2>/dev/null
    }
    ;;
esac

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
    # The image's own resolv.conf is replaced (often a link into /run that nothing fills here), inside its root.
    if [ -n "$IMAGE_ROOT" ]; then
        { in_image mkdir -p /etc && in_image rm -f /etc/resolv.conf &&
            in_image tee /etc/resolv.conf </etc/resolv.conf >/dev/null; } ||
            log "cannot write /etc/resolv.conf in the image: its commands have no DNS"
    fi
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
# In a container image the agent runs chrooted in the image's root through the
# runtime's own dynamic loader and libraries: the image needs no Python, no
# libc, not even a shell. Python finds its library from its own path (/.forkd/usr).
if [ -n "$IMAGE_ROOT" ]; then
    export FORKD_RUNTIME=/.forkd
    libs=/.forkd/usr/lib/x86_64-linux-gnu
    agent_python="chroot $IMAGE_ROOT $libs/ld-linux-x86-64.so.2 --library-path $libs /.forkd/usr/bin/python3"
    agent_dir=/.forkd/opt/forkd
else
    agent_python=/usr/bin/python3
    agent_dir=/opt/forkd
fi
while :; do
    echo "forkd-agent: starting on $port"
    $agent_python -I -S -c "import sys; sys.path.insert(0, '$agent_dir'); import agent; sys.exit(agent.main())" "$port"
    echo "forkd-agent: exited with status $?; restarting in 0.1 s"
    sleep 0.1
done
