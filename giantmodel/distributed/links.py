"""The link topology of a job: which ranks share a host, and the latency (α)
and bandwidth (β) between every pair of ranks.

It is measured by ``giantmodel bench topology`` (or at start-up with
``comm.topology: measure``), or declared by hand for a fabric that is known.
Both use one YAML format (``topology.yaml``)::

    version: 1
    source: declared            # or "measured" (written by the probe)
    hosts:                      # global ranks on each host
      - {name: node0, ranks: [0, 1, 2, 3, 4, 5, 6, 7], nics: 8}
      - {name: node1, ranks: [8, 9, 10, 11, 12, 13, 14, 15], nics: 8}
    classes:                    # link classes, fastest first
      - name: nvlink
        latency_us: 3
        bandwidth_gbytes: 150   # GB/s = 1e9 bytes/s, one direction
        groups: [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
      - {name: pcie, latency_us: 8, bandwidth_gbytes: 20, groups: hosts}
      - {name: infiniband, latency_us: 12, bandwidth_gbytes: 25}

A pair of ranks takes the first class whose groups hold both (``groups:
hosts`` is each host's ranks; no ``groups`` is every rank). ``nics`` is how
many flows can leave the host at full bandwidth at once (default 1).
Measured files also carry the full ``latency_us`` / ``bandwidth_gbytes``
matrices (rank by rank), which take precedence over the classes, and the
host-by-host matrices (``host_latency_us`` / ``host_bandwidth_gbytes``,
diagonal = inside a host) that let a cached measurement serve another rank
order on the same hosts.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from giantmodel.config.errors import UserInputError

VERSION = 1


@dataclass
class LinkClass:
    name: str
    latency_s: float
    bandwidth: float
    """Bytes per second."""
    groups: list[list[int]] | None = None
    """Ranks joined by this class; None = every rank."""


@dataclass
class LinkTopology:
    """Ranks, hosts and the α/β matrices between ranks."""

    host_names: list[str]
    host_ranks: list[list[int]]
    alpha: np.ndarray
    """[world, world] one-way latency in seconds (0 on the diagonal)."""
    beta: np.ndarray
    """[world, world] bandwidth in bytes/s (inf on the diagonal)."""
    nics: list[int] = field(default_factory=list)
    classes: list[LinkClass] = field(default_factory=list)
    source: str = "declared"
    backend: str = ""
    host_alpha: np.ndarray | None = None
    host_beta: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not self.nics:
            self.nics = [1] * len(self.host_names)
        self.host_of = np.empty(self.world_size, dtype=np.int64)
        for h, ranks in enumerate(self.host_ranks):
            self.host_of[ranks] = h

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.host_ranks)

    @property
    def num_hosts(self) -> int:
        return len(self.host_names)

    def levels(self) -> list[tuple[str, list[list[int]]]]:
        """Rank groups from the finest link class to the coarsest: the groups
        of each class merged with those of every faster class."""
        out, seen = [], set()
        n = self.world_size
        parent = list(range(n))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for cls in self.classes:
            for g in cls.groups if cls.groups is not None else [list(range(n))]:
                for r in g[1:]:
                    parent[find(r)] = find(g[0])
            comps: dict[int, list[int]] = {}
            for r in range(n):
                comps.setdefault(find(r), []).append(r)
            key = tuple(sorted(tuple(c) for c in comps.values()))
            if key not in seen:
                seen.add(key)
                out.append((cls.name, [list(c) for c in key]))
        return out

    def cache_key(self) -> str:
        return host_set_key(self.host_names, [len(r) for r in self.host_ranks], self.backend)

    # ----------------------------------------------------------------- io
    def to_dict(self) -> dict:
        d: dict = {"version": VERSION, "source": self.source}
        if self.backend:
            d["backend"] = self.backend
        d["hosts"] = [{"name": n, "ranks": list(map(int, r)), "nics": int(k)}
                      for n, r, k in zip(self.host_names, self.host_ranks, self.nics)]
        d["classes"] = [{"name": c.name, "latency_us": _r(c.latency_s * 1e6),
                         "bandwidth_gbytes": _r(c.bandwidth / 1e9),
                         **({"groups": c.groups} if c.groups is not None else {})}
                        for c in self.classes]
        d["latency_us"] = _matrix(self.alpha * 1e6)
        d["bandwidth_gbytes"] = _matrix(self.beta / 1e9)
        if self.host_alpha is not None:
            d["host_latency_us"] = _matrix(self.host_alpha * 1e6)
            d["host_bandwidth_gbytes"] = _matrix(self.host_beta / 1e9)
        return d

    def save(self, path: str | Path) -> None:
        text = "# giantmodel link topology: see docs/placement.md\n" + yaml.safe_dump(
            self.to_dict(), sort_keys=False, default_flow_style=None, width=100)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def remapped(self, host_names: list[str], host_ranks: list[list[int]]) -> LinkTopology:
        """This measurement for another rank order on the same hosts (needs
        the host-by-host matrices)."""
        if self.host_alpha is None or sorted(host_names) != sorted(self.host_names):
            raise ValueError("no host-level measurement for these hosts")
        idx = [self.host_names.index(n) for n in host_names]
        ha, hb = self.host_alpha[np.ix_(idx, idx)], self.host_beta[np.ix_(idx, idx)]
        return from_host_matrices(host_names, host_ranks, ha, hb, source=self.source,
                                  backend=self.backend, nics=[self.nics[i] for i in idx])


def _r(x: float) -> float:
    return float(f"{x:.4g}") if math.isfinite(x) else x


def _matrix(m: np.ndarray) -> list[list[float]]:
    return [[_r(float(x)) if math.isfinite(x) else 0.0 for x in row] for row in m]


def host_set_key(host_names: list[str], ranks_per_host: list[int], backend: str) -> str:
    text = ";".join(f"{n}:{k}" for n, k in sorted(zip(host_names, ranks_per_host)))
    return hashlib.sha1(f"{text}|{backend}".encode()).hexdigest()[:16]


def from_host_matrices(host_names, host_ranks, host_alpha, host_beta, *, source="measured",
                       backend="", nics=None) -> LinkTopology:
    """Expand host-by-host α/β (diagonal = inside a host) to every rank pair,
    and derive the link classes from them."""
    world = sum(len(r) for r in host_ranks)
    host_of = np.empty(world, dtype=np.int64)
    for h, ranks in enumerate(host_ranks):
        host_of[ranks] = h
    alpha = host_alpha[np.ix_(host_of, host_of)].astype(float)
    beta = host_beta[np.ix_(host_of, host_of)].astype(float)
    np.fill_diagonal(alpha, 0.0)
    np.fill_diagonal(beta, np.inf)
    topo = LinkTopology(list(host_names), [list(r) for r in host_ranks], alpha, beta,
                        nics=list(nics or []), source=source, backend=backend,
                        host_alpha=np.asarray(host_alpha, float),
                        host_beta=np.asarray(host_beta, float))
    topo.classes = derive_classes(alpha, beta, topo.host_ranks)
    return topo


def derive_classes(alpha: np.ndarray, beta: np.ndarray, host_ranks: list[list[int]],
                   gap: float = 3.0) -> list[LinkClass]:
    """Link classes from measured matrices: bandwidths sorted fastest first
    and cut where one is ``gap`` times the next; a class's groups are the
    ranks joined by links at least that fast (connected components)."""
    n = alpha.shape[0]
    iu = np.triu_indices(n, 1)
    if n == 1:
        return []
    bws = np.sort(np.unique(np.round(beta[iu], -3)))[::-1]
    cuts = [bws[0]]
    for b in bws[1:]:
        if cuts[-1] / max(b, 1.0) >= gap:
            cuts.append(b)
        else:
            cuts[-1] = b  # the slowest member bounds the class
    classes = []
    hosts_key = sorted(sorted(r) for r in host_ranks)
    for i, floor in enumerate(cuts):
        mask = beta >= floor * 0.999
        groups = _components(mask)
        in_class = mask & ~np.eye(n, dtype=bool)
        if i > 0:
            in_class &= beta < cuts[i - 1] * 0.999
        lat = float(np.median(alpha[in_class])) if in_class.any() else 0.0
        bw = float(np.median(beta[in_class])) if in_class.any() else float(floor)
        name = ("host" if sorted(groups) == hosts_key else
                "network" if len(groups) == 1 else f"link{i}")
        classes.append(LinkClass(name, lat, bw, None if len(groups) == 1 else groups))
    return classes


def _components(mask: np.ndarray) -> list[list[int]]:
    n = mask.shape[0]
    seen, out = [False] * n, []
    for s in range(n):
        if seen[s]:
            continue
        stack, comp = [s], []
        seen[s] = True
        while stack:
            x = stack.pop()
            comp.append(x)
            for y in np.nonzero(mask[x])[0]:
                if not seen[y]:
                    seen[y] = True
                    stack.append(int(y))
        out.append(sorted(comp))
    return sorted(out)


# ------------------------------------------------------------------ loading
def load_topology(path: str | Path, world_size: int | None = None) -> LinkTopology:
    """Read and check a topology file; errors name the file and the key."""
    p = Path(path)
    if not p.is_file():
        raise UserInputError(f"comm.topology: no such file {str(p)!r}; give a topology.yaml "
                             "(see 'giantmodel bench topology') or 'measure'")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UserInputError(f"{p}: not valid YAML: {e}") from None
    return parse_topology(raw, str(p), world_size)


def parse_topology(raw, where: str = "topology", world_size: int | None = None
                   ) -> LinkTopology:
    def bad(msg: str) -> UserInputError:
        return UserInputError(f"{where}: {msg}")

    if not isinstance(raw, dict):
        raise bad("must be a mapping with 'hosts' and 'classes'")
    unknown = set(raw) - {"version", "source", "backend", "hosts", "classes", "latency_us",
                          "bandwidth_gbytes", "host_latency_us", "host_bandwidth_gbytes"}
    if unknown:
        raise bad(f"unknown keys {sorted(unknown)}")
    if raw.get("version", VERSION) != VERSION:
        raise bad(f"version {raw.get('version')} is not supported (expected {VERSION})")
    names, ranks, nics = _parse_hosts(raw.get("hosts"), bad)
    world = sum(len(r) for r in ranks)
    if sorted(r for rs in ranks for r in rs) != list(range(world)):
        raise bad(f"hosts.ranks must list every rank 0..{world - 1} exactly once")
    if world_size is not None and world != world_size:
        raise bad(f"describes {world} ranks but the job has {world_size}; measure again "
                  "or fix hosts")
    classes = _parse_classes(raw.get("classes") or [], ranks, world, bad)
    if "latency_us" in raw or "bandwidth_gbytes" in raw:
        alpha = _square(raw.get("latency_us"), world, "latency_us", bad) / 1e6
        beta = _square(raw.get("bandwidth_gbytes"), world, "bandwidth_gbytes", bad) * 1e9
    elif classes:
        alpha, beta = _expand_classes(classes, world)
        if np.isnan(alpha).any():
            i, j = map(int, np.argwhere(np.isnan(alpha))[0])
            raise bad(f"no class joins ranks {i} and {j}; add a last class without groups")
    else:
        raise bad("needs 'classes' (or the latency_us / bandwidth_gbytes matrices)")
    np.fill_diagonal(alpha, 0.0)
    np.fill_diagonal(beta, np.inf)
    if (beta <= 0).any():
        raise bad("bandwidths must be positive")
    ha = hb = None
    if "host_latency_us" in raw:
        ha = _square(raw["host_latency_us"], len(names), "host_latency_us", bad) / 1e6
        hb = _square(raw.get("host_bandwidth_gbytes"), len(names), "host_bandwidth_gbytes",
                     bad) * 1e9
    return LinkTopology(names, ranks, alpha, beta, nics=nics, classes=classes,
                        source=str(raw.get("source", "declared")),
                        backend=str(raw.get("backend", "")), host_alpha=ha, host_beta=hb)


def _parse_hosts(hosts, bad):
    if not isinstance(hosts, list) or not hosts:
        raise bad("'hosts' must be a list of {name, ranks}")
    names, ranks, nics = [], [], []
    for i, h in enumerate(hosts):
        if not isinstance(h, dict) or "ranks" not in h:
            raise bad(f"hosts[{i}] must be a mapping with 'name' and 'ranks'")
        extra = set(h) - {"name", "ranks", "nics"}
        if extra:
            raise bad(f"hosts[{i}]: unknown keys {sorted(extra)}")
        rs = h["ranks"]
        if not isinstance(rs, list) or not all(isinstance(r, int) and r >= 0 for r in rs):
            raise bad(f"hosts[{i}].ranks must be a list of global ranks")
        names.append(str(h.get("name", f"host{i}")))
        ranks.append(list(rs))
        k = h.get("nics", 1)
        if not isinstance(k, int) or k < 1:
            raise bad(f"hosts[{i}].nics must be a positive integer")
        nics.append(k)
    return names, ranks, nics


def _parse_classes(raw, host_ranks, world, bad) -> list[LinkClass]:
    if not isinstance(raw, list):
        raise bad("'classes' must be a list")
    out = []
    for i, c in enumerate(raw):
        if not isinstance(c, dict):
            raise bad(f"classes[{i}] must be a mapping")
        extra = set(c) - {"name", "latency_us", "bandwidth_gbytes", "groups"}
        if extra:
            raise bad(f"classes[{i}]: unknown keys {sorted(extra)}")
        try:
            lat, bw = float(c["latency_us"]), float(c["bandwidth_gbytes"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"classes[{i}] needs numeric latency_us and bandwidth_gbytes") from None
        if lat < 0 or bw <= 0:
            raise bad(f"classes[{i}]: latency_us must be >= 0 and bandwidth_gbytes > 0")
        groups = c.get("groups")
        if groups == "hosts":
            groups = [list(r) for r in host_ranks]
        elif groups is not None and (not isinstance(groups, list) or not all(
                isinstance(g, list) and all(isinstance(r, int) and 0 <= r < world for r in g)
                for g in groups)):
            raise bad(f"classes[{i}].groups must be 'hosts' or lists of ranks < {world}")
        out.append(LinkClass(str(c.get("name", f"class{i}")), lat / 1e6, bw * 1e9, groups))
    return out


def _expand_classes(classes: list[LinkClass], world: int) -> tuple[np.ndarray, np.ndarray]:
    alpha = np.full((world, world), np.nan)
    beta = np.full((world, world), np.nan)
    for c in reversed(classes):  # the fastest class is written last and wins
        for g in c.groups if c.groups is not None else [list(range(world))]:
            idx = np.ix_(g, g)
            alpha[idx] = c.latency_s
            beta[idx] = c.bandwidth
    return alpha, beta


def _square(m, n: int, key: str, bad) -> np.ndarray:
    try:
        arr = np.asarray(m, dtype=float)
    except (TypeError, ValueError):
        raise bad(f"{key} must be a {n}x{n} matrix of numbers") from None
    if arr.shape != (n, n) or not np.isfinite(arr).all():
        raise bad(f"{key} must be a {n}x{n} matrix of finite numbers, got shape {arr.shape}")
    return arr
