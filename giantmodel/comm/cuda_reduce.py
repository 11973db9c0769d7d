"""CPU-Reduce: all-reduce CUDA tensors through host shared memory.

For PCIe hosts whose GPUs cannot reach each other directly, a ring over NCCL
crosses PCIe many times per byte. CPU-Reduce crosses it twice: each rank
copies its tensor to pinned host memory, the host reduces in shared memory
with the C++ core, and each rank copies the result back. Chunks are
pipelined: while the host reduces chunk c, the copy engine brings chunk c+1
down (side stream ``d2h``) and takes chunk c-1 back up (side stream ``h2d``).
Because nothing here needs peer access or NCCL, several processes may share
one GPU, which is how the path is tested on a single-GPU machine.

``scale_cast`` from ``csrc/giant_cuda.cu`` (built at first use when nvcc and a
CUDA torch exist) folds the average's 1/world scale into the copy back; plain
torch ops do the same when it cannot be built.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from giantmodel.comm.shm import OP_AVG, ShmGroup

log = logging.getLogger(__name__)
_ext: dict[str, object] = {}


def cuda_ext():
    """The JIT-built CUDA extension, or None (after one log line)."""
    if "mod" in _ext:
        return _ext["mod"]
    mod = None
    src = Path(__file__).resolve().parents[2] / "csrc" / "giant_cuda.cu"
    if torch.cuda.is_available() and torch.version.cuda and src.exists():
        try:
            from torch.utils.cpp_extension import load

            build = Path(os.environ.get("GIANTMODEL_CACHE", Path.home() / ".cache" / "giantmodel"))
            (build / "cuda_ext").mkdir(parents=True, exist_ok=True)
            mod = load(name="giant_cuda", sources=[str(src)], extra_cuda_cflags=["-O3"],
                       build_directory=str(build / "cuda_ext"), verbose=False)
        except Exception as exc:  # noqa: BLE001 - fall back to torch ops
            log.warning("giantmodel.comm: CUDA kernels unavailable (%s); using torch ops", exc)
    _ext["mod"] = mod
    return mod


class CpuReduce:
    """Chunked, pipelined all-reduce of CUDA tensors on the host."""

    def __init__(self, shm: ShmGroup, chunk_bytes: int | None = None):
        self.shm = shm
        self.chunk_bytes = chunk_bytes or shm.chunk_bytes
        self._host: dict[torch.dtype, list[torch.Tensor]] = {}
        self._streams: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def _buffers(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Two (in, out) pinned pairs per dtype, reused across calls."""
        if dtype not in self._host:
            n = self.chunk_bytes // torch.tensor([], dtype=dtype).element_size()
            self._host[dtype] = [torch.empty(n, dtype=dtype, pin_memory=True) for _ in range(4)]
        return self._host[dtype]

    def _side_streams(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            self._streams[idx] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[idx]

    def all_reduce(self, t: torch.Tensor, op: int, scale: float,
                   stream: torch.cuda.Stream | None = None, premul: float | None = None) -> None:
        """In place on a contiguous CUDA tensor; same semantics as the CPU core.

        ``stream`` is the caller's stream (the tensor's producer and later
        consumers); ``premul`` scales every rank's input before the sum, as
        ReduceOp.PREMUL_SUM defines, on the GPU.

        Runs with ``t``'s GPU as the current device. The group's engine
        thread starts on device 0, and whatever it creates without naming a
        device -- the pinned buffers, the events, the extension's kernel
        launch -- would open a context on GPU 0 in every rank's process (or
        fail: an event made on GPU 0 cannot be recorded on GPU 1's stream).
        The block restores the caller's device, so an inline call leaves its
        caller as it was.
        """
        with torch.cuda.device(t.device):
            self._all_reduce(t, op, scale, stream, premul)

    def _all_reduce(self, t: torch.Tensor, op: int, scale: float,
                    stream: torch.cuda.Stream | None, premul: float | None) -> None:
        flat = t.view(-1)
        n = flat.numel()
        if n == 0:
            return
        compute = stream or torch.cuda.current_stream(t.device)
        if premul is not None:
            with torch.cuda.stream(compute):
                ext = cuda_ext()
                if ext is not None and t.dtype in (torch.float32, torch.bfloat16, torch.float16):
                    ext.scale_cast(flat, flat, premul)
                else:
                    flat.mul_(premul)
        bufs = self._buffers(t.dtype)
        per = bufs[0].numel()
        d2h, h2d = self._side_streams(t.device)
        d2h.wait_stream(compute)  # the tensor's producer must finish first
        chunks = [(s, min(per, n - s)) for s in range(0, n, per)]
        down = [torch.cuda.Event() for _ in chunks]
        up = [torch.cuda.Event() for _ in chunks]

        def copy_down(i: int) -> None:
            s, m = chunks[i]
            # host_in[i % 2] is free: chunk i-2's host reduce, which read it,
            # returned before this copy is queued.
            with torch.cuda.stream(d2h):
                bufs[i % 2][:m].copy_(flat[s:s + m], non_blocking=True)
                down[i].record(d2h)

        copy_down(0)
        for i, (s, m) in enumerate(chunks):
            if i + 1 < len(chunks):
                copy_down(i + 1)
            down[i].synchronize()
            host_in, host_out = bufs[i % 2][:m], bufs[2 + i % 2][:m]
            if i >= 2:
                up[i - 2].synchronize()  # host_out[i%2] went back up already
            self.shm.all_reduce_scaled(host_in, host_out, op, scale if op == OP_AVG else 1.0)
            with torch.cuda.stream(h2d):
                flat[s:s + m].copy_(host_out, non_blocking=True)
                up[i].record(h2d)
        compute.wait_stream(h2d)  # later kernels on the compute stream see the result
        t.record_stream(h2d)
