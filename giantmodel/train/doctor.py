"""``giantmodel doctor``: check a machine before training on it.

Run it on a new machine, or on every node of a new cluster under torchrun
(``torchrun --nnodes N --nproc-per-node G ... -m giantmodel doctor``): each
rank checks its own host, and rank 0 prints every rank's problems, the
rendezvous, and a short all-reduce and send/recv probe
(:mod:`giantmodel.train.doctor_dist`).

Every check is one line: ``ok``, ``info``, ``warn`` (training runs, maybe
slower) or ``FAIL`` (training will not start or will crash). A warn or FAIL
line names its fix. The exit status is 1 when any rank has a FAIL line.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from giantmodel import comm
from giantmodel.config import ConfigError, JobConfig, load_config
from giantmodel.train.doctor_check import Check
from giantmodel.train.doctor_dist import distributed_report

MIB, GIB = 1 << 20, 1 << 30
MIN_TORCH = (2, 11)
# The giant backend maps one segment per process group a rank joins (the
# world, dp, tp, cp, pp groups: 4 is typical), each local_ranks x 2 slots x a
# chunk of up to 4 MiB (csrc/giant_shm.cpp gm_open).
_GIANT_GROUPS, _GIANT_CHUNK = 4, 4 * MIB
# NCCL's intra-node shared-memory transport and DataLoader workers want more
# than Docker's 64 MiB default; NVIDIA's containers ask for --shm-size=1g+.
SHM_RECOMMENDED = GIB
SHM_FIX = ("mount a larger /dev/shm: docker run --shm-size=16g (or --ipc=host), Kubernetes an "
           "emptyDir with medium: Memory, a host: mount -o remount,size=16G /dev/shm")
NOFILE_RECOMMENDED = 65536
# (label, import name, distributions that provide it, what it is for)
OPTIONAL = (
    ("transformers", "transformers", ("transformers",), "HF models and tokenizers"),
    ("diffusers", "diffusers", ("diffusers",), "Stable Diffusion weights"),
    ("peft", "peft", ("peft",), "exported LoRA adapters"),
    ("torchao", "torchao", ("torchao",), "QLoRA NF4, fp8 tensorwise/rowwise"),
    ("transformer-engine", "transformer_engine",
     ("transformer_engine", "transformer-engine", "transformer_engine_torch"), "fp8 linears"),
    ("apex", "apex", ("apex",), "fused norms and FusedAdam"),
    ("liger-kernel", "liger_kernel", ("liger-kernel", "liger_kernel"), "fused cross-entropy"),
    ("tensorboard", "tensorboard", ("tensorboard",), "run.loggers tensorboard"),
    ("wandb", "wandb", ("wandb",), "run.loggers wandb"),
    ("mlflow", "mlflow", ("mlflow", "mlflow-skinny"), "run.loggers mlflow"),
    ("matplotlib", "matplotlib", ("matplotlib",), "plots"),
    ("tqdm", "tqdm", ("tqdm",), "the live progress bar"),
)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def check_versions() -> list[Check]:
    py = platform.python_version()
    out = [Check("python", "ok" if sys.version_info >= (3, 10) else "fail", py,
                 "use Python 3.10 or newer")]
    ver = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    cuda = torch.version.cuda or "none"
    nccl = "none"
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        try:
            v = torch.cuda.nccl.version()  # a tuple; an int (2708) on old builds
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # an NCCL that cannot report its version is reported as such
            nccl = "unknown"
    out.append(Check("torch", "ok" if ver >= MIN_TORCH else "fail",
                     f"{torch.__version__} (CUDA {cuda}, NCCL {nccl})",
                     f"pip install 'torch>={'.'.join(map(str, MIN_TORCH))}'"))
    return out


def _nvidia_smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def check_gpus() -> list[Check]:
    listed = _nvidia_smi("-L")
    if not torch.cuda.is_available():
        if listed and listed.strip():
            n = len(listed.strip().splitlines())
            return [Check("gpus", "fail", f"nvidia-smi sees {n} GPU(s), torch sees none "
                          f"(torch CUDA {torch.version.cuda or 'none'})",
                          "install a torch build for this driver's CUDA (pip install torch "
                          "--index-url https://download.pytorch.org/whl/cu12x), or check "
                          "CUDA_VISIBLE_DEVICES")]
        return [Check("gpus", "info", "none: training runs on the CPU")]
    names = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        names.append(f"{i}: {p.name} {p.total_memory / GIB:.0f} GiB cc {p.major}.{p.minor}")
    out = [Check("gpus", "ok", "; ".join(names))]
    topo = _nvidia_smi("topo", "-m")
    if topo:
        out += [Check("topology", "info", line.rstrip()) for line in topo.splitlines()
                if line.strip()]
    return out


def check_extension(status: str | None = None) -> Check:
    if status is None:
        status = comm.extension_status()
    if status.startswith("missing"):
        return Check("comm ext", "warn", f"{status} (slower CPU collectives)",
                     "install a C++ compiler (apt-get install g++) and run "
                     "`python csrc/build_ext.py` in the source tree (or pip install -e .)")
    return Check("comm ext", "ok", status)


def check_shm(path: str, local_ranks: int) -> Check:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check("shm", "fail", f"{path}: {e.strerror}", SHM_FIX)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    need = _GIANT_GROUPS * local_ranks * 2 * _GIANT_CHUNK
    detail = (f"{path}: {_gib(free)} free of {_gib(total)}; {local_ranks} local ranks need "
              f"{_gib(need)} for the giant backend, NCCL and DataLoader workers "
              f"{_gib(SHM_RECOMMENDED)}+")
    if free < need:
        return Check("shm", "fail", detail, SHM_FIX)
    if total < SHM_RECOMMENDED:
        return Check("shm", "warn", detail, SHM_FIX)
    return Check("shm", "ok", detail)


def _limit(value: int) -> str:
    import resource
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def check_limits() -> list[Check]:
    try:
        import resource
    except ImportError:
        return [Check("limits", "info", "not a Unix host: not checked")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile = Check("open files", "ok", f"{_limit(soft)} (hard {_limit(hard)})")
    if soft != resource.RLIM_INFINITY and soft < NOFILE_RECOMMENDED:
        raise_to = _limit(hard) if hard == resource.RLIM_INFINITY or hard > soft else "1048576"
        nofile = Check("open files", "fail" if soft < 1024 else "warn", nofile.detail +
                       f": sockets, shared-memory handles and DataLoader workers need "
                       f"{NOFILE_RECOMMENDED}+",
                       f"ulimit -n {raise_to} before launching (docker: --ulimit "
                       "nofile=1048576:1048576; systemd: LimitNOFILE)")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    ib = Path("/sys/class/infiniband")
    has_ib = ib.is_dir() and any(ib.iterdir())
    detail = f"{_limit(soft if soft == resource.RLIM_INFINITY else soft // 1024)}" + (
        "" if soft == resource.RLIM_INFINITY else " KiB")
    memlock = Check("locked mem", "ok", detail)
    if soft != resource.RLIM_INFINITY:
        status = "warn" if has_ib else "info"
        memlock = Check("locked mem", status, detail + (
            ": InfiniBand/RoCE (NCCL's IB transport) registers memory and needs unlimited"
            if has_ib else " (matters only for InfiniBand/RoCE, none here)"),
            "ulimit -l unlimited (docker: --ulimit memlock=-1; Slurm: PropagateResourceLimits)")
    return [nofile, memlock]


def _ipv4(name: str) -> str:
    try:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])  # SIOCGIFADDR
    except (OSError, ImportError):
        return "-"


def interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def nccl_matches(spec: str, names: list[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME selects: comma-separated prefixes;
    ``^`` excludes them, ``=`` makes them exact names (NCCL's documented rules)."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    pats = [p for p in spec.split(",") if p]

    def hit(n: str) -> bool:
        return any(n == p if exact else n.startswith(p) for p in pats)
    return [n for n in names if hit(n) != exclude]


def check_network(names: list[str] | None = None, env: dict | None = None) -> list[Check]:
    names = interfaces() if names is None else names
    env = os.environ if env is None else env

    def describe(n: str) -> str:
        state = Path(f"/sys/class/net/{n}/operstate")
        up = state.read_text().strip() if state.exists() else "?"
        return f"{n} {_ipv4(n)} ({up})"
    out = [Check("interfaces", "ok" if names else "warn", ", ".join(describe(n) for n in names)
                 or "none found", "check the container's network (docker --network host)")]
    listed = ", ".join(names) or "none"
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec:
        picked = nccl_matches(spec, names)
        out.append(Check("NCCL_SOCKET_IFNAME", "ok" if picked else "fail",
                         f"{spec!r} selects {', '.join(picked) or 'no interface'} (here: {listed})",
                         f"set NCCL_SOCKET_IFNAME to one of {listed}, or unset it"))
    spec = env.get("GLOO_SOCKET_IFNAME")
    if spec:
        missing = [n for n in spec.split(",") if n and n not in names]
        out.append(Check("GLOO_SOCKET_IFNAME", "fail" if missing else "ok",
                         f"{spec!r}" + (f": no interface {', '.join(missing)} (here: {listed})"
                                        if missing else ""),
                         f"set GLOO_SOCKET_IFNAME to one of {listed}, or unset it"))
    if not spec and not env.get("NCCL_SOCKET_IFNAME"):
        out.append(Check("socket vars", "info", "NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME unset: "
                         "the libraries pick an interface (set them on multi-homed hosts)"))
    return out


def checkpoint_bytes(cfg) -> int | None:
    """One checkpoint of ``cfg``'s model: fp32 weights and two Adam moments."""
    try:
        return 12 * int(cfg.model.num_params(include_embeddings=True))
    except Exception:  # a model whose size needs its files (HF init): not estimated
        return None


def check_disk(run_dir: str, ckpt_bytes: int | None, keep: int) -> Check:
    path = Path(run_dir).absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if not os.access(probe, os.W_OK):
        return Check("disk", "fail", f"{path}: {probe} is not writable",
                     "set run.dir to a writable directory")
    detail = f"{path}: {_gib(free)} free"
    if not ckpt_bytes:
        return Check("disk", "ok", detail)
    need = ckpt_bytes * (max(keep, 1) + 1)  # the kept ones and the one being written
    detail += f"; a checkpoint is ~{_gib(ckpt_bytes)}, checkpoint.keep={keep} needs {_gib(need)}"
    fix = "free space, or point run.dir at a larger disk (run.dir=/path)"
    if free < ckpt_bytes:
        return Check("disk", "fail", detail, fix)
    return Check("disk", "warn" if free < need else "ok", detail, fix)


def _dist_version(dists: tuple[str, ...]) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_packages() -> list[Check]:
    """Presence and version only: nothing is imported (transformer-engine's
    import alone initialises CUDA)."""
    out = []
    for label, module, dists, purpose in OPTIONAL:
        spec = importlib.util.find_spec(module)
        if spec is None:
            out.append(Check(label, "info", f"not installed ({purpose})"))
            continue
        version = _dist_version(dists) or "?"
        if label == "apex":
            where = spec.submodule_search_locations or []
            if not any((Path(p) / "optimizers").is_dir() for p in where):
                out.append(Check(label, "warn", f"{version}: this 'apex' has no apex.optimizers "
                                 "(PyPI's unrelated web toolkit, not NVIDIA's)",
                                 "pip uninstall apex; build NVIDIA's from "
                                 "https://github.com/NVIDIA/apex"))
                continue
        out.append(Check(label, "ok", f"{version} ({purpose})"))
    return out


def local_ranks_default() -> int:
    """Ranks that will share this host: torchrun's LOCAL_WORLD_SIZE, else
    one per GPU, else 8 (a full node)."""
    if os.environ.get("LOCAL_WORLD_SIZE"):
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return torch.cuda.device_count() if torch.cuda.is_available() else 8


def run_checks(cfg=None, shm_path: str = "/dev/shm", local_ranks: int | None = None,
               extension: str | None = None) -> list[Check]:
    """Every check of this host, in report order. ``cfg``: the job whose
    run.dir and checkpoint size are checked (None: the default job)."""
    cfg = cfg or JobConfig()
    checks = check_versions() + check_gpus() + [check_extension(extension)]
    checks.append(check_shm(shm_path, local_ranks or local_ranks_default()))
    checks += check_limits() + check_network()
    checks.append(check_disk(cfg.run.dir, checkpoint_bytes(cfg), cfg.checkpoint.keep))
    return checks + check_packages()


def summary(checks: list[Check]) -> str:
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    if fails:
        return f"doctor: {fails} problem(s) block training (FAIL lines), {warns} warning(s)"
    return f"doctor: nothing blocks training ({warns} warning(s))"


def add_arguments(p) -> None:
    p.add_argument("--config", "-c", help="the job whose run.dir and checkpoint size to check "
                   "(default: the embedded tiny LLaMA)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    p.add_argument("--shm", default="/dev/shm", help="the shared-memory mount to check")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per host to size /dev/shm for (default: LOCAL_WORLD_SIZE under "
                   "torchrun, else the GPUs, else 8)")
    p.add_argument("--probe-mb", type=float, default=None,
                   help="under torchrun: the all-reduce and send/recv probe's size "
                   "(default 64 MiB on GPUs, 8 MiB on CPUs)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="under torchrun: seconds to wait for the rendezvous and the probe")


def main(args) -> int:
    """Print every check (rank 0 under torchrun, with every rank's problems
    and the probe); 1 when anything blocks training on any rank."""
    try:
        cfg, bad = load_config(args.config, list(args.overrides or [])), None
    except ConfigError as e:
        cfg, bad = None, Check("config", "fail", str(e), "fix the config key it names")
    checks = run_checks(cfg, args.shm, args.nproc_per_node)
    if bad is not None:
        checks.insert(0, bad)
    local, lines = checks, []
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        lines, checks = distributed_report(local, args.probe_mb, args.timeout)
        if lines is None:  # not rank 0: rank 0 prints everything
            return 1 if any(c.status == "fail" for c in checks) else 0
    print(f"giantmodel doctor on {socket.gethostname()}")
    for c in local:
        print(c.line())
    for line in lines:
        print(line)
    print(summary(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0
