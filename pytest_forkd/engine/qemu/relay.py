"""Relay one guest connection to a port on the host's loopback: ``relay.py PORT``.

QEMU's user-mode network starts this program (a slirp ``guestfwd`` command)
for every connection the guest opens to an allowed host port, with the
connection as its stdin and stdout. It connects to 127.0.0.1:PORT and copies
bytes both ways until either side closes. One process per connection is
what lets a restricted guest open many connections, to servers that start
after the VM did. It imports nothing from pytest_forkd (it runs with ``-I -S``)
and never writes to stderr: that is the guest's connection too.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
from typing import cast

CHUNK = 65536


def relay(port: int) -> int:
    guest = socket.socket(fileno=os.dup(0))
    try:
        host = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError:
        guest.close()
        return 1
    host.settimeout(None)
    peers = {guest: host, host: guest}
    with selectors.DefaultSelector() as selector:
        for sock in peers:
            selector.register(sock, selectors.EVENT_READ)
        open_ends = 2
        while open_ends:
            for key, _ in selector.select():
                source = cast(socket.socket, key.fileobj)  # only the two sockets are registered
                try:
                    data = source.recv(CHUNK)
                except OSError:
                    data = b""
                if data:
                    try:
                        peers[source].sendall(data)
                        continue
                    except OSError:
                        return 0
                selector.unregister(source)
                open_ends -= 1
                try:
                    peers[source].shutdown(socket.SHUT_WR)
                except OSError:
                    return 0
    return 0


if __name__ == "__main__":
    sys.exit(relay(int(sys.argv[1])))
