"""JoinWatch on real child processes and real TCP connections: a child's MASTER_PORT is read
while it runs, and a connection on that port, even closed, counts as having joined."""

import os
import socket
import subprocess
import sys

from ddpkit.launchers.joined import JoinWatch


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(port, code):
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "MASTER_PORT": str(port)}, timeout=60, check=True
    )


def test_a_child_that_never_connects_never_joined():
    port = _free_port()
    watch = JoinWatch().start()
    _child(port, "import time; time.sleep(1)")
    watch.stop()
    assert watch.port == port and watch.never_joined()


def test_a_child_that_connected_and_closed_has_joined():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        watch = JoinWatch().start()
        _child(port, f"import socket, time; time.sleep(0.5); socket.create_connection(('127.0.0.1', {port})).close()")
        conn, _ = server.accept()
        conn.close()
    watch.stop()
    assert watch.port == port and not watch.never_joined()  # the closed connection is still in TIME_WAIT
