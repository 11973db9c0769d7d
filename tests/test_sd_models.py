"""Stable Diffusion models against diffusers / transformers on tiny random configs (fp32).

Parity: UNet output, VAE posterior mean and decode, CLIP last_hidden_state,
for an SD 1.x-style config (conv projections, one head count) and an SD
2.x-style one (linear projections, heads per block, GELU text MLP); both
directions of the directory format; the tokenizer; the schedules and the
DDIM and Euler samplers through the whole pipeline.
"""

from __future__ import annotations

import pytest
import torch

from giantmodel.config.errors import UserInputError
from giantmodel.config.sd import NoiseConfig, TextEncoderConfig, UNetConfig, VAEConfig
from giantmodel.models.sd import build_sd, init_sd_weights
from giantmodel.models.sd.schedule import NoiseSchedule, ddim_sample, euler_sample
from giantmodel.models.sd.tokenizer import build_word_tokenizer

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

TOL = 1e-5
WORDS = ["a", "red", "green", "blue", "yellow", "circle", "square", "triangle", "on", "background"]


def _diffusers_models(sd2: bool):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(32, 64, 64), norm_num_groups=16, cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=[2, 4, 8] if sd2 else 4, use_linear_projection=sd2,
        upcast_attention=sd2)
    vae = AutoencoderKL(block_out_channels=(32, 64), latent_channels=4, norm_num_groups=16,
                        layers_per_block=1, sample_size=32,
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2)
    text = CLIPTextModel(CLIPTextConfig(
        vocab_size=600, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=16, projection_dim=32,
        hidden_act="gelu" if sd2 else "quick_gelu", bos_token_id=0, eos_token_id=2))
    with torch.no_grad():  # norms start at 1/0; move them so they are tested too
        for model in (unet, vae, text):
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
    return unet.eval(), vae.eval(), text.eval()


def _write_pipeline(tmp_path, unet, vae, text, prediction_type="epsilon"):
    from diffusers import DDIMScheduler

    d = tmp_path / "pipe"
    unet.save_pretrained(d / "unet")
    vae.save_pretrained(d / "vae")
    text.save_pretrained(d / "text_encoder")
    DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                  clip_sample=False, set_alpha_to_one=False, steps_offset=1,
                  prediction_type=prediction_type).save_pretrained(d / "scheduler")
    build_word_tokenizer(WORDS, 16).save(d / "tokenizer")
    return d


def _diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("sd2", [False, True], ids=["sd1-conv-proj", "sd2-linear-proj"])
def test_from_diffusers_matches_diffusers(tmp_path, sd2):
    import giantmodel

    unet, vae, text = _diffusers_models(sd2)
    d = _write_pipeline(tmp_path, unet, vae, text, "v_prediction" if sd2 else "epsilon")
    sd = giantmodel.from_diffusers(d)
    assert sd.unet.cfg.use_linear_projection is sd2
    assert sd.noise.prediction_type == ("v_prediction" if sd2 else "epsilon")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 16, 16, generator=g)
    ctx = torch.randn(2, 7, 32, generator=g)
    img = torch.rand(2, 3, 32, 32, generator=g) * 2 - 1
    z = torch.randn(2, 4, 16, 16, generator=g)
    ids = torch.randint(0, 600, (2, 16), generator=g)
    with torch.no_grad():
        for t in (torch.tensor([3, 700]), 999, 10.5):
            assert _diff(unet(x, t, ctx).sample, sd.unet(x, t, ctx)) < TOL
        # odd latent sizes take the explicit-size upsampling path
        assert _diff(unet(x[:, :, :15, :13], 5, ctx).sample, sd.unet(x[:, :, :15, :13], 5, ctx)) < TOL
        assert _diff(vae.encode(img).latent_dist.mean, sd.vae.encode(img)) < TOL
        assert _diff(vae.decode(z).sample, sd.vae.decode(z)) < TOL
        assert _diff(text(ids).last_hidden_state, sd.text_encoder(ids)) < TOL
    # the UNet has real output: a vacuous zero would pass any tolerance
    assert sd.unet(x, 1, ctx).abs().max() > 0.1


def test_written_pipeline_loads_and_samples_in_diffusers(tmp_path):
    """Our directory -> diffusers' StableDiffusionPipeline: same components,
    same images for DDIM and Euler, with and without guidance."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline

    from giantmodel.models.sd.diffusers_io import from_diffusers, save_model_diffusers
    from giantmodel.models.sd.sampling import generate_images

    ucfg = UNetConfig(attention_head_dim=[2, 4], use_linear_projection=True)
    model = init_sd_weights(build_sd(ucfg, VAEConfig(), TextEncoderConfig(vocab_size=600)), 7)
    model.tokenizer = build_word_tokenizer(WORDS, 16)
    out = save_model_diffusers(model.eval(), tmp_path / "out")
    pipe = StableDiffusionPipeline.from_pretrained(out, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a red circle on a blue background", "green square"]
    ids = model.tokenizer(prompts)
    ref = pipe.tokenizer(prompts, padding="max_length", max_length=16, truncation=True,
                         return_tensors="pt").input_ids
    assert torch.equal(ids, ref)
    with torch.no_grad():
        ctx = model.text_encoder(ids)
        assert _diff(pipe.text_encoder(ids).last_hidden_state, ctx) < TOL
        x = torch.randn(2, 4, 16, 16)
        assert _diff(pipe.unet(x, 500, ctx).sample, model.unet(x, 500, ctx)) < TOL
    for sampler in ("ddim", "euler"):
        if sampler == "euler":
            pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
        for guidance in (1.0, 4.0):
            a = pipe(prompts, num_inference_steps=3, guidance_scale=guidance, output_type="pt",
                     generator=torch.Generator().manual_seed(5)).images
            b = generate_images(model, prompts, sampler=sampler, steps=3,
                                guidance_scale=guidance, seed=5)
            assert _diff(a, b) < TOL, (sampler, guidance)
    again = from_diffusers(out)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 again.state_dict().values()))


def test_tokenizer_matches_transformers(tmp_path):
    from transformers import CLIPTokenizer as HFTok

    from giantmodel.models.sd.tokenizer import CLIPTokenizer

    tok = build_word_tokenizer(WORDS, 12)
    tok.save(tmp_path / "tok")
    ours, theirs = CLIPTokenizer.from_dir(tmp_path / "tok"), HFTok.from_pretrained(tmp_path / "tok")
    texts = ["A  Red circle, on a BLUE background!", "", "yellow triangle's 42 zebras héllo",
             "a red circle on a blue background with many more words than fit"]
    ref = theirs(texts, padding="max_length", max_length=12, truncation=True).input_ids
    assert ours(texts).tolist() == ref
    # every caption word is one token
    assert all(len(ours.encode(w)) == 1 for w in WORDS)
    assert ours.decode(ours("a red circle")[0]) == "a red circle"


@pytest.mark.parametrize("schedule", ["scaled_linear", "linear", "squaredcos_cap_v2"])
def test_schedules_and_samplers_match_diffusers(schedule):
    from diffusers import DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler

    def fake_unet(x, t):
        return torch.tanh(0.7 * x + float(t) / 1000.0)

    for pred in ("epsilon", "v_prediction"):
        for spacing in ("leading", "trailing", "linspace"):
            ours = NoiseSchedule(NoiseConfig(beta_schedule=schedule, prediction_type=pred,
                                             timestep_spacing=spacing))
            kw = {"beta_schedule": schedule, "beta_start": 0.00085, "beta_end": 0.012,
                      "prediction_type": pred, "timestep_spacing": spacing, "steps_offset": 1}
            ddpm = DDPMScheduler(**kw)
            assert torch.equal(ddpm.alphas_cumprod, ours.alphas_cumprod)
            x0, eps = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
            t = torch.tensor([0, 417, 999])
            assert _diff(ddpm.add_noise(x0, eps, t), ours.add_noise(x0, eps, t)) < TOL
            assert _diff(ddpm.get_velocity(x0, eps, t), ours.velocity(x0, eps, t)) < TOL
            noise = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
            ddim = DDIMScheduler(clip_sample=False, set_alpha_to_one=False, **kw)
            ddim.set_timesteps(7)
            x = noise.clone()
            for ts in ddim.timesteps:
                x = ddim.step(fake_unet(x, ts), ts, x).prev_sample
            assert _diff(x, ddim_sample(ours, fake_unet, noise.clone(), 7)) < TOL
            euler = EulerDiscreteScheduler(**kw)
            euler.set_timesteps(7)
            x = noise * euler.init_noise_sigma
            for ts in euler.timesteps:
                x = euler.step(fake_unet(euler.scale_model_input(x, ts), ts), ts, x).prev_sample
            assert _diff(x, euler_sample(ours, fake_unet, noise.clone(), 7)) < TOL


def test_meta_build_and_layout_independent_init():
    cfgs = (UNetConfig(), VAEConfig(), TextEncoderConfig())
    meta = build_sd(*cfgs)
    assert all(p.is_meta for p in meta.parameters())
    a = init_sd_weights(build_sd(*cfgs), seed=3)
    b = init_sd_weights(build_sd(*cfgs), seed=3)
    c = init_sd_weights(build_sd(*cfgs), seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["unet.conv_in.weight"], sc["unet.conv_in.weight"])
    # a parameter's value depends on its name only, not on what was built around it
    other = init_sd_weights(build_sd(UNetConfig(layers_per_block=2), *cfgs[1:]), seed=3)
    assert torch.equal(other.state_dict()["vae.encoder.conv_in.weight"], sa["vae.encoder.conv_in.weight"])
    assert torch.equal(other.state_dict()["unet.conv_in.weight"], sa["unet.conv_in.weight"])


def test_bad_pipeline_directories(tmp_path):
    import json

    import giantmodel

    with pytest.raises(UserInputError, match="no such directory"):
        giantmodel.from_diffusers(tmp_path / "nope")
    unet, vae, text = _diffusers_models(False)
    d = _write_pipeline(tmp_path, unet, vae, text)
    conf = json.loads((d / "unet" / "config.json").read_text())
    (d / "unet" / "config.json").write_text(json.dumps({**conf, "class_embed_type": "timestep"}))
    with pytest.raises(UserInputError, match="class_embed_type"):
        giantmodel.from_diffusers(d)
    (d / "unet" / "config.json").write_text(json.dumps({**conf, "block_out_channels": [32, 64, 128]}))
    with pytest.raises(UserInputError, match="do not match the config"):
        giantmodel.from_diffusers(d)
    (d / "unet" / "config.json").write_text(json.dumps(conf))
    (d / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserInputError, match="cannot read weights"):
        giantmodel.from_diffusers(d)
