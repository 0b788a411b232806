"""A packet capture on the loopback interface for tests: an AF_PACKET socket (root only) that keeps
the TCP payload of every frame to or from a set of ports, so a test can look for bytes it sent."""

from __future__ import annotations

import os
import socket
import struct
import threading

ETH_P_ALL = 0x0003


def capture_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "a packet capture needs root (AF_PACKET)"
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL)).close()
    except OSError as exc:
        return f"AF_PACKET sockets are refused here: {exc}"
    return None


class LoopbackCapture:
    """Collects TCP payload bytes of segments whose source or destination port is in `ports`."""

    def __init__(self, ports: set[int], interface: str = "lo") -> None:
        self.ports = ports
        self.payload = bytearray()
        self.segments = 0
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self._sock.bind((interface, 0))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoopbackCapture:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self._sock.recv(262144)
            except socket.timeout:
                continue
            except OSError:
                return
            self._parse(frame)

    def _parse(self, frame: bytes) -> None:
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":  # IPv4 only (the tests use 127.0.0.1)
            return
        ip = frame[14:]
        if ip[9] != 6:  # TCP
            return
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[ihl:total]
        if len(tcp) < 20:
            return
        src, dst = struct.unpack("!HH", tcp[:4])
        if src not in self.ports and dst not in self.ports:
            return
        offset = (tcp[12] >> 4) * 4
        data = tcp[offset:]
        if data:
            self.segments += 1
            self.payload += data

    def contains_any(self, needles: list[bytes]) -> bool:
        data = bytes(self.payload)
        return any(n in data for n in needles)
