"""How the break reads this process's sockets (``shardadopt.fence.breaking.own_tcp_sockets``): each socket once.

A rank reads its sockets at every publication of its listeners and twice at every break (its watcher's, its
trip's), and holds two per peer and process group: asking every one again each time (a duplicate descriptor, a
socket object, five system calls) was a per-rank cost in the world size at every step of a recovery. A socket
already asked about, same descriptor and inode, is taken from what was found then; a new one is asked, a closed
one is gone. Counted here on sockets of this process (a listener and both ends of a connection), no processes.
"""

from __future__ import annotations

import socket

import pytest

from shardadopt.fence import breaking

pytestmark = pytest.mark.skipif(not breaking.os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd (Linux)")


@pytest.fixture
def asked(monkeypatch):
    """How many sockets ``own_tcp_sockets`` asked about (each through one borrowed duplicate)."""
    count = [0]
    borrowed = breaking._borrowed

    def counting(fd):
        count[0] += 1
        return borrowed(fd)

    monkeypatch.setattr(breaking, "_borrowed", counting)
    monkeypatch.setattr(breaking, "_KNOWN", {}, raising=False)
    return count


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return client, server


def _mine(found, *socks):
    fds = {s.fileno() for s in socks}
    return sorted((s for s in found if s.fd in fds), key=lambda s: s.fd)


def test_a_socket_is_asked_about_once_and_a_new_or_closed_one_is_seen(asked):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client, server = _pair(listener)
        first = breaking.own_tcp_sockets()
        after_first = asked[0]
        assert after_first >= 3  # every socket of the process, these three included
        second = breaking.own_tcp_sockets()
        assert asked[0] == after_first, "the second reading asked again about sockets it knew"
        mine = _mine(second, listener, client, server)
        assert mine == _mine(first, listener, client, server) and len(mine) == 3
        assert {s.state for s in mine} == {breaking.LISTEN, breaking.CONNECTED}
        assert {s.port for s in mine if s.state == breaking.LISTEN} == {listener.getsockname()[1]}

        client.close()
        server.close()
        other_client, other_server = _pair(listener)
        with other_client, other_server:
            third = breaking.own_tcp_sockets()
            assert asked[0] - after_first == 2, "only the two new ends are asked about"
            breaking._KNOWN.clear()
            fresh = breaking.own_tcp_sockets()  # every socket asked again
            assert sorted(third) == sorted(fresh), "what was kept is what asking again finds"
            ends = _mine(third, other_client, other_server)
            assert {(s.port, s.remote_port) for s in ends} == {
                (other_client.getsockname()[1], other_client.getpeername()[1]),
                (other_server.getsockname()[1], other_server.getpeername()[1]),
            }


def test_a_borrowed_socket_puts_its_flags_back_only_on_its_own_descriptor():
    """While a socket is borrowed (the break shutting it down), its owner may close the descriptor (gloo's event loop
    does, at the shutdown) and another thread may open a file that takes the number. The borrowed socket's flags
    go back through its duplicate: the new file keeps its own (a gloo pair made blocking would stall its loop)."""
    import fcntl
    import os

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client, server = _pair(listener)
        with server:
            client.setblocking(False)
            number = client.fileno()
            previous = socket.getdefaulttimeout()
            socket.setdefaulttimeout(5.0)  # the borrowed socket changes the shared flags: to be put back
            try:
                with breaking._borrowed(number) as borrowed:
                    client.close()  # the owner closes the number ...
                    reader, writer = os.pipe()  # ... and another file takes it, blocking
                    try:
                        assert number in (reader, writer)
                        taken = fcntl.fcntl(number, fcntl.F_GETFL)
                        borrowed.shutdown(socket.SHUT_RDWR)
                    except BaseException:
                        os.close(reader), os.close(writer)
                        raise
                assert fcntl.fcntl(number, fcntl.F_GETFL) == taken, "the borrowed socket's flags landed on the pipe"
                assert not taken & os.O_NONBLOCK
            finally:
                socket.setdefaulttimeout(previous)
                os.close(reader), os.close(writer)
