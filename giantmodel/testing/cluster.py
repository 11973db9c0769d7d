"""An emulated cluster on one Linux machine, for multi-host tests and benchmarks.

Each emulated host is a network namespace with its own address (10.50.0.x)
and its own UTS namespace (so ``socket.gethostname()`` differs per host, as
the giant backend's node discovery and torchrun expect). Every command started
on a host also sees an ``/etc/hosts`` naming all hosts, so host names resolve
as on a real cluster. Links are shaped with ``tc`` on each host's ``eth0``: an
HTB class for its NIC rate (shared by all destinations), plus a class per host
pair given its own link, matched by destination address.

Delays: where the kernel has ``sch_netem`` the hosts' veths hang on a kernel
bridge and netem delays them; elsewhere (this project's CI kernel has no
netem) each host's NIC is a TAP device switched by a small user-space process
(:mod:`giantmodel.testing.tapswitch`) that holds every frame for its link's
delay. Without delays, veths on a kernel bridge carry the traffic.

It needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip``, ``tc``,
``nsenter`` and ``unshare`` tools. :func:`unavailable_reason` says why not
when it cannot run, so tests can skip with that reason.

API (stable since tag ``cluster-v1``)::

    from giantmodel.testing.cluster import EmulatedCluster, Link, unavailable_reason

    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    with EmulatedCluster(2, link=Link(rate_mbit=200)) as c:   # hosts "host0", "host1"
        c.hosts[1].ip, c.hosts[1].name                      # "10.50.0.2", "host1"
        out = c.run(0, ["hostname"], timeout=10)            # CompletedProcess, text
        p = c.popen(1, ["python", "-m", "x"], env={...})     # subprocess.Popen
        argv = c.torchrun_argv(nproc=2, args=["-m", "giantmodel", "train"], rdzv_port=29400)
        procs = [c.popen(h, argv) for h in range(2)]        # one torchrun agent per host
        results = c.wait_all(procs, timeout=300)            # kills all on timeout
        ranks = c.popen_ranks([[0, 2], [1, 3]], argv2)      # srun-style: one process per
                                                            # rank, RANK/MASTER_ADDR set
        c.kill_host(1)                                      # SIGKILL every process on host1
        c.cut_link(1); c.restore_link(1)                    # host1's cable out, and back
    # leaving the block kills what is left and deletes namespaces, links and bridge

- ``Link(rate_mbit=None, delay_ms=0.0)``: ``rate_mbit=None`` leaves the link
  unshaped. ``link`` is every host's NIC (egress, shared by all destinations);
  ``pair_links={(a, b): Link(...)}`` gives the pair a dedicated link in both
  directions (each host's egress to the other), e.g. a fast island.
- ``delay_backend()`` says how delays are applied here ("netem", "tapswitch"
  or None); a cluster asked for a delay where neither works raises
  :class:`ClusterUnavailable` unless built with ``require_delay=False``, in
  which case ``cluster.delay_applied`` is False and only rates are shaped.
  ``cluster.mode`` is "veth" or "tapswitch"; ``cluster.link_between(a, b)``
  is the Link that joins two hosts.
- Processes run with the caller's environment plus ``env``, each command in
  its own session. ``kill_host`` kills every process in the host's network
  namespace (whatever sessions they made: torchrun's workers have their own),
  as a machine that goes down would.
- Namespaces and links are named ``gm<id>...`` with a per-cluster id, so
  several clusters (several test sessions) can live side by side; leftovers
  of a cluster whose owning process died are removed by the next start.
- ``host_command(cluster.state_dir, "host1", argv)`` wraps a command for a
  host from any process (``state_dir/cluster.json`` describes the hosts);
  the srun shim (:mod:`giantmodel.testing.slurm_shim`) uses it.

Tags: ``cluster-v1`` first API; ``cluster-v2`` adds ``popen_ranks``;
``cluster-v3``: ``kill_host`` kills the whole namespace, ``run`` passes Popen
keyword arguments, ``host_command``; ``cluster-v4`` adds ``cut_link`` and
``restore_link``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

STATE_ROOT = Path("/run/giantmodel-cluster")
SUBNET = "10.50.0"
# An unshaped class still needs a rate in HTB; far above what veths carry here.
UNSHAPED_MBIT = 100_000


class ClusterUnavailable(RuntimeError):
    """The machine cannot emulate a cluster (no root, no namespaces, no tc)."""


@dataclass(frozen=True)
class Link:
    """A shaped link: rate in Mbit/s (None = unshaped) and one-way delay in ms."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0

    @property
    def shaped(self) -> bool:
        return self.rate_mbit is not None or self.delay_ms > 0


@dataclass
class Host:
    index: int
    name: str
    ip: str
    netns: str
    uts_file: Path
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


_REASON: list[str | None] = []


def unavailable_reason() -> str | None:
    """None when namespaces, veths, a bridge and tc shaping work here; else
    why not (cached). Creates and deletes a throw-away namespace to find out."""
    if _REASON:
        return _REASON[0]
    reason = _probe()
    _REASON.append(reason)
    return reason


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return "emulated clusters need Linux network namespaces"
    if os.geteuid() != 0:
        return "emulated clusters need root (network and UTS namespaces, tc)"
    for tool in ("ip", "tc", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"emulated clusters need the '{tool}' tool (iproute2 / util-linux)"
    tag = f"gmp{uuid.uuid4().hex[:6]}"
    try:
        _sh("ip", "netns", "add", tag)
        _sh("ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        _sh("ip", "link", "set", f"{tag}b", "netns", tag)
        _sh("tc", "qdisc", "add", "dev", f"{tag}a", "root", "handle", "1:", "htb")
        _sh("unshare", "--uts", "true")
    except (subprocess.CalledProcessError, OSError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        return f"this machine does not permit emulated clusters: {detail.strip()}"
    finally:
        _sh("ip", "link", "del", f"{tag}a", check=False)
        _sh("ip", "netns", "del", tag, check=False)
    return None


_DELAY: list[str | None] = []


def delay_backend() -> str | None:
    """How link delays are applied here: "netem" (the kernel's qdisc),
    "tapswitch" (TAP NICs and a user-space switch that delays frames, for
    kernels without ``sch_netem``), or None (neither works)."""
    if not _DELAY:
        tag = f"gmd{uuid.uuid4().hex[:6]}"
        try:
            netem = (_sh("ip", "link", "add", tag, "type", "dummy", check=False).returncode == 0
                     and _sh("tc", "qdisc", "add", "dev", tag, "root", "netem", "delay", "1ms",
                             check=False).returncode == 0)
        finally:
            _sh("ip", "link", "del", tag, check=False)
        tap = os.access("/dev/net/tun", os.R_OK | os.W_OK)
        _DELAY.append("netem" if netem else "tapswitch" if tap else None)
    return _DELAY[0]


def delay_supported() -> bool:
    """Whether link delays can be applied on this machine."""
    return delay_backend() is not None


class EmulatedCluster:
    """N emulated hosts on a bridge; see the module docstring for the API."""

    def __init__(self, hosts: int | Sequence[str], *, link: Link = Link(),
                 pair_links: Mapping[tuple[int, int], Link] | None = None,
                 require_delay: bool = True, mtu: int | None = None):
        names = [f"host{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not 1 <= len(names) <= 200:
            raise ValueError(f"an emulated cluster has 1..200 hosts, got {len(names)}")
        self.id = uuid.uuid4().hex[:6]
        self.link = link
        self.pair_links = {tuple(sorted(k)): v for k, v in (pair_links or {}).items()}
        for a, b in self.pair_links:
            if not (0 <= a < len(names) and 0 <= b < len(names)) or a == b:
                raise ValueError(f"pair_links key {(a, b)} does not name two different hosts")
        self.state_dir = STATE_ROOT / self.id
        self.bridge = f"gm{self.id}br"
        self.hosts = [Host(i, n, f"{SUBNET}.{i + 1}", f"gm{self.id}h{i}",
                           self.state_dir / f"{n}.uts") for i, n in enumerate(names)]
        wants_delay = any(v.delay_ms > 0 for v in [link, *self.pair_links.values()])
        backend = delay_backend() if wants_delay else None
        if wants_delay and backend is None and require_delay:
            raise ClusterUnavailable("link delays need the sch_netem qdisc or /dev/net/tun; "
                                     "build the cluster with require_delay=False to shape "
                                     "rates only")
        # "veth": veths on a kernel bridge (netem delays, if any); "tapswitch":
        # TAP NICs switched by a user-space process that applies the delays.
        self.mode = "tapswitch" if backend == "tapswitch" else "veth"
        self.delay_applied = backend is not None
        # Big frames keep the user-space switch's frame rate low (~2k/s at 1 Gbit/s).
        self.mtu = mtu or (65000 if self.mode == "tapswitch" else 9000)
        self._switch: subprocess.Popen | None = None
        self._started = False

    def link_between(self, a: int, b: int) -> Link:
        """The link that carries traffic between hosts ``a`` and ``b``."""
        return self.pair_links.get(tuple(sorted((a, b))), self.link)

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise ClusterUnavailable(reason)
        remove_stale_clusters()
        self.state_dir.mkdir(parents=True)
        (self.state_dir / "owner").write_text(str(os.getpid()))
        self._started = True
        try:
            self._build()
        except BaseException:
            self.stop()
            raise

    def _build(self) -> None:
        hosts_file = self.state_dir / "hosts"
        hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
            f"{h.ip} {h.name}\n" for h in self.hosts))
        # No DNS server is reachable from the hosts: fail lookups of unknown
        # names (peers' reverse lookups) at once instead of after 5 s timeouts.
        (self.state_dir / "resolv.conf").write_text("nameserver 127.0.0.1\n"
                                                    "options timeout:1 attempts:1\n")
        if self.mode == "tapswitch":
            self._start_switch()
        else:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "link", "set", self.bridge, "mtu", str(self.mtu), "up")
        for h in self.hosts:
            _sh("ip", "netns", "add", h.netns)
            if self.mode == "tapswitch":
                nic = f"gm{self.id}t{h.index}"
            else:
                outer, nic = f"gm{self.id}v{h.index}", f"gm{self.id}e{h.index}"
                _sh("ip", "link", "add", outer, "mtu", str(self.mtu), "type", "veth",
                    "peer", "name", nic, "mtu", str(self.mtu))
                _sh("ip", "link", "set", outer, "master", self.bridge, "up")
            _sh("ip", "link", "set", nic, "netns", h.netns)
            ipn = ("ip", "-n", h.netns)
            _sh(*ipn, "link", "set", nic, "name", "eth0")
            _sh(*ipn, "link", "set", "eth0", "address", _mac(h.index), "mtu", str(self.mtu))
            _sh(*ipn, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            _sh(*ipn, "link", "set", "eth0", "up")
            _sh(*ipn, "link", "set", "lo", "up")
            # no IPv6 neighbour chatter on the emulated links
            _sh("ip", "netns", "exec", h.netns, "sysctl", "-qw",
                "net.ipv6.conf.all.disable_ipv6=1", check=False)
            h.uts_file.touch()
            _sh("unshare", f"--uts={h.uts_file}", "hostname", h.name)
            self._shape(h)
        (self.state_dir / "cluster.json").write_text(json.dumps({"hosts": {
            h.name: {"ip": h.ip, "netns": h.netns, "uts_file": str(h.uts_file)}
            for h in self.hosts}}))

    def _start_switch(self) -> None:
        n = len(self.hosts)
        delay = [[self.link_between(a, b).delay_ms / 1e3 for b in range(n)] for a in range(n)]
        spec = {"taps": [f"gm{self.id}t{i}" for i in range(n)],
                "macs": [_mac(i) for i in range(n)], "delay_s": delay, "mtu": self.mtu}
        self._switch = subprocess.Popen(
            [sys.executable, "-m", "giantmodel.testing.tapswitch", json.dumps(spec)],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "PYTHONPATH": _package_root()})
        if self._switch.stdout.readline().strip() != "ready":
            raise ClusterUnavailable(f"the TAP switch did not start (exit "
                                     f"{self._switch.wait()})")
        (self.state_dir / "switch").write_text(str(self._switch.pid))

    def _shape(self, h: Host) -> None:
        """HTB on the host's egress: class 1:1 is its NIC (``link``), one class
        per dedicated pair link, matched by destination address."""
        pairs = [(b if a == h.index else a, lk) for (a, b), lk in self.pair_links.items()
                 if h.index in (a, b)]
        if not self.link.shaped and not pairs:
            return
        tc = ("tc", "-n", h.netns)
        _sh(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
        for minor, (peer, lk) in [(1, (None, self.link)), *[(i + 2, p) for i, p in
                                                           enumerate(pairs)]]:
            rate = f"{lk.rate_mbit or UNSHAPED_MBIT}mbit"
            # burst of one max-size frame: smaller stalls it, larger lets a
            # short transfer run above the rate
            burst = f"{self.mtu + 64}b"
            _sh(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", f"1:{minor}",
                "htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst)
            if lk.delay_ms > 0 and self.delay_applied and self.mode == "veth":
                _sh(*tc, "qdisc", "add", "dev", "eth0", "parent", f"1:{minor}",
                    "netem", "delay", f"{lk.delay_ms}ms", "limit", "100000")
            if peer is not None:
                _sh(*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip",
                    "prio", "1", "u32", "match", "ip", "dst", f"{self.hosts[peer].ip}/32",
                    "flowid", f"1:{minor}")

    def stop(self) -> None:
        """Kill every process started on the hosts, then delete what start made."""
        for h in self.hosts:
            self.kill_host(h.index)
        if self._switch is not None:
            _kill_session(self._switch)
            self._switch = None
        if self._started:
            _teardown(self.id, [h.netns for h in self.hosts])
            self._started = False

    # ------------------------------------------------------------- commands
    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``host``: its network and UTS
        namespaces, with the cluster's /etc/hosts."""
        return host_command(self.state_dir, self.hosts[host].name, argv)

    def popen(self, host: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a new session; kwargs go to Popen."""
        if not self._started:
            raise RuntimeError("EmulatedCluster.start() has not been called")
        full_env = {**os.environ, **(env or {})}
        p = subprocess.Popen(self.command(host, argv), env=full_env, start_new_session=True,
                             **kwargs)
        self.hosts[host].procs.append(p)
        return p

    def run(self, host: int, argv: Sequence[str], *, timeout: float,
            env: Mapping[str, str] | None = None, check: bool = False, **kwargs
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to completion; text output captured;
        kwargs (``cwd``, ...) go to Popen."""
        p = self.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, **kwargs)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(p)
            out, err = p.communicate()
            raise TimeoutError(f"{argv} on {self.hosts[host].name} did not finish within "
                               f"{timeout}s; output:\n{out}\n{err}") from None
        result = subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        if check and p.returncode:
            raise RuntimeError(f"{argv} on {self.hosts[host].name} exited {p.returncode}:\n"
                               f"{out}\n{err}")
        return result

    def wait_all(self, procs: Sequence[subprocess.Popen], timeout: float) -> list[int]:
        """Wait for every process; on timeout kill them all and raise."""
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                _kill_session(p)
            raise TimeoutError(f"processes did not finish within {timeout}s") from None

    def kill_host(self, host: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process running on ``host``: those started
        here and everything they spawned, new sessions included (torchrun
        starts its workers in sessions of their own), found by network
        namespace, as if the machine went down."""
        h = self.hosts[host]
        for p in h.procs:
            _kill_session(p, sig, wait=False)
        if self._started:
            pids = _sh("ip", "netns", "pids", h.netns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), sig)
                except (ProcessLookupError, ValueError):
                    pass
        if sig == signal.SIGKILL:
            for p in h.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass

    def cut_link(self, host: int) -> None:
        """Take ``host``'s network link down while its processes run on, as a
        pulled cable or a failed switch port would: its peers hear nothing
        from it (no reset, no refusal), and it hears nothing from them.
        Veth mode downs the bridge side of the host's veth (the host's eth0
        loses carrier, its routes stay, packets vanish); tapswitch mode downs
        the host's TAP NIC (its own sends then fail at once, unreachable)."""
        if self.mode == "tapswitch":
            _sh("ip", "-n", self.hosts[host].netns, "link", "set", "eth0", "down")
        else:
            _sh("ip", "link", "set", f"gm{self.id}v{host}", "down")

    def restore_link(self, host: int) -> None:
        """Bring back a link that :meth:`cut_link` took down."""
        if self.mode == "tapswitch":
            # the address stays on a downed NIC; the kernel re-adds its
            # subnet route when the NIC comes up
            _sh("ip", "-n", self.hosts[host].netns, "link", "set", "eth0", "up")
        else:
            _sh("ip", "link", "set", f"gm{self.id}v{host}", "up")

    def popen_ranks(self, host_ranks: Sequence[Sequence[int]], argv: Sequence[str], *,
                    port: int = 29500, env: Mapping[str, str] | None = None,
                    **kwargs) -> list[subprocess.Popen]:
        """Start one process per global rank without torchrun, as ``srun``
        does: ``host_ranks[h]`` lists the ranks host ``h`` runs (e.g.
        ``[[0, 2], [1, 3]]`` is Slurm's cyclic distribution). Each gets RANK,
        WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and MASTER_ADDR/PORT (the
        host of rank 0). Returns the processes in global-rank order."""
        world = sum(len(r) for r in host_ranks)
        if sorted(r for rs in host_ranks for r in rs) != list(range(world)):
            raise ValueError(f"host_ranks {host_ranks} must list 0..{world - 1} once each")
        master = next(h for h, rs in enumerate(host_ranks) if 0 in rs)
        procs: dict[int, subprocess.Popen] = {}
        for h, ranks in enumerate(host_ranks):
            for local, r in enumerate(ranks):
                rank_env = {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                            "LOCAL_WORLD_SIZE": str(len(ranks)),
                            "MASTER_ADDR": self.hosts[master].name, "MASTER_PORT": str(port),
                            **(env or {})}
                procs[r] = self.popen(h, argv, env=rank_env, **kwargs)
        return [procs[r] for r in range(world)]

    def torchrun_argv(self, nproc: int, args: Sequence[str], *, rdzv_port: int = 29400,
                      rdzv_id: str = "giantmodel", nnodes: int | str | None = None,
                      max_restarts: int = 0, python: str = sys.executable) -> list[str]:
        """One torchrun agent's command line, meeting the others by c10d
        rendezvous on host 0, as ``scripts/train_multinode.sh`` does."""
        return [python, "-m", "torch.distributed.run", "--nnodes",
                str(nnodes or len(self.hosts)), "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{self.hosts[0].name}:{rdzv_port}", "--rdzv-id", rdzv_id,
                "--max-restarts", str(max_restarts), *args]


def host_command(state_dir: str | Path, host: str, argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped to run on emulated ``host`` (a name) of the cluster
    whose state directory is ``state_dir`` (``EmulatedCluster.state_dir``);
    for tools that start processes on other hosts, like the srun shim."""
    state = Path(state_dir)
    hosts = json.loads((state / "cluster.json").read_text())["hosts"]
    if host not in hosts:
        raise KeyError(f"no emulated host {host!r}; the cluster has {sorted(hosts)}")
    h = hosts[host]
    mounts = 'mount --bind "$0/hosts" /etc/hosts && mount --bind "$0/resolv.conf" ' \
             '/etc/resolv.conf && exec "$@"'
    return ["nsenter", f"--net=/run/netns/{h['netns']}", f"--uts={h['uts_file']}", "--",
            "unshare", "--mount", "sh", "-c", mounts, str(state), *map(str, argv)]


def _mac(index: int) -> str:
    return f"02:67:6d:00:{index // 256:02x}:{index % 256:02x}"


def _package_root() -> str:
    """The directory holding this copy of giantmodel, for the switch process."""
    return str(Path(__file__).resolve().parents[2])


def _kill_session(p: subprocess.Popen, sig: int = signal.SIGKILL, wait: bool = True) -> None:
    if p.poll() is None or sig == signal.SIGKILL:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if sig == signal.SIGKILL and wait:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _teardown(cluster_id: str, netns: Sequence[str]) -> None:
    state = STATE_ROOT / cluster_id
    switch = state / "switch"
    if switch.exists():  # a stale cluster's switch (ours is killed by stop)
        try:
            pid = int(switch.read_text())
            if f"gm{cluster_id}" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass
    for ns in netns:
        for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
            try:  # nothing may outlive its host
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _sh("ip", "netns", "del", ns, check=False)  # takes its veth pair along
    _sh("ip", "link", "del", f"gm{cluster_id}br", check=False)
    if state.is_dir():
        for f in state.glob("*.uts"):
            _sh("umount", str(f), check=False)
        shutil.rmtree(state, ignore_errors=True)


def remove_stale_clusters() -> list[str]:
    """Tear down clusters whose owning process is gone; returns their ids."""
    removed = []
    if not STATE_ROOT.is_dir():
        return removed
    for d in STATE_ROOT.iterdir():
        try:
            owner = int((d / "owner").read_text())
            os.kill(owner, 0)
            continue  # owner alive
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            # no owner yet: a cluster being built right now, unless old
            if time.time() - d.stat().st_mtime < 60:
                continue
        netns = [n for n in os.listdir("/run/netns") if n.startswith(f"gm{d.name}h")] \
            if os.path.isdir("/run/netns") else []
        _teardown(d.name, netns)
        removed.append(d.name)
    return removed
