"""Measure this machine as a planner hardware profile (``giantmodel bench hw``).

Times large matrix multiplies per precision (achieved FLOP/s) and a large
copy (memory bandwidth: bytes read + written per second) on the chosen
device, then writes a profile YAML the planner reads with ``--hw-file`` (or,
for the CPU, the default location that the built-in ``cpu`` profile uses).
Measured rates are stored as peaks with efficiency 1.0 for matmuls and
memory: they already are what kernels achieve here.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml

from giantmodel.config.errors import ConfigError
from giantmodel.planner.hardware import CPU_PROFILE_FILE, GB

DTYPES = ("fp32", "bf16", "fp16")


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best_time(fn, device: str, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(device: str, dtype: str, n: int, repeats: int = 3) -> float:
    """Achieved FLOP/s of an n x n x n matmul (best of ``repeats``)."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    return 2.0 * n ** 3 / _best_time(lambda: a @ b, device, repeats)


def memory_bandwidth(device: str, nbytes: int, repeats: int = 3) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _best_time(lambda: dst.copy_(src), device, repeats)


def measure(device: str = "cpu", size: int | None = None, mem_mb: int | None = None) -> dict:
    """A profile mapping (fields of HardwareProfile) for ``device``."""
    import os

    import torch

    gpu = device.startswith("cuda")
    n = size or (8192 if gpu else 1024)
    nbytes = (mem_mb or (1024 if gpu else 256)) * 2 ** 20
    peaks = {}
    for dt in DTYPES:
        try:
            peaks[dt] = matmul_flops(device, dt, n)
        except RuntimeError:  # a dtype the device cannot multiply
            continue
    bw = memory_bandwidth(device, nbytes)
    if gpu:
        props = torch.cuda.get_device_properties(device)
        capacity, gpn = float(props.total_memory), torch.cuda.device_count()
    else:
        capacity = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        gpn = 1
    return {"peak_flops": peaks, "memory_bytes": capacity, "memory_bw": bw,
            "intra_link": "nvlink4" if gpu else "shm", "intra_bw": bw / 8 if not gpu else 100 * GB,
            "inter_bw": 12.5 * GB if gpu else 1.25 * GB, "gpus_per_node": gpn,
            "matmul_efficiency": 1.0, "matmul_knee": 512.0 if gpu else 32.0,
            "attention_efficiency": 0.5, "memory_efficiency": 1.0,
            "link_efficiency": 0.8, "reserved_bytes": 2.5 * GB if gpu else 0.5 * GB,
            "host_memory_bytes": capacity}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--name", default=None, help="profile name (default: cpu, or the GPU's name)")
    p.add_argument("--size", type=int, default=None, help="matmul size n (n x n x n)")
    p.add_argument("--mem-mb", type=int, default=None, help="bytes copied for the bandwidth test")
    p.add_argument("--out", default=None,
                   help=f"profile YAML to write (default for cpu: {CPU_PROFILE_FILE})")


def main(args) -> int:

    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise ConfigError(f"--device must be cpu or cuda[:N], got {args.device!r}", "--device")
    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for but no CUDA device is visible", "--device")
    prof = measure(args.device, args.size, args.mem_mb)
    name = args.name or ("cpu" if args.device == "cpu" else "measured-gpu")
    out = Path(args.out) if args.out else (CPU_PROFILE_FILE if name == "cpu" else Path(f"{name}.yaml"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump({name: prof}, sort_keys=False))
    for dt, f in prof["peak_flops"].items():
        print(f"matmul {dt:<5} {f / 1e12:8.3f} TFLOP/s")
    print(f"memory bandwidth {prof['memory_bw'] / GB:8.1f} GB/s (read + write)")
    print(f"wrote profile {name!r} to {out}")
    return 0
