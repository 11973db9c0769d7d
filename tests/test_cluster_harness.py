"""The emulated cluster: hosts with their own names and addresses, and shaped
links (torchrun agents meeting across hosts: tests/test_cluster_launch.py)."""

import re
import subprocess
import sys
import textwrap

import pytest

from giantmodel.testing.cluster import EmulatedCluster, Link, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=str(unavailable_reason()))

_SINK = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5000)); s.listen(1)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(50):                       # echo: round trips
        c.sendall(c.recv(8))
    n, t0 = 0, None
    while b := c.recv(1 << 20):               # sink: bandwidth
        t0 = t0 or time.perf_counter(); n += len(b)
    print(n * 8 / (time.perf_counter() - t0) / 1e6)
""")

_SOURCE = textwrap.dedent("""
    import socket, statistics, sys, time
    for _ in range(100):
        try:
            s = socket.create_connection((sys.argv[1], 5000)); break
        except OSError:
            time.sleep(0.05)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtt = []
    for _ in range(50):
        t = time.perf_counter(); s.sendall(b"12345678"); s.recv(8)
        rtt.append(time.perf_counter() - t)
    block = b"x" * (1 << 20)
    for _ in range(int(sys.argv[2])):
        s.sendall(block)
    s.close()
    print(statistics.median(rtt) * 1e3)
""")


def _link(c: EmulatedCluster, src: int, dst: int, mb: int) -> tuple[float, float]:
    """(Mbit/s from src to dst, median round trip in ms) measured over TCP."""
    sink = c.popen(dst, [sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    rtt = c.run(src, [sys.executable, "-c", _SOURCE, c.hosts[dst].name, str(mb)],
                timeout=60, check=True).stdout
    return float(sink.communicate(timeout=30)[0]), float(rtt)


def _class_bytes(c: EmulatedCluster, host: int) -> dict[str, tuple[str, int]]:
    """{HTB class id: (rate, bytes sent)} on the host's NIC."""
    out = subprocess.run(["tc", "-n", c.hosts[host].netns, "-s", "class", "show", "dev", "eth0"],
                         check=True, capture_output=True, text=True).stdout
    return {m[1]: (m[2], int(m[3])) for m in
            re.finditer(r"class htb (\S+) .*?rate (\S+) .*?Sent (\d+) bytes", out, re.S)}


def test_hosts_names_and_shaped_links():
    pair = Link(rate_mbit=800, delay_ms=0.2)
    with EmulatedCluster(3, link=Link(rate_mbit=100, delay_ms=1.0),
                         pair_links={(0, 1): pair}) as c:
        assert c.delay_applied
        names = [c.run(h, ["hostname"], timeout=20, check=True).stdout.strip() for h in range(3)]
        assert names == ["host0", "host1", "host2"]
        lookup = "import socket; print(socket.gethostbyname('host1'))"
        resolved = c.run(2, [sys.executable, "-c", lookup], timeout=20, check=True).stdout.strip()
        assert resolved == c.hosts[1].ip
        slow_bw, slow_rtt = _link(c, 0, 2, mb=8)
        fast_bw, fast_rtt = _link(c, 0, 1, mb=40)
        sent = _class_bytes(c, 0)
        netns = [h.netns for h in c.hosts]
    # What the emulated links guarantee, however loaded the machine: a shaped
    # rate bounds the throughput from above (unshaped veths carry Gbit/s), the
    # delays bound the round trip from below (both one-way delays). How close
    # a loaded host comes to the rate, or how fast it answers, is not asserted.
    assert 0 < slow_bw <= 110, slow_bw
    assert 0 < fast_bw <= 880, fast_bw
    assert slow_rtt >= 2.0, slow_rtt
    assert fast_rtt >= 0.4, fast_rtt
    # the 40 MB to host1 went through the pair's own 800 Mbit/s class, the 8 MB
    # to host2 through the NIC's 100 Mbit/s class
    assert sent["1:2"][0] == "800Mbit" and sent["1:2"][1] >= 40 << 20, sent
    assert sent["1:1"][0] == "100Mbit" and 8 << 20 <= sent["1:1"][1] < 40 << 20, sent
    left = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    assert not any(ns in left for ns in netns), left
