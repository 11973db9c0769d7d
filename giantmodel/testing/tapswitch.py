"""A user-space Ethernet switch that delays frames, for emulated clusters on
kernels without ``sch_netem``.

Each emulated host gets a TAP device as its NIC; this process holds every
TAP, reads the frames a host sends (after the host's own ``tc`` rate shaping
on that TAP), and writes each one into the destination host's TAP once the
link's one-way delay has passed. Frames of one (source, destination) pair keep
their order because the pair's delay is constant. Broadcasts (ARP) go to every
other host.

Started by :class:`giantmodel.testing.cluster.EmulatedCluster` as
``python -m giantmodel.testing.tapswitch SPEC_JSON``; prints ``ready`` once
its TAPs exist and runs until killed. ``select`` gives microsecond timeouts, so
the delay is accurate to the scheduler's wake-up latency (tens of µs when a
core is free; more on a loaded host).
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import select
import struct
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000


def open_tap(name: str) -> int:
    """A non-blocking fd for a new TAP device ``name`` (frames without packet info)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


def serve(taps: list[str], macs: list[str], delay_s: list[list[float]], mtu: int) -> None:
    """Switch frames among ``taps``; ``delay_s[src][dst]`` is the one-way delay."""
    fds = [open_tap(t) for t in taps]
    index = {fd: i for i, fd in enumerate(fds)}
    by_mac = {bytes.fromhex(m.replace(":", "")): i for i, m in enumerate(macs)}
    everyone = range(len(fds))
    print("ready", flush=True)
    pending: list[tuple[float, int, int, bytes]] = []  # (due, seq, dst, frame)
    seq = 0
    frame_max = mtu + 18
    while True:
        timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else None
        readable, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            src = index[fd]
            for _ in range(64):  # drain a burst without starving the others
                try:
                    frame = os.read(fd, frame_max)
                except BlockingIOError:
                    break
                dst = by_mac.get(frame[:6])
                for d in ([dst] if dst is not None else everyone):
                    if d != src:
                        heapq.heappush(pending, (now + delay_s[src][d], seq, d, frame))
                        seq += 1
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, d, frame = heapq.heappop(pending)
            try:
                os.write(fds[d], frame)
            except OSError:
                pass  # the host's interface is down (host being torn down): drop, like a wire


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    serve(spec["taps"], spec["macs"], spec["delay_s"], spec["mtu"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
