"""``giantmodel generate`` for Stable Diffusion: a diffusion run's checkpoint
(``--run-dir`` / ``--checkpoint``) or a diffusers pipeline directory
(``--diffusers``) to one PNG per prompt. The same seed gives the same image."""

from __future__ import annotations

from pathlib import Path

from giantmodel.checkpoint.sd import is_sd_run, load_sd_checkpoint
from giantmodel.config.errors import UserInputError
from giantmodel.models.sd.diffusers_io import from_diffusers
from giantmodel.models.sd.sampling import generate_images, save_png


def is_sd_source(args) -> bool:
    """Whether the generate command names a Stable Diffusion model."""
    if getattr(args, "diffusers", None):
        return True
    src = args.run_dir or args.checkpoint
    return bool(src) and is_sd_run(src)


def generate_sd_from_args(args) -> str:
    if args.diffusers:
        model = from_diffusers(args.diffusers)
    else:
        model = load_sd_checkpoint(args.run_dir or args.checkpoint, ema=not args.no_ema)
    if model.tokenizer is None:
        raise UserInputError("the model has no tokenizer (no tokenizer/vocab.json beside it)")
    out = Path(args.out or "sample.png")
    if out.suffix.lower() != ".png":
        raise UserInputError(f"--out {out}: write a .png file")
    image = generate_images(model, [args.prompt], sampler=args.sampler, steps=args.steps,
                            guidance_scale=args.guidance_scale, seed=args.seed)[0]
    save_png(image, out)
    return f"wrote {out} ({args.sampler}, {args.steps} steps, guidance {args.guidance_scale:g}, " \
           f"seed {args.seed})"
