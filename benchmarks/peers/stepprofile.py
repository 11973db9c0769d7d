"""Where one training step's time goes, for any system: a torch.profiler
trace of one step, folded into compute, communication, optimizer, data and
idle time on the training thread.

Each side marks its phases with :func:`phase` (``data``, ``compute``,
``optimizer``); the profiler's own collective events are communication
wherever they occur. Times are what the training thread spends, so
communication that overlaps compute on another thread does not count, and
communication the thread waits for does: this is the *exposed* share.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager

from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

PREFIX = "peer::"
PHASES = ("data", "compute", "optimizer")
# Collective events as the profiler names them: c10d ops (gloo, giant, nccl),
# functional collectives, FSDP2's gather/reduce regions and waits on Work.
COMM = re.compile(r"c10d|all_reduce|allreduce|reduce_scatter|all_gather|allgather|broadcast"
                  r"|record_param_comms|_c10d_functional|wait_tensor|::wait\b|send|recv"
                  r"|barrier|gloo|FSDP::.*(?:gather|reduce)|_reduce_scatter_base"
                  r"|_allgather_base|inference_all_reduce|giant:")


@contextmanager
def phase(name: str):
    """Mark a phase of the step (one of PHASES) for the profile."""
    with record_function(PREFIX + name):
        yield


def _category(ev) -> str:
    """comm if the event or an ancestor is a collective, else the innermost phase."""
    node, phase_name = ev, None
    while node is not None:
        if COMM.search(node.name):
            return "comm"
        if phase_name is None and node.name.startswith(PREFIX):
            phase_name = node.name[len(PREFIX):]
        node = node.cpu_parent
    return phase_name or "other"


def profile_step(step_fn) -> dict:
    """Run ``step_fn()`` once under the profiler; the step's time by category (ms)."""
    # All threads: collectives run on backend threads (gloo's, giant's engine).
    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        t0 = time.perf_counter()
        with record_function(PREFIX + "step"):
            step_fn()
        wall_ms = (time.perf_counter() - t0) * 1e3
    events = list(prof.events())
    steps = [e for e in events if e.name == PREFIX + "step"]
    main_thread = steps[0].thread if steps else None
    out = {"wall_ms": wall_ms, "compute_ops": 0.0, "framework": 0.0, "comm": 0.0,
           "optimizer": 0.0, "data": 0.0, "other": 0.0}
    main = [e for e in events if e.thread == main_thread and e.name != PREFIX + "step"]
    top_total = 0.0
    for ev in main:
        if ev.cpu_parent is None or ev.cpu_parent.name == PREFIX + "step":
            top_total += ev.cpu_time_total / 1e3
        cat = _category(ev)
        if cat == "compute":
            # aten ops are the math; the rest is Python, hooks and dispatch.
            cat = "compute_ops" if ev.name.startswith("aten::") else "framework"
        out[cat] = out.get(cat, 0.0) + ev.self_cpu_time_total / 1e3
    _move_waits(out, main, [e for e in events if e.thread != main_thread])
    # Time on the step's clock that no event covers: Python between phases,
    # the profiler's own cost.
    out["idle"] = max(0.0, wall_ms - top_total)
    out["top_comm_events"] = _top_comm(events, main_thread)
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _gaps(span: tuple[float, float], busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, cur = [], span[0]
    for s, e in busy:
        if e <= span[0] or s >= span[1]:
            continue
        if s > cur:
            out.append((cur, s))
        cur = max(cur, e)
    if cur < span[1]:
        out.append((cur, span[1]))
    return out


def _move_waits(out: dict, main: list, others: list) -> None:
    """A blocking collective shows on the training thread only as a short call
    (its work runs on the backend's thread) followed by a wait inside Python.
    Time in a phase that no op covers while another thread runs a collective
    is that wait: move it from the phase to communication."""
    def span(e):
        return (e.time_range.start / 1e3, e.time_range.end / 1e3)

    bg = _merge([span(e) for e in others if COMM.search(e.name)])
    if not bg:
        return
    ops = _merge([span(e) for e in main if e.name.startswith("aten::") or COMM.search(e.name)])
    bucket = {"compute": "framework", "optimizer": "optimizer", "data": "data"}
    for ev in main:
        name = ev.name[len(PREFIX):] if ev.name.startswith(PREFIX) else None
        parent = ev.cpu_parent
        if name not in bucket or (parent is not None and parent.name.startswith(PREFIX)
                                  and parent.name != PREFIX + "step"):
            continue
        wait = _overlap(_gaps(span(ev), ops), bg)
        wait = min(wait, out[bucket[name]])
        out[bucket[name]] -= wait
        out["comm"] += wait


def _top_comm(events, main_thread, n: int = 5) -> list[list]:
    totals: dict[str, float] = {}
    for ev in events:
        if ev.thread == main_thread and COMM.search(ev.name):
            parent = ev.cpu_parent
            if parent is not None and COMM.search(parent.name):
                continue  # count each collective once, at its outermost event
            totals[ev.name] = totals.get(ev.name, 0.0) + ev.cpu_time_total / 1e3
    return [[k, round(v, 2)] for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:n]]
