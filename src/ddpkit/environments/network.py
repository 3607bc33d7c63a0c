"""Addresses for multi-node runs: which local address reaches the master, on which interface."""

from __future__ import annotations

import fcntl
import socket
import struct

from ..errors import DdpkitError

_SIOCGIFADDR = 0x8915


def resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except socket.gaierror as e:
        raise DdpkitError(f"cannot resolve host {host!r} ({e.strerror}); use an IP address or fix the name") from None


def is_local_address(ip: str) -> bool:
    """Can this machine (network namespace) bind to ip, i.e. is it one of ours?"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


def source_address_for(ip: str) -> str:
    """The local address the kernel would use to reach ip (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
        except OSError as e:
            raise DdpkitError(
                f"no route from this node to {ip} ({e.strerror}); check --master-addr / --rdzv-endpoint"
            ) from None
        return s.getsockname()[0]


def interface_of(ip: str) -> str | None:
    """Name of the interface that holds ip (for GLOO_SOCKET_IFNAME), or None."""
    return next((name for name, addr in interfaces().items() if addr == ip), None)


def interfaces() -> dict[str, str]:
    """{interface name: its IPv4 address} of this machine (network namespace)."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            out[name] = socket.inet_ntoa(packed[20:24])
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
