"""``srun`` and ``scontrol`` stand-ins that run a Slurm job step on an emulated cluster.

``scripts/slurm-shim/srun`` and ``scripts/slurm-shim/scontrol`` call this
module; put that directory first on PATH and point ``GIANTMODEL_CLUSTER`` at
an :class:`~giantmodel.testing.cluster.EmulatedCluster`'s ``state_dir``, then
run a batch script (``scripts/slurm_train.sh``) on the cluster's first host
with the variables ``sbatch`` would set (``SLURM_JOB_ID``,
``SLURM_JOB_NODELIST``, ``SLURM_NNODES``).

``srun [options] CMD...`` starts ``--ntasks-per-node`` tasks (default 1) of
CMD on every node of the allocation (``--nodes``/``-N`` narrows it), each on
its own emulated host, with ``SLURM_PROCID``, ``SLURM_NODEID``,
``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURMD_NODENAME`` and
``SLURM_STEP_ID`` set as Slurm sets them (``--distribution=cyclic`` deals
task ids round-robin over nodes, otherwise in blocks). It waits for every
task; with ``--kill-on-bad-exit=1`` the first task to fail gets the others
terminated. Its exit status is the first non-zero one. Other options are
accepted and ignored.

``scontrol show hostnames LIST`` expands a Slurm host list (``host[0-3,7]``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from giantmodel.testing.cluster import host_command

_VALUED = {"-N", "--nodes", "-n", "--ntasks", "--ntasks-per-node", "-w", "--nodelist",
           "-J", "--job-name", "-c", "--cpus-per-task", "-o", "--output", "-e", "--error",
           "--gpus-per-node", "-m", "--distribution", "-t", "--time", "-p", "--partition",
           "--kill-on-bad-exit", "-K", "--mpi", "--export"}


def expand_hostlist(text: str) -> list[str]:
    """``"a[0-2,5],b"`` -> ``["a0", "a1", "a2", "a5", "b"]`` (zero padding kept)."""
    out = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        m = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if not m:
            out.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{i:0{width}d}{suffix}")
    return out


def _parse_srun(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        if "=" in arg:
            key, value = arg.split("=", 1)
        elif arg in _VALUED and arg not in ("-K",):
            key, value = arg, argv[i + 1]
            i += 1
        else:
            key, value = arg, "1"
        opts[key.lstrip("-")] = value
        i += 1
    if i == len(argv):
        raise SystemExit("srun (shim): no command given")
    return opts, argv[i:]


def srun(argv: list[str]) -> int:
    state = os.environ.get("GIANTMODEL_CLUSTER")
    if not state:
        raise SystemExit("srun (shim): set GIANTMODEL_CLUSTER to the emulated cluster's state_dir")
    opts, cmd = _parse_srun(argv)
    nodes = expand_hostlist(os.environ["SLURM_JOB_NODELIST"])
    want = opts.get("nodes", opts.get("N"))
    if want:
        nodes = nodes[:int(want.split("-")[0])]
    per_node = int(opts.get("ntasks-per-node", "1"))
    ntasks = len(nodes) * per_node
    cyclic = opts.get("distribution", opts.get("m", "block")).startswith("cyclic")
    procs: list[subprocess.Popen] = []
    for task in range(ntasks):
        node = task % len(nodes) if cyclic else task // per_node
        local = task // len(nodes) if cyclic else task % per_node
        env = {**os.environ, "SLURM_PROCID": str(task), "SLURM_NODEID": str(node),
               "SLURM_LOCALID": str(local), "SLURM_NTASKS": str(ntasks),
               "SLURM_NTASKS_PER_NODE": str(per_node), "SLURMD_NODENAME": nodes[node],
               "SLURM_STEP_ID": "0", "SLURM_NNODES": str(len(nodes))}
        procs.append(subprocess.Popen(host_command(state, nodes[node], cmd), env=env,
                                      start_new_session=True))
    kill_on_bad = opts.get("kill-on-bad-exit", opts.get("K", "0")) not in ("0", "")
    return _wait(procs, kill_on_bad)


def _wait(procs: list[subprocess.Popen], kill_on_bad: bool) -> int:
    status = 0

    def forward(signum, frame):
        for p in procs:
            _signal(p, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while any(p.poll() is None for p in procs):
        for p in procs:
            if p.returncode not in (None, 0) and not status:
                status = p.returncode if p.returncode > 0 else 128 - p.returncode
                if kill_on_bad:
                    print(f"srun (shim): a task exited with {p.returncode}; terminating the "
                          "others", file=sys.stderr, flush=True)
                    forward(signal.SIGTERM, None)
        time.sleep(0.2)
    for p in procs:
        if p.returncode and not status:
            status = p.returncode if p.returncode > 0 else 128 - p.returncode
    return status


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def scontrol(argv: list[str]) -> int:
    if argv[:2] != ["show", "hostnames"]:
        raise SystemExit("scontrol (shim): only 'show hostnames [LIST]' is emulated")
    text = argv[2] if len(argv) > 2 else os.environ["SLURM_JOB_NODELIST"]
    try:
        os.write(sys.stdout.fileno(), ("\n".join(expand_hostlist(text)) + "\n").encode())
    except BrokenPipeError:
        pass  # `| head -n 1` stopped reading: that is what it asked for
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("srun", "scontrol"):
        raise SystemExit("usage: python -m giantmodel.testing.slurm_shim {srun|scontrol} ...")
    return srun(argv[1:]) if argv[0] == "srun" else scontrol(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
