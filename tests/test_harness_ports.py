"""The test servers' ports: ``free_port`` (tests/harness/launch.py) and ``wait_for_port``
(tests/harness/stores.py), which moto, Azurite and fake-gcs-server start with."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.launch import free_port
from tests.harness.stores import wait_for_port


def test_a_server_that_could_not_bind_is_not_taken_for_the_process_listening_on_its_port(tmp_path: Path) -> None:
    """A server whose port another process took first exits (EADDRINUSE) while connections to the
    port succeed: the wait raises instead of handing the other process to the test as the server.
    A server listening there itself is found."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-c", f"import socket; socket.socket().bind(('127.0.0.1', {port}))"],
                                stderr=subprocess.DEVNULL)
        with pytest.raises(RuntimeError, match=f"did not start on port {port}"):
            wait_for_port(proc, port, "the server", tmp_path / "log")
    port = free_port()
    code = f"import socket, time\ns = socket.socket()\ns.bind(('127.0.0.1', {port}))\ns.listen()\ntime.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_for_port(proc, port, "the server", tmp_path / "log")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not Path("/proc/sys/net/ipv4/ip_local_port_range").exists(), reason="Linux's port range only")
def test_free_ports_are_drawn_below_the_kernels_ephemeral_range() -> None:
    """Where the kernel hands out ports of its own (port 0 binds, outgoing connections) no free
    port is drawn: between the draw and a server's bind no other process is given it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(0 < port < low for port in ports) and len(set(ports)) > 1, ports
