"""Each peer in its own virtual environment, made on first use.

The environments are created with ``--system-site-packages`` so they reuse
the installed torch, and pip runs with a constraints file pinning torch to
that exact version: pip fails instead of ever replacing it. After an install
the environment's torch is checked to be the system one. Peer packages never
enter giantmodel's own environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Peer:
    name: str
    packages: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    """Environment for pip (e.g. skip building optional native ops at install)."""


DEEPSPEED = Peer("deepspeed", ("deepspeed==0.19.8",), (("DS_BUILD_OPS", "0"),
                                                        ("DS_ACCELERATOR", "cpu")))
# GPU peers (benchmarks/peers/gpu/): installed only by --suite gpu on a CUDA host.
MEGATRON = Peer("megatron", ("megatron-core",))
TORCHTITAN = Peer("torchtitan", ("torchtitan",))


def cache_root() -> Path:
    base = os.environ.get("GIANTMODEL_CACHE") or os.path.expanduser("~/.cache/giantmodel")
    return Path(base) / "peers"


def _python(root: Path) -> Path:
    return root / "bin" / "python"


def _run(cmd: list, env: dict | None = None, log: Path | None = None) -> None:
    out = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, check=False)
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(map(str, cmd))}\n{out.stdout}{out.stderr}\n")
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n"
                           f"{(out.stdout + out.stderr)[-3000:]}")


def ensure(peer: Peer, say=print) -> Path:
    """The peer's Python, creating and installing its environment if needed."""
    root = cache_root() / f"venv-{peer.name}"
    marker = root / "giantmodel-peer.json"
    want = {"packages": list(peer.packages), "torch": torch.__version__,
            "python": sys.version.split()[0]}
    if marker.is_file() and json.loads(marker.read_text()).get("want") == want:
        return _python(root)
    t0 = time.perf_counter()
    say(f"[peers] creating {root} for {', '.join(peer.packages)} (first use)")
    root.parent.mkdir(parents=True, exist_ok=True)
    log = root.parent / f"venv-{peer.name}.log"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", root], log=log)
    py = _python(root)
    constraints = root / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__}\n")
    env = {**os.environ, **dict(peer.env), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # setuptools/wheel first: peers that build from source need them, and
    # --no-build-isolation (below) keeps pip from fetching a torch to build against.
    _run([py, "-m", "pip", "install", "-q", "setuptools", "wheel"], env=env, log=log)
    _run([py, "-m", "pip", "install", "-q", "--no-build-isolation", "-c", constraints,
          *peer.packages], env=env, log=log)
    probe = "import torch; print(torch.__version__, torch.__file__)"
    got = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, env=env,
                         check=False).stdout.split()
    system_site = str(Path(torch.__file__).parents[1])
    if not got or got[0] != torch.__version__ or not got[1].startswith(system_site):
        raise RuntimeError(f"{root}: torch is {got}, not the system's {torch.__version__}; "
                           "delete the environment and report this")
    marker.write_text(json.dumps({"want": want, "created_s": round(time.perf_counter() - t0, 1)}))
    say(f"[peers] {peer.name} environment ready in {time.perf_counter() - t0:.0f} s")
    return py


def torch_extensions_dir() -> Path:
    """Where peers JIT-build their native ops (kept between runs)."""
    d = cache_root() / "torch_extensions"
    d.mkdir(parents=True, exist_ok=True)
    return d


def prebuild_deepspeed_ops(py: Path, env: dict, say=print) -> float:
    """Build DeepSpeed's CPU ops (fused AdamW, shared-memory comm) once, in one
    process, before any timed run: ranks building them at once would race, and
    the build would land in the first run's time. Returns seconds spent."""
    ext = Path(env["TORCH_EXTENSIONS_DIR"])
    for lock in ext.glob("*/lock"):
        lock.unlink()  # left by a build that was killed; only this suite uses ext
    t0 = time.perf_counter()
    code = ("from deepspeed.accelerator import get_accelerator as g\n"
            "for n in ('FusedAdamBuilder', 'ShareMemCommBuilder'):\n"
            "    g().create_op_builder(n).load()\n")
    _run([py, "-c", code], env=env, log=cache_root() / "venv-deepspeed.log")
    dt = time.perf_counter() - t0
    if dt > 5:
        say(f"[peers] built DeepSpeed's CPU ops in {dt:.0f} s")
    return dt
