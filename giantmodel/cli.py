"""``giantmodel`` command line: subcommands only, each delegating to one function.

Bad user input (config keys, paths, layouts) raises ConfigError or
UserInputError; they are printed as a single ``error:`` line with exit status
2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch
from torch.distributed.run import main as torchrun_main

from giantmodel import __version__
from giantmodel.comm import extension_status
from giantmodel.config import ConfigError, JobConfig, UserInputError, load_config
from giantmodel.config.errors import RunStopped
from giantmodel.train.sampling import generate_from_args
from giantmodel.train.sd_sampling import generate_sd_from_args, is_sd_source
from giantmodel.train.trainer import preflight, run_training


def _add_config_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--config", "-c", required=required,
                   help="YAML job config (default: the embedded tiny LLaMA on the stdlib corpus)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides applied after the file, e.g. train.steps=100 parallel.tp=2")


# ------------------------------------------------------------------ train
def _cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.nproc_per_node and "WORLD_SIZE" not in os.environ:
        return _launch_local(args, cfg)
    run_training(cfg)
    return 0


def _launch_local(args, cfg: JobConfig) -> int:
    """Spawn ``--nproc-per-node`` ranks through torch's elastic launcher,
    after validating the layout for that world size (so errors come before
    any rank starts)."""
    preflight(cfg, args.nproc_per_node)
    argv = ["--standalone", f"--nproc-per-node={args.nproc_per_node}", "-m", "giantmodel", "train"]
    if args.config:
        argv += ["--config", args.config]
    torchrun_main(argv + list(args.overrides))
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model from a YAML config",
                       description="Train from a YAML config (default: the embedded tiny LLaMA). "
                       "Runs in one process, under torchrun, or spawns local ranks with "
                       "--nproc-per-node.")
    _add_config_args(p)
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="spawn this many local ranks through torch.distributed.run")
    p.set_defaults(func=_cmd_train)


# --------------------------------------------------------------- generate
def _cmd_generate(args) -> int:
    print(generate_sd_from_args(args) if is_sd_source(args) else generate_from_args(args))
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample text or an image from a checkpoint, HF or "
                       "diffusers model",
                       description="Sample from a run directory's latest checkpoint "
                       "(--run-dir), a given checkpoint (--checkpoint), a Hugging Face "
                       "directory (--hf) or a diffusers pipeline (--diffusers). A Stable "
                       "Diffusion run or pipeline writes a PNG (--out).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="run directory holding config.yaml and checkpoints/")
    src.add_argument("--checkpoint", help="a checkpoint directory (step-XXXXXXXX) of a run")
    src.add_argument("--hf", help="a Hugging Face model directory (config.json + safetensors)")
    src.add_argument("--diffusers", help="a diffusers Stable Diffusion pipeline directory")
    p.add_argument("--tokenizer", help="tokenizer (.model or tokenizer.json); default: the run's")
    p.add_argument("--prompt", default="def ", help="text to continue, or the user's message "
                   "when a chat template applies")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: on for runs fine-tuned with "
                   "data.source=sft and HF tokenizers that carry a chat_template)")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None,
                   help="where a text model runs: cuda, cuda:N or cpu (default: cuda when "
                   "available)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="weights' dtype for a text model (default auto: bf16 on a GPU, fp32 "
                   "on the CPU)")
    sd = p.add_argument_group("Stable Diffusion")
    sd.add_argument("--out", default="sample.png", help="PNG to write (default sample.png)")
    sd.add_argument("--sampler", choices=("ddim", "euler"), default="ddim")
    sd.add_argument("--steps", type=int, default=30, help="sampling steps (default 30)")
    sd.add_argument("--guidance-scale", type=float, default=7.5,
                    help="classifier-free guidance scale (1 turns it off; default 7.5)")
    sd.add_argument("--no-ema", action="store_true",
                    help="use the trained UNet weights, not the run's EMA of them")
    p.set_defaults(func=_cmd_generate)


# ---------------------------------------------------- delegated commands
def _delegate(sub, name: str, help_text: str, module: str, add_fn: str, run_fn: str) -> None:
    """A subcommand whose arguments and body live in ``module``. A module that
    cannot be imported (a missing optional dependency) disables only its own
    subcommand, with the reason, instead of the whole CLI."""
    p = sub.add_parser(name, help=help_text, description=help_text)
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        reason = str(e)
        p.set_defaults(func=lambda args: _unavailable(name, reason))
        return
    getattr(mod, add_fn)(p)
    p.set_defaults(func=getattr(mod, run_fn))


def _unavailable(name: str, reason: str) -> int:
    print(f"error: 'giantmodel {name}' is unavailable: {reason}", file=sys.stderr)
    return 2


def _cmd_version(args) -> int:
    print(f"giantmodel {__version__}")
    print(f"torch {torch.__version__} (cuda {torch.version.cuda or 'none'})")
    print(f"comm extension: {extension_status()}")
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: comm collectives, training throughput, hardware",
                       description="Benchmarks. 'comm': collectives x sizes x backends; "
                       "'train': training throughput of a config; 'hw': this machine's profile; "
                       "'topology': links between ranks, for rank placement.")
    bsub = p.add_subparsers(dest="bench", metavar="{comm,train,hw,topology}")
    bsub.required = True
    _delegate(bsub, "comm", "collective bandwidth table (nccl-tests algbw/busbw)",
              "giantmodel.comm.bench", "add_arguments", "main")
    _delegate(bsub, "train", "tokens/s, TFLOP/s, MFU and peak memory of a config",
              "giantmodel.train.bench", "add_arguments", "main")
    _delegate(bsub, "hw", "measure this machine's FLOP/s and bandwidth as a planner profile",
              "giantmodel.planner.hwbench", "add_arguments", "main")
    _delegate(bsub, "topology", "measure latency and bandwidth between ranks; write "
              "topology.yaml", "giantmodel.distributed.linkprobe", "add_arguments", "main")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="giantmodel",
        description="Train GPT and LLaMA models with N-D parallelism from one YAML file.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_train(sub)
    _delegate(sub, "preprocess", "tokenize jsonl/text/parquet/HF datasets into a Megatron "
              "indexed dataset (.bin/.idx)", "giantmodel.data.commands",
              "add_preprocess_arguments", "run_preprocess")
    _delegate(sub, "tokenizer", "train a SentencePiece tokenizer", "giantmodel.data.commands",
              "add_tokenizer_arguments", "run_tokenizer")
    _add_generate(sub)
    _delegate(sub, "convert", "convert between giantmodel checkpoints and Hugging Face format",
              "giantmodel.checkpoint.convert", "add_arguments", "main")
    _delegate(sub, "estimate", "predict memory, step time and MFU of a config before launch",
              "giantmodel.planner.commands", "add_estimate_arguments", "run_estimate")
    _delegate(sub, "plan", "search parallel layouts for a cluster and write the best as YAML",
              "giantmodel.planner.commands", "add_plan_arguments", "run_plan")
    _delegate(sub, "plot", "draw loss, throughput, learning-rate and grad-norm curves of runs "
              "(metrics.jsonl) into a PNG", "giantmodel.metrics.plots", "add_arguments", "main")
    _add_bench(sub)
    _delegate(sub, "doctor", "check this machine (or, under torchrun, every rank of a cluster) "
              "before training: versions, GPUs, /dev/shm, limits, network, disk, packages",
              "giantmodel.train.doctor", "add_arguments", "main")
    p = sub.add_parser("version", help="print versions and the comm extension status")
    p.set_defaults(func=_cmd_version)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``, taking KEY=VALUE overrides wherever they stand: argparse
    gives a positional list only its first run of words, so overrides after an
    option (``estimate a=1 --gpu h100-sxm b=2``) come back as extras. (Its
    ``parse_intermixed_args`` would do this, but refuses subcommands.)"""
    args, extra = parser.parse_known_args(argv)
    overrides = getattr(args, "overrides", None)
    stray = [e for e in extra if overrides is None or e.startswith("-") or "=" not in e]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(overrides) + extra
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, UserInputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
