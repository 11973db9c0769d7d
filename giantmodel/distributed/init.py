"""Process-group start-up and teardown, from launcher environment variables.

torchrun, Slurm via torchrun, and ``giantmodel train --nproc-per-node`` all
set RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE; a plain ``python`` run
has none of them and runs as a single process without a process group.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from giantmodel.config.errors import ConfigError, RunStopped


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def world_info() -> WorldInfo:
    """Read the launcher's environment; all zeros/ones when launched directly."""
    def env(name: str, default: int) -> int:
        return int(os.environ.get(name, default))

    world = env("WORLD_SIZE", 1)
    return WorldInfo(rank=env("RANK", 0), world_size=world, local_rank=env("LOCAL_RANK", 0),
                     local_world_size=env("LOCAL_WORLD_SIZE", world))


def pick_device(requested: str, info: WorldInfo) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("CUDA was requested but is not available; set train.device=cpu",
                              "train.device")
        torch.cuda.set_device(_local_gpu(info, torch.cuda.device_count()))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local_gpu(info: WorldInfo, visible: int) -> int:
    """This rank's GPU: its local rank. More local ranks than visible GPUs
    would put two ranks on one GPU (silently, with ``% device_count``), where
    NCCL fails or hangs and memory runs out; stop with the fix instead."""
    if info.local_rank >= visible or info.local_world_size > visible:
        raise RuntimeError(
            f"local rank {info.local_rank} of {info.local_world_size} ranks on this node but "
            f"{visible} GPU(s) visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): launch at most {visible} "
            f"ranks per node (--nproc-per-node {visible}) or make more GPUs visible")
    return info.local_rank


def bind_cpu_cores(info: WorldInfo, threads: int | None = None) -> list[int] | None:
    """Pin this process to local rank ``info.local_rank``'s share of the host's
    CPUs, and set its intra-op threads to that share unless ``threads`` is
    given; the CPUs, or None where it leaves the process as it was.

    Call before the process group exists: the threads a backend starts
    inherit the mask. On the 2-core test host, two ranks pinned ran the
    planner check's dp2 step in 0.81-0.85 s against 0.85-0.96 s unpinned,
    and its tp2 step in 1.02-1.13 s against 1.07-1.33 s."""
    if info.local_world_size <= 1 or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    # a narrower mask than the machine: a launcher placed this rank already
    if len(allowed) < (os.cpu_count() or 0) or len(allowed) < info.local_world_size:
        return None
    n, lw, lr = len(allowed), info.local_world_size, info.local_rank
    mine = allowed[lr * n // lw:(lr + 1) * n // lw]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(threads or len(mine))
    return mine


def init_distributed(backend: str, timeout_s: float, device: torch.device, info: WorldInfo,
                     pg_options=None) -> None:
    """Create the default process group when the launcher asked for several ranks;
    ``pg_options`` goes to the backend (the giant backend's settings)."""
    if info.world_size == 1 or dist.is_initialized():
        return
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init, bound to this rank's GPU
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                            rank=info.rank, world_size=info.world_size, pg_options=pg_options,
                            **kwargs)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------ lost hosts
class HostLostError(RunStopped):
    """A collective failed because a peer host stopped answering; the
    message names the host and its ranks. A RunStopped, so the CLI ends on
    that one line rather than a traceback."""


@dataclass(frozen=True)
class PeerHost:
    rank: int
    host: str
    addresses: tuple[str, ...]
    port: int = 0
    """A TCP port this rank listens on (never accepting) so that a peer can
    tell, after a collective timed out, whether its host still answers."""


# The probe listener of this process: kept open for the process's life (the
# kernel completes probes' handshakes; nothing is ever accepted).
_listener: list = []


def _probe_port(world_size: int) -> int:
    import socket

    if not _listener:
        try:
            sock = socket.create_server(("", 0), backlog=min(4096, max(128, world_size)))
        except OSError:
            return 0
        _listener.append(sock)
    return _listener[0].getsockname()[1]


def gather_peer_hosts() -> list[PeerHost]:
    """Every rank's host name and the addresses its peers reach it at, so that
    a transport error naming an address can name the host instead."""
    import socket

    host = socket.gethostname()
    addrs = set()
    try:
        addrs.update(socket.gethostbyname_ex(host)[2])
    except OSError:
        pass
    master = os.environ.get("MASTER_ADDR")
    if master:  # the address this host uses towards the others
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                addrs.add(s.getsockname()[0])
        except OSError:
            pass
    mine = PeerHost(dist.get_rank(), host, tuple(sorted(addrs)),
                    _probe_port(dist.get_world_size()))
    peers: list[PeerHost | None] = [None] * dist.get_world_size()
    dist.all_gather_object(peers, mine)
    return peers


_ADDRESS = re.compile(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?(?::\d+)?")


def describe_lost_peer(error: BaseException, peers: list[PeerHost], me: int) -> str | None:
    """"lost host X (ranks ...)" when ``error`` is a transport failure that
    names a peer's address (gloo: "Read error [10.0.0.2]:4242: Connection
    reset by peer"); None when it names no known peer."""
    text = str(error)
    mine = set(peers[me].addresses) if 0 <= me < len(peers) else set()
    for addr in _ADDRESS.findall(text):
        if addr in mine:
            continue
        hit = [p for p in peers if addr in p.addresses]
        if hit:
            ranks = sorted(p.rank for p in peers if p.host == hit[0].host)
            first = text.strip().splitlines()[0][:300]
            return (f"lost contact with host {hit[0].host} (ranks {ranks}, {addr}): {first}")
    return None


# ------------------------------------------------------- silent peers
# What gloo, the giant backend and DCP say when a peer stops answering: a
# timeout ("Timed out waiting 20000ms for recv operation"), a pair closed
# after one ("Application timeout caused pair closure"), or a transport error.
_FAILURE_TEXTS = ("timed out", "pair closure", "connection closed by peer",
                  "connection reset by peer", "broken pipe", "network is unreachable",
                  "no route to host")
_FAILURE_TYPES = ("DistBackendError", "DistNetworkError", "CommError")
_SOURCE_PREFIX = re.compile(r"^\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")


def _chain(error: BaseException):
    """``error``, its causes and contexts, and DCP's wrapped failures."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> error
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()
                     if isinstance(f, BaseException) or isinstance(f, tuple)]
        todo += [e.__cause__, e.__context__]


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out or lost its transport
    (anywhere in its chain): the failures a silent peer causes. Bad input
    (ValueError, ConfigError) never is, whatever its text says."""
    for e in _chain(error):
        if isinstance(e, BaseException) and type(e).__name__ in _FAILURE_TYPES:
            return True
        if isinstance(e, ValueError) and not isinstance(e, RuntimeError):
            continue
        if is_collective_failure_text(_text(e)):
            return True
    return False


def _text(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:  # noqa: BLE001 - a malformed wrapper (DCP's) is not the error itself
        return type(e).__name__


def probe_host(peer: PeerHost, timeout_s: float) -> str:
    """"answers", "process gone" (the host refuses the rank's probe port) or
    why the host did not answer within ``timeout_s`` ("no answer within 3 s",
    "network is unreachable"). A refusal is an answer: only a host behind a
    dead link or a dead machine stays silent."""
    import errno
    import socket

    why = "no address known"
    for addr in peer.addresses:
        try:
            with socket.create_connection((addr, peer.port or 9), timeout=timeout_s):
                return "answers"
        except ConnectionRefusedError:
            return "process gone" if peer.port else "answers"
        except TimeoutError:
            why = f"no answer within {timeout_s:g} s"
        except OSError as e:
            why = os.strerror(e.errno).lower() if e.errno else str(e)
            if e.errno == errno.ECONNRESET:
                return "answers"
    return why


def probe_peer_hosts(peers: list[PeerHost], me: int, timeout_s: float = 3.0) -> dict[str, str]:
    """Each other host's :func:`probe_host` verdict, probing its first rank;
    all hosts at once, so the whole probe takes at most ``timeout_s`` per address."""
    from concurrent.futures import ThreadPoolExecutor

    mine = peers[me].host if 0 <= me < len(peers) else None
    first: dict[str, PeerHost] = {}
    for p in peers:
        if p is not None and p.host != mine:
            first.setdefault(p.host, p)
    if not first:
        return {}
    with ThreadPoolExecutor(max_workers=min(64, len(first))) as pool:
        verdicts = pool.map(lambda p: probe_host(p, timeout_s), first.values())
        return dict(zip(first, verdicts))


def describe_silent_peers(error: BaseException, peers: list[PeerHost], me: int,
                          verdicts: dict[str, str], reached: dict[int, str] | None = None,
                          here: str = "") -> str | None:
    """The one line for a collective that failed because hosts went silent:
    "lost contact with host host1 (ranks [2, 3], 10.50.0.2): no answer within
    3 s; newest reached: ranks [2, 3] step 4 forward_backward; rank 0 on host0
    waited in ...: Timed out waiting ...". ``verdicts`` are
    :func:`probe_peer_hosts`'s, ``reached`` each rank's newest phase or
    collective where known, ``here`` where this rank waited. None when
    every host answers: then the peers are alive and the cause is elsewhere."""
    lost = {h: v for h, v in verdicts.items() if v != "answers"}
    if not lost:
        return None
    reached = reached or {}
    names, seen = [], []
    for host, verdict in lost.items():
        ranks = sorted(p.rank for p in peers if p.host == host)
        addr = next((a for p in peers if p.host == host for a in p.addresses), "?")
        names.append(f"{host} (ranks {ranks}, {addr}): {verdict}")
        known = sorted({reached[r] for r in ranks if r in reached})
        seen.append(f"{host} {' / '.join(known) if known else 'not known from here'}")
    text = next((_text(e) for e in _chain(error) if is_collective_failure_text(_text(e))),
                _text(error))
    # gloo prefixes its source location: "[.../unbound_buffer.cc:78] Timed out ..."
    first = _SOURCE_PREFIX.sub("", (text.strip().splitlines() or [""])[0])[:300]
    mine = peers[me].host if 0 <= me < len(peers) else "?"
    return (f"lost contact with host{'s' if len(names) > 1 else ''} {'; '.join(names)}; "
            f"newest reached: {', '.join(seen)}; rank {me} on {mine} waited in "
            f"{here or 'a collective'}: {first}")


def is_collective_failure_text(text: str) -> bool:
    """Whether ``text`` reads like a timed-out or broken collective."""
    text = text.lower()
    return any(t in text for t in _FAILURE_TEXTS)
