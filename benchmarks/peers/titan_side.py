"""torchtitan's side of the GPU case, run with the torchtitan environment's Python.

    <torchtitan venv>/bin/python benchmarks/peers/titan_side.py --case gpu-1b \
        --assets /path/to/Llama-3.2-1B-tokenizer --out tt.json

torchtitan ships Llama 3 flavors of 8B and up; this adds a "1B" flavor with
the case's shapes to its flavor table, then runs its own trainer (FSDP2 on one
GPU, bf16, the case's batch plan, torchtitan's own data pipeline on its bundled
c4_test sample) and reads tokens/s from its metrics. Its loss is not comparable
with the others (different data and init); only speed and memory are.

Not run yet: no GPU has been lent to this project, and the torchtitan API
(flavor table, config flags) moves between releases: check the names below
against the installed version before trusting a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload

LAUNCH = r'''
import sys, importlib
mod = importlib.import_module("torchtitan.models.llama3")
table = next(getattr(mod, n) for n in ("llama3_args", "llama3_configs") if hasattr(mod, n))
Args = type(table["8B"])
table["1B"] = Args(dim={dim}, n_layers={layers}, n_heads={heads}, n_kv_heads={kv},
                   vocab_size={vocab}, ffn_dim_multiplier=1.5, multiple_of=256,
                   rope_theta={theta})
from torchtitan.train import main, Trainer
sys.argv = ["torchtitan"] + {argv!r}
main(Trainer)
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="gpu-1b")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--assets", required=True, help="local Llama 3 tokenizer directory")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    case = workload.find_case(a.case)
    m = workload.model_dict(case)
    seq = workload.seq_len(case)
    argv = ["--model.name", "llama3", "--model.flavor", "1B",
            "--model.hf_assets_path", a.assets, "--training.dataset", "c4_test",
            "--training.local_batch_size", str(case.micro_batch),
            "--training.global_batch_size", str(case.global_batch),
            "--training.seq_len", str(seq), "--training.steps", str(a.steps),
            "--training.mixed_precision_param", "bfloat16",
            "--optimizer.lr", str(workload.OPTIM["lr"]),
            "--training.max_norm", str(workload.OPTIM["grad_clip"]),
            "--metrics.log_freq", "1", "--activation_checkpoint.mode", "none",
            "--checkpoint.enable", "false"]
    code = LAUNCH.format(dim=m["hidden_size"], layers=m["num_layers"], heads=m["num_heads"],
                         kv=m["num_kv_heads"], vocab=m["vocab_size"], theta=m["rope_theta"],
                         argv=argv)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        print(log[-3000:], file=sys.stderr)
        return proc.returncode
    # torchtitan logs "step: N  loss: X  memory: YGiB(...)  tps: Z ..." per step.
    steps = [(float(loss), float(mem), float(tps)) for loss, mem, tps in re.findall(
        r"loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)", log)]
    timed = steps[a.warmup:] or steps
    tps = sum(s[2] for s in timed) / len(timed)
    Path(a.out).write_text(json.dumps({
        "system": "torchtitan", "case": a.case, "tokens_per_sec": tps,
        "loss": steps[-1][0], "losses": [s[0] for s in steps],
        "peak_rss_mib": [max(s[1] for s in steps) * 1024],
        "wall_s": time.perf_counter() - t0}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
