"""giantmodel doctor: every check printed, exit 0 on a healthy host; a shrunk
limit is a FAIL line that names its fix; under 4 ranks every rank and the
probe's bandwidth are reported."""

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest

from giantmodel.cli import main as cli_main
from giantmodel.testing import run_ranks
from giantmodel.train import doctor
from giantmodel.train.doctor import check_disk, check_network, nccl_matches

NAMES = ("python", "torch", "gpus", "comm ext", "shm", "open files", "locked mem", "interfaces",
         "disk", "transformers", "apex", "wandb", "mlflow", "matplotlib", "liger-kernel",
         "transformer-engine")


def run_doctor(capsys, *argv) -> tuple[int, str]:
    rc = cli_main(["doctor", *argv])
    return rc, capsys.readouterr().out


def test_doctor_prints_each_check_and_exits_0(tmp_path, capsys):
    rc, out = run_doctor(capsys, "--shm", str(tmp_path), "--nproc-per-node", "2",
                         f"run.dir={tmp_path / 'run'}")
    for name in NAMES:
        assert re.search(rf"^  (ok|info|warn|FAIL)\s+{re.escape(name)}\s", out, re.M), (name, out)
    assert "FAIL" not in out and rc == 0, out
    assert out.strip().splitlines()[-1].startswith("doctor: nothing blocks training")


def test_tiny_shm_and_missing_extension_name_their_fix(tmp_path, capsys, monkeypatch):
    import giantmodel.comm

    fake = namedtuple("statvfs", "f_blocks f_bavail f_frsize")(1024, 1000, 4096)  # 4 MiB
    real = os.statvfs
    monkeypatch.setattr(doctor.os, "statvfs",
                        lambda p: fake if str(p) == "/dev/shm" else real(p))
    monkeypatch.setattr(giantmodel.comm, "extension_status",
                        lambda: "missing: collectives are delegated to gloo/NCCL")
    rc, out = run_doctor(capsys, "--nproc-per-node", "8", f"run.dir={tmp_path}")
    assert rc == 1
    (shm,) = [line for line in out.splitlines() if " shm " in line]
    assert shm.lstrip().startswith("FAIL") and "4 MiB free" in shm and "need 256 MiB" in shm
    assert "fix: mount a larger /dev/shm: docker run --shm-size" in shm
    (ext,) = [line for line in out.splitlines() if "comm ext" in line]
    assert ext.lstrip().startswith("warn") and "fix: install a C++ compiler" in ext
    assert "csrc/build_ext.py" in ext
    assert "1 problem(s) block training" in out


@pytest.mark.slow
def test_tiny_shm_in_a_mount_namespace(tmp_path):
    """The same through a real 4 MiB tmpfs, mounted where only the command sees it."""
    probe = tmp_path / "shm"
    probe.mkdir()
    cmd = (f"mount -t tmpfs -o size=4m none {probe} && {sys.executable} -m giantmodel doctor "
           f"--shm {probe} --nproc-per-node 2 run.dir={tmp_path / 'run'}")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare")
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd],
                         capture_output=True, text=True, timeout=120)
    if "mount" in out.stderr and "FAIL" not in out.stdout:
        pytest.skip(f"no mount namespace here: {out.stderr.strip()[:200]}")
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"FAIL\s+shm .*4 MiB free.*fix: mount a larger /dev/shm", out.stdout)


def test_limits_network_disk_and_apex_name_their_fix(tmp_path, monkeypatch):
    import resource

    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096) if which ==
                        resource.RLIMIT_NOFILE else real(which))
    (nofile, _) = doctor.check_limits()
    assert nofile.status == "fail" and "ulimit -n 4096" in nofile.line()

    names = ["lo", "eth0", "ib0"]
    assert nccl_matches("eth", names) == ["eth0"]
    assert nccl_matches("^lo,ib", names) == ["eth0"]
    assert nccl_matches("=eth", names) == []
    bad = check_network(names, {"NCCL_SOCKET_IFNAME": "ens5", "GLOO_SOCKET_IFNAME": "eth0,ens6"})
    by = {c.name: c for c in bad}
    assert by["NCCL_SOCKET_IFNAME"].status == "fail"
    assert "fix: set NCCL_SOCKET_IFNAME to one of lo, eth0, ib0" in by["NCCL_SOCKET_IFNAME"].line()
    assert by["GLOO_SOCKET_IFNAME"].status == "fail" and "no interface ens6" in by[
        "GLOO_SOCKET_IFNAME"].detail
    good = check_network(names, {"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth0"})
    assert all(c.status == "ok" for c in good[1:])

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p: usage(10 << 30, 0, 1 << 20))
    disk = check_disk(str(tmp_path / "run"), 12 << 30, keep=2)
    assert disk.status == "fail" and "point run.dir at a larger disk" in disk.line()

    fake = tmp_path / "site"
    (fake / "apex").mkdir(parents=True)
    (fake / "apex" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(fake))
    (apex,) = [c for c in doctor.check_packages() if c.name == "apex"]
    assert apex.status == "warn" and "github.com/NVIDIA/apex" in apex.line()
    (fake / "apex" / "optimizers").mkdir()
    (apex,) = [c for c in doctor.check_packages() if c.name == "apex"]
    assert apex.status == "ok"


def _doctor_rank(rank, world, shm):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(["doctor", "--shm", shm, "--probe-mb", "1", "--timeout", "60",
                       f"run.dir={shm}/run"])
    return rc, out.getvalue()


@pytest.mark.timeout(120)
def test_four_ranks_report_every_rank_and_the_probe(tmp_path):
    results = run_ranks(_doctor_rank, 4, str(tmp_path), backend=None, timeout=100)
    assert [rc for rc, _ in results] == [0, 0, 0, 0], results[0][1]
    report = results[0][1]
    assert all(text == "" for _, text in results[1:])  # rank 0 prints for everyone
    assert re.search(r"torchrun: rendezvous 127\.0\.0\.1:\d+ .*4 ranks on 1 host", report)
    for r in range(4):
        assert re.search(rf"rank {r}\s+host \S+ local rank {r}/4 device cpu", report), report
    m = re.search(r"all-reduce 1 MiB x 4 ranks \(gloo\): ([\d.]+) ms, algbw ([\d.]+) GB/s, "
                  r"busbw ([\d.]+) GB/s", report)
    # the time, not the bandwidths: those print 0.00 past ~0.2 s an all-reduce
    # on a saturated host
    assert m and float(m.group(1)) > 0, report
    assert re.search(r"send/recv ring 1 MiB: slowest link \d->\d [\d.]+ GB/s", report)
