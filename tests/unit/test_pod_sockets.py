"""The socket sampler of the network-policy test (``tests/pod_sockets.py``): the kernel's
socket dump read right, and a connection told from its client side only (issue 16, finding 7)."""

from __future__ import annotations

import os
import socket

from pod_sockets import client_sides, read_sockets, sessions, socket_inodes


def test_a_connection_is_reported_once_from_its_client_side_with_its_peer_address() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = listener.getsockname()
        with socket.create_connection(address) as client:
            server, _ = listener.accept()
            with server:
                owned = socket_inodes(os.getpid())
                table = read_sockets(socket.AF_INET) + read_sockets(socket.AF_INET6)
                by_inode = {s.inode: s for s in table}
                inode = os.fstat(client.fileno()).st_ino
                assert by_inode[inode].remote == address
                assert by_inode[inode].local == client.getsockname()
                assert by_inode[os.fstat(listener.fileno()).st_ino].listening
                mine = client_sides(dict.fromkeys(owned, "me"), table)
                # the client's socket, not the accepted one (its peer is an ephemeral port)
                assert ("me", *address) in mine
                assert ("me", *client.getsockname()) not in mine


def test_this_process_is_found_in_its_session() -> None:
    assert os.getpid() in sessions()[os.getsid(0)]
