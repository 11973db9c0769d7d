"""``giantmodel generate``: load weights from a run, a checkpoint or a HF directory, then sample."""

from __future__ import annotations

from pathlib import Path

from giantmodel.config.errors import UserInputError


def _run_dir_of(checkpoint: Path) -> Path:
    # run.dir/checkpoints/step-XXXXXXXX -> run.dir
    return checkpoint.parent.parent


def load_for_generation(args):
    """(model, tokenizer, run config or None) for the source the user named."""
    from giantmodel.models import build_model, init_weights

    if args.hf:
        from giantmodel.models.hf import from_hf
        model = from_hf(args.hf)
        tok_path = args.tokenizer or _find_hf_tokenizer(Path(args.hf))
        from giantmodel.data.tokenizer import load_tokenizer
        return model, load_tokenizer(tok_path), None

    from giantmodel.checkpoint import CheckpointManager, load_model_weights

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
        from giantmodel.data.tokenizer import load_tokenizer
        tok = load_tokenizer(args.tokenizer)
    else:
        from giantmodel.data import build_tokenizer
        tok = build_tokenizer(cfg.data)
    return model, tok, cfg


def _run_config(run_dir: Path):
    from giantmodel.config import load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserInputError(f"{path} not found: --run-dir must be a giantmodel run directory")
    return load_config(path, validate=False)


def _find_hf_tokenizer(path: Path) -> str:
    for name in ("tokenizer.json", "tokenizer.model"):
        if (path / name).is_file():
            return str(path / name)
    raise UserInputError(f"no tokenizer.json or tokenizer.model in {path}; pass --tokenizer")


def generate_chat(model, tokenizer, template, messages: list[dict], max_new_tokens: int,
                  temperature: float = 0.8, top_k: int | None = 50, seed: int = 0) -> str:
    """The assistant's reply to ``messages`` rendered with the chat ``template``
    (:class:`giantmodel.data.chat.ChatTemplate`); generation stops at EOS or
    the template's end-of-turn token, which is left out of the reply."""
    import torch

    from giantmodel.data.chat import stop_ids
    from giantmodel.models.generate import generate

    ids, _ = tokenizer.encode_offsets(template.prompt(messages))
    stops = stop_ids(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    out = generate(model, torch.tensor([ids]), max_new_tokens, temperature, top_k, gen,
                   eos_id=stops, vocab_limit=tokenizer.vocab_size)
    new = out[0, len(ids):].tolist()
    while new and new[-1] in stops:
        new.pop()
    return tokenizer.decode(new)


def chat_template_for(args, cfg, tokenizer):
    """The chat template ``generate`` applies, or None for plain continuation:
    ``--chat``/``--no-chat`` decide; by default a run fine-tuned on
    ``data.source: sft`` uses its own template, and a HF directory uses its
    tokenizer's ``chat_template`` when it has one."""
    from giantmodel.data.chat import resolve_template, tokenizer_chat_template

    want = getattr(args, "chat", None)
    if want is False:
        return None
    if cfg is not None and cfg.data.source == "sft":
        from giantmodel.data.sft import sft_tokenizer_path

        path = args.tokenizer or sft_tokenizer_path(cfg.data, cfg.checkpoint.init_from)
        return resolve_template(cfg.data.chat_template, tokenizer, path)
    path = args.tokenizer or (args.hf if getattr(args, "hf", None) else None)
    if want or (path and tokenizer_chat_template(path)):
        return resolve_template("auto", tokenizer, path)
    return None


def generate_from_args(args) -> str:
    from giantmodel.models.generate import generate_text

    model, tok, cfg = load_for_generation(args)
    template = chat_template_for(args, cfg, tok)
    if template is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        return generate_chat(model, tok, template, messages, args.max_new_tokens,
                             args.temperature, args.top_k, args.seed)
    return generate_text(model, tok, args.prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed)
