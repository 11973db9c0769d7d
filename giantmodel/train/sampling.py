"""``giantmodel generate``: load weights from a run, a checkpoint or a HF directory, then sample."""

from __future__ import annotations

from pathlib import Path

from giantmodel.checkpoint import CheckpointManager, load_model_from_checkpoint
from giantmodel.config import load_config
from giantmodel.config.errors import UserInputError
from giantmodel.data import build_tokenizer
from giantmodel.data.chat import chat_reply, resolve_template, tokenizer_chat_template
from giantmodel.data.sft import sft_tokenizer_path
from giantmodel.data.tokenizer import load_tokenizer
from giantmodel.models.generate import generate_text, place_for_generation
from giantmodel.models.hf import from_hf


def _run_dir_of(checkpoint: Path) -> Path:
    # run.dir/checkpoints/step-XXXXXXXX -> run.dir
    return checkpoint.parent.parent


def load_for_generation(args):
    """(model, tokenizer, run config or None) for the source the user named,
    the model placed on ``--device`` in ``--dtype``."""
    model, tok, cfg = _load_for_generation(args)
    place_for_generation(model, getattr(args, "device", None), getattr(args, "dtype", "auto"))
    return model, tok, cfg


def _load_for_generation(args):
    if args.hf:
        model = from_hf(args.hf)
        tok_path = args.tokenizer or _find_hf_tokenizer(Path(args.hf))
        return model, load_tokenizer(tok_path), None

    if args.run_dir:
        run_dir = Path(args.run_dir)
        cfg = _run_config(run_dir)
        step = CheckpointManager(cfg.checkpoint, str(run_dir), is_rank0=False).latest_step()
        if step is None:
            raise UserInputError(f"no checkpoint under {run_dir / 'checkpoints'}; train first "
                                 "or pass --checkpoint")
        ckpt = run_dir / "checkpoints" / f"step-{step:08d}"
    else:
        ckpt = Path(args.checkpoint)
        if not ckpt.is_dir():
            raise UserInputError(f"checkpoint directory {ckpt} does not exist")
        cfg = _run_config(_run_dir_of(ckpt))
    # A LoRA run's model keeps its adapters (the base from its init_from).
    model = load_model_from_checkpoint(ckpt)
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    else:
        tok = build_tokenizer(cfg.data)
    return model, tok, cfg


def _run_config(run_dir: Path):

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserInputError(f"{path} not found: --run-dir must be a giantmodel run directory")
    return load_config(path, validate=False)


def _find_hf_tokenizer(path: Path) -> str:
    for name in ("tokenizer.json", "tokenizer.model"):
        if (path / name).is_file():
            return str(path / name)
    raise UserInputError(f"no tokenizer.json or tokenizer.model in {path}; pass --tokenizer")


def chat_template_for(args, cfg, tokenizer):
    """The chat template ``generate`` applies, or None for plain continuation:
    ``--chat``/``--no-chat`` decide; by default a run fine-tuned on
    ``data.source: sft`` uses its own template, and a HF directory uses its
    tokenizer's ``chat_template`` when it has one."""
    want = getattr(args, "chat", None)
    if want is False:
        return None
    if cfg is not None and cfg.data.source == "sft":
        path = args.tokenizer or sft_tokenizer_path(cfg.data, cfg.checkpoint.init_from)
        return resolve_template(cfg.data.chat_template, tokenizer, path)
    path = args.tokenizer or (args.hf if getattr(args, "hf", None) else None)
    if want or (path and tokenizer_chat_template(path)):
        return resolve_template("auto", tokenizer, path)
    return None


def generate_from_args(args) -> str:

    model, tok, cfg = load_for_generation(args)
    template = chat_template_for(args, cfg, tok)
    if template is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        return chat_reply(model, tok, template, messages, args.max_new_tokens,
                          args.temperature, args.top_k, args.seed)
    return generate_text(model, tok, args.prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed)
