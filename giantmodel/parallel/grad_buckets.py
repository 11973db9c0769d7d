"""Gradient buckets all-reduced while backward is still running.

Parameters are grouped, in reverse registration order (roughly the order in
which backward finishes them), into buckets of ``parallel.bucket_mb``. On
the last micro-batch of a step, a post-accumulate-grad hook counts each
bucket down; a full bucket is flattened and its asynchronous all-reduce
launched at once, so communication overlaps the rest of backward. Buckets
are launched strictly in index order on every rank (a ready bucket waits for
its predecessors), which keeps the collective sequence identical across
ranks whatever the autograd engine's scheduling.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class OverlappedReducer:
    def __init__(self, params: list[torch.Tensor], group, bucket_bytes: int):
        self.group = group
        self.buckets: list[list[torch.Tensor]] = []
        size = 0
        for p in reversed(params):
            if not p.requires_grad:
                continue
            nbytes = _local(p).numel() * p.element_size()
            if self.buckets and size + nbytes <= bucket_bytes:
                self.buckets[-1].append(p)
                size += nbytes
            else:
                self.buckets.append([p])
                size = nbytes
        self._bucket_of = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        self.armed = False
        self._pending: list[int] = []
        self._next = 0
        self._inflight: list[tuple[object, torch.Tensor, list[torch.Tensor]]] = []
        self.launched_in_backward = 0  # buckets the last step sent before backward ended
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for ps in self.buckets for p in ps]

    def arm(self, last_microbatch: bool) -> None:
        """Call before each micro-batch's backward; only the last one reduces."""
        self.armed = last_microbatch
        if last_microbatch:
            self._pending = [len(ps) for ps in self.buckets]
            self._next = 0
            self._inflight = []

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        self._pending[self._bucket_of[id(p)]] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        grads = [_local(p.grad) for p in self.buckets[b] if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._inflight.append((work, flat, grads))

    @torch.no_grad()
    def finish(self) -> None:
        """Launch what backward left (unused parameters), wait, write back."""
        self.launched_in_backward = self._next
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        for work, flat, grads in self._inflight:
            work.wait()
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._inflight = []
        self.armed = False
