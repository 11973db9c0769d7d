"""``giantmodel generate``: load weights from a run, a checkpoint or a HF directory, then sample."""

from __future__ import annotations

from pathlib import Path

from giantmodel.checkpoint import CheckpointManager, load_model_weights
from giantmodel.config import load_config
from giantmodel.config.errors import UserInputError
from giantmodel.data import build_tokenizer
from giantmodel.data.tokenizer import load_tokenizer
from giantmodel.models import build_model, init_weights
from giantmodel.models.generate import generate_text
from giantmodel.models.hf import from_hf


def _run_dir_of(checkpoint: Path) -> Path:
    # run.dir/checkpoints/step-XXXXXXXX -> run.dir
    return checkpoint.parent.parent


def load_for_generation(args):
    """(model, tokenizer) for the source the user named."""

    if args.hf:
        model = from_hf(args.hf)
        tok_path = args.tokenizer or _find_hf_tokenizer(Path(args.hf))
        return model, load_tokenizer(tok_path)


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
    model = build_model(cfg.model, device="meta")
    init_weights(model, cfg.model, seed=0)
    load_model_weights([model], str(ckpt))
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    else:
        tok = build_tokenizer(cfg.data)
    return model, tok


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


def generate_from_args(args) -> str:

    model, tok = load_for_generation(args)
    return generate_text(model, tok, args.prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed)
