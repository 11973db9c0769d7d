"""The work every system in the peer suite runs: one model, one batch plan.

Imported by the giantmodel side (system Python) and by the peers' sides
(their own virtual environments, which see giantmodel through PYTHONPATH).
Both sides build the *same* initial weights (giantmodel's layout-independent
init, converted to Hugging Face names for the peers) and read the *same*
token batches (giantmodel's synthetic loader, sliced by data-parallel rank),
so their losses must agree step by step up to float summation order.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from dataclasses import asdict, dataclass, field

import torch

SEED = 1234


@dataclass(frozen=True)
class Case:
    """One row of the suite: a layout both systems run."""

    name: str
    ranks: int
    dp: int
    zero: int
    pp: int = 1
    global_batch: int = 8
    micro_batch: int = 4
    gm_overrides: tuple[str, ...] = ()
    """Extra giantmodel KEY=VALUE overrides (hand-tuned variants)."""
    ds_config: dict = field(default_factory=dict, hash=False, compare=False)
    """Extra DeepSpeed config entries, merged over the defaults."""
    gpu: bool = False
    """The GPU workload (GPU_MODEL, bf16, one CUDA device) instead of the CPU one."""


# The shapes: a 4-layer LLaMA, hidden 256, ffn 688, vocab 4096, seq 256, fp32.
MODEL = {"arch": "llama", "name": "llama-peer", "hidden_size": 256, "num_layers": 4,
         "num_heads": 8, "num_kv_heads": 4, "ffn_hidden_size": 688, "vocab_size": 4096,
         "max_seq_len": 256, "tie_embeddings": False}
SEQ_LEN = 256
# Case 4 (GPU): LLaMA-1B class (Llama 3.2 1B shapes), bf16, seq 4096.
GPU_MODEL = {"arch": "llama", "name": "llama-1b", "hidden_size": 2048, "num_layers": 16,
             "num_heads": 32, "num_kv_heads": 8, "ffn_hidden_size": 8192,
             "vocab_size": 128256, "max_seq_len": 4096, "rope_theta": 500000.0,
             "tie_embeddings": True}
GPU_SEQ_LEN = 4096
OPTIM = {"lr": 1e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
         "grad_clip": 1.0}


# Case 1 of the issue: one host, CPU. Global batch 8 in micro-batches of 4:
# one micro-batch per rank at dp2, two through the pipeline at pp2; dp4 keeps
# micro-batch 4 (global 16). DeepSpeed runs pipelines at ZeRO 0 or 1 only;
# both sides run pp2 at ZeRO 0.
CPU_CASES = (
    Case("dp2-zero1", ranks=2, dp=2, zero=1),
    Case("dp2-zero2", ranks=2, dp=2, zero=2),
    Case("dp2-zero3", ranks=2, dp=2, zero=3),
    Case("pp2", ranks=2, dp=1, zero=0, pp=2),
    Case("dp4-zero1", ranks=4, dp=4, zero=1, global_batch=16),
)
# Case 2: 2 emulated hosts x 2 ranks (benchmarks/peers/cluster_case.py), dp4,
# one sequence per rank: there the step is mostly communication.
CLUSTER_CASES = tuple(Case(f"2host-zero{z}", ranks=4, dp=4, zero=z, global_batch=4,
                           micro_batch=1) for z in (1, 2, 3))
# One H100: micro-batch 1, 8 micro-batches per step (32K tokens).
GPU_CASES = (Case("gpu-1b", ranks=1, dp=1, zero=0, global_batch=8, micro_batch=1, gpu=True),)


def case_outputs(names: str, out: str) -> list[tuple[str, str]]:
    """(case, output prefix OUT-<case>) for comma-separated cases run in turn."""
    return [(c, f"{out}-{c}") for c in (find_case(n).name for n in names.split(","))]


def collect(names: str, out: str, summarize, error: str) -> dict[str, dict]:
    """Each of the comma-separated cases' figures, ``summarize(case,
    per_rank)`` over the files its ranks wrote, or ``error`` for a case whose
    ranks did not all write theirs. Every rank writes its figures before
    going on; a rank that dies afterwards (DeepSpeed's ranks now and then end
    in "terminate called without an active exception" while the interpreter
    shuts down) leaves a complete measurement."""
    results = {}
    for name, dest in case_outputs(names, out):
        case = find_case(name)
        files = [f"{dest}.rank{r}" for r in range(case.ranks)]
        if all(os.path.isfile(f) for f in files):
            per_rank = []
            for f in files:
                with open(f) as fh:
                    per_rank.append(json.load(fh))
            results[name] = summarize(case, per_rank)
        else:
            results[name] = {"error": error}
    return results


def serve(run_one) -> int:
    """A rank that serves commands (benchmarks/peers/launch.py): for each
    JSON line on stdin, ``run_one(case, output_prefix, steps, profile)`` for
    each of its cases in turn, then OUT.done.rank<R> with the exit code.
    Returns at the end of input."""
    rank = os.environ["RANK"]
    for line in sys.stdin:
        cmd = json.loads(line)
        code = run_cases_in_turn(cmd["cases"], cmd["out"], cmd["port"], run_one,
                                 cmd["steps"], cmd["profile"])
        # written whole, then renamed: the launcher polls for the name and
        # would otherwise read a file that exists but is still empty
        done = f"{cmd['out']}.done.rank{rank}"
        with open(done + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(done + ".tmp", done)
    return 0


def run_cases_in_turn(names: str, out: str, port: int, run_one, *args) -> int:
    """Run ``run_one(case, output_prefix, *args)`` for each of the comma-separated
    cases, each in a child forked for it, with MASTER_PORT port + i; the
    exit code of the first that fails, else 0.

    The parent has imported the side's modules (torch and, for the peers,
    transformers) and run nothing else, so each child starts as a fresh
    launch would, less the imports. Running the cases one after another in
    one process instead measured later cases faster: DeepSpeed's ZeRO-2
    after its ZeRO-1 ran at 1,490-1,600 tok/s in case 2, against 1,310-1,450
    launched alone, as the first engine's freed memory warmed the allocator.
    A fresh store port per case keeps a fast rank from meeting the last
    case's store before rank 0 has closed it."""
    for i, (name, dest) in enumerate(case_outputs(names, out)):
        os.environ["MASTER_PORT"] = str(port + i)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _die_with_parent()
            code = 1
            try:
                run_one(name, dest, *args)
                code = 0
            except BaseException:  # noqa: BLE001 - reported, then the exit code says it
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:
            return code if code > 0 else 128 - code
    return 0


def _die_with_parent() -> None:
    """A forked case ends with its rank: a launcher that kills the rank on a
    timeout must not leave the case running."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def find_case(name: str) -> Case:
    for c in CPU_CASES + CLUSTER_CASES + GPU_CASES:
        if c.name == name:
            return c
    raise SystemExit(f"error: unknown case {name!r}; choose from "
                     f"{', '.join(c.name for c in CPU_CASES)}")


def model_dict(case: Case) -> dict:
    return GPU_MODEL if case.gpu else MODEL


def seq_len(case: Case) -> int:
    return GPU_SEQ_LEN if case.gpu else SEQ_LEN


def gm_overrides(case: Case, steps: int, run_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
    """giantmodel KEY=VALUE overrides for ``case``: everything not named keeps
    giantmodel's default, as a user would run it."""
    model = [f"model.{k}={v}" for k, v in model_dict(case).items()]
    o = OPTIM
    device = ["train.device=cuda", "precision=bf16", "train.threads=0"] if case.gpu else \
        ["train.device=cpu", "precision=fp32", "train.threads=1"]
    return [*model,
            f"train.seq_len={seq_len(case)}", f"train.global_batch_size={case.global_batch}",
            f"train.micro_batch_size={case.micro_batch}", f"train.steps={steps}",
            f"train.seed={SEED}", "train.eval_every=0", "train.sample_tokens=0",
            f"optim.lr={o['lr']}", f"optim.weight_decay={o['weight_decay']}",
            f"optim.beta1={o['beta1']}", f"optim.beta2={o['beta2']}", f"optim.eps={o['eps']}",
            f"optim.grad_clip={o['grad_clip']}", "optim.warmup_steps=0",
            "optim.schedule=constant", *device,
            f"parallel.dp={case.dp}", f"parallel.zero={case.zero}", f"parallel.pp={case.pp}",
            "data.source=synthetic", "data.synthetic_pattern=arithmetic",
            "data.valid_fraction=0",
            f"run.dir={run_dir}", "run.tensorboard=false", "run.progress=false",
            "checkpoint.every=0", "checkpoint.save_final=false", "checkpoint.resume=false",
            *case.gm_overrides, *extra]


def model_config(case: Case):
    from giantmodel.config.model import ModelConfig

    return ModelConfig(**model_dict(case))


def loader(case: Case, dp_rank: int, dp_size: int):
    """This data-parallel rank's batches, exactly as giantmodel's trainer reads them."""
    from giantmodel.config.data import DataConfig
    from giantmodel.data import build_loaders

    cfg = DataConfig(source="synthetic", synthetic_pattern="arithmetic", valid_fraction=0)
    train, _ = build_loaders(cfg, seq_len=seq_len(case), global_batch_size=case.global_batch,
                             micro_batch_size=case.micro_batch, dp_rank=dp_rank,
                             dp_size=dp_size, seed=SEED, vocab_size=model_dict(case)["vocab_size"])
    return train


def initial_state(case: Case) -> dict[str, torch.Tensor]:
    """giantmodel's initial weights for the case's model, full and unsharded."""
    from giantmodel.models import build_model, init_weights

    cfg = model_config(case)
    model = build_model(cfg, device="meta")
    init_weights(model, cfg, SEED, device=torch.device("cpu"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_llama(case: Case):
    """A transformers LlamaForCausalLM holding giantmodel's initial weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from giantmodel.models.hf import model_config_to_hf_config, native_to_hf

    cfg = model_config(case)
    hf_cfg = LlamaConfig(**model_config_to_hf_config(cfg))
    hf_cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(native_to_hf(initial_state(case), cfg), strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"weight conversion: missing {missing}, unexpected {unexpected}")
    return model


def param_groups(model: torch.nn.Module) -> list[dict]:
    """giantmodel's decay rule (matrices decay, norms do not), for the peers' optimizers."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": OPTIM["weight_decay"]},
            {"params": rest, "weight_decay": 0.0}]


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy, fp32, the loss giantmodel reports."""
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                             labels.reshape(-1))


def peak_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Peak RSS of this process on CPU; ``max_memory_allocated`` on a GPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated()
    # ru_maxrss is KiB on Linux: this process's peak resident set.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def init_deepspeed(backend: str) -> None:
    """``deepspeed.init_distributed``, then the names of its CPU all-reduce
    segments removed. On a CPU DeepSpeed maps a 66 MB /dev/shm segment per
    rank, named after MASTER_ADDR, MASTER_PORT and the rank, and never
    unlinks it: every run left them behind, and /dev/shm is memory (300
    of them, 20 GB, once filled the 24 GB test host). Each rank opens all
    the others' segments inside ``init_distributed``; after a barrier the
    names can go, and the mappings live until the process ends."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend=backend)
    if backend != "gloo":
        return
    dist.barrier()
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
        dist.get_rank())
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def case_dict(case: Case) -> dict:
    return asdict(case)
