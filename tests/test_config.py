"""Config schema, strict loading, overrides and presets."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from giantmodel.config import ConfigError, dump_config, load_config
from giantmodel.config.loader import field_docs
from giantmodel.config.schema import JobConfig

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs").rglob("*.yaml"))


def test_tiny_preset_is_the_embedded_default():
    assert load_config(ROOT / "configs/llama/tiny.yaml") == load_config(None) == JobConfig()


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_preset_loads_and_its_model_is_valid(path):
    cfg = load_config(path, validate=False)
    cfg.model.validate()
    cfg.train.validate()
    cfg.parallel.validate()


@pytest.mark.parametrize("name,billions", [("llama/7b", 6.74), ("llama/13b", 13.02),
                                           ("llama/65b", 65.29), ("llama/llama3-8b", 8.03),
                                           ("gpt/gpt2", 0.1245)])
def test_preset_parameter_counts_match_published_sizes(name, billions):
    cfg = load_config(ROOT / f"configs/{name}.yaml", validate=False)
    assert cfg.model.num_params() / 1e9 == pytest.approx(billions, rel=0.005)


def test_required_keys_exist():
    cfg = JobConfig()
    for dotted in ["model.arch", "model.hidden_size", "model.num_layers", "model.num_heads",
                   "model.num_kv_heads", "model.ffn_hidden_size", "model.vocab_size",
                   "model.max_seq_len", "model.rope_theta", "model.tie_embeddings",
                   "train.steps", "train.global_batch_size", "train.micro_batch_size",
                   "train.seq_len", "train.seed", "train.log_every", "train.eval_every",
                   "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay",
                   "optim.grad_clip", "optim.schedule", "precision", "recompute", "parallel.dp",
                   "parallel.zero", "parallel.tp", "parallel.sp", "parallel.pp",
                   "parallel.pp_schedule", "parallel.pp_virtual", "parallel.cp",
                   "checkpoint.every", "checkpoint.keep", "run.dir"]:
        obj = cfg
        for part in dotted.split("."):
            obj = getattr(obj, part)


def _all_dataclasses(cls, seen=None):
    seen = seen if seen is not None else set()
    if cls in seen:
        return seen
    seen.add(cls)
    for f in dataclasses.fields(cls):
        tp = f.type if not isinstance(f.type, str) else None
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            _all_dataclasses(type(default), seen)
        del tp
    return seen


def test_every_config_field_has_a_docstring():
    from giantmodel.config.model import RopeScaling

    classes = _all_dataclasses(JobConfig) | {RopeScaling}
    assert len(classes) >= 10
    for cls in classes:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


@pytest.mark.parametrize("override,key,fragment", [
    (["model.hiden_size=64"], "model.hiden_size", "did you mean 'model.hidden_size'"),
    (["optim.learning_rate=1"], "optim.learning_rate", "Valid keys here"),
    (["trian.steps=1"], "trian", "did you mean 'train'"),
    (["train.steps=abc"], "train.steps", "expected an integer"),
    (["train.steps=1.5"], "train.steps", "expected an integer"),
    (["model.tie_embeddings=3"], "model.tie_embeddings", "true or false"),
    (["precision=fp4"], "precision", "must be one of"),
    (["train.seq_len=1024"], "train.seq_len", "exceeds model.max_seq_len"),
    (["model.num_kv_heads=3"], "model.num_kv_heads", "not divisible"),
    (["parallel.zero=4"], "parallel.zero", "0, 1, 2 or 3"),
    (["train.global_batch_size=12"], "train.global_batch_size", "multiple of micro_batch_size"),
    (["train"], None, "KEY=VALUE"),
])
def test_bad_input_names_the_key(override, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert err.value.key == key
    assert fragment in str(err.value)


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  num_layer: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'model.num_layers'"):
        load_config(path)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_overrides_apply_after_the_file_with_yaml_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 7\noptim:\n  lr: 1.0e-3\n")
    cfg = load_config(path, ["train.steps=9", "optim.lr=5e-4", "optim.min_lr=0",
                             "parallel.pp_layers=[1,3]", "model.rope_scaling.factor=4",
                             "model.num_kv_heads=null", "parallel.sp=true", "parallel.tp=2"],
                      validate=False)
    assert cfg.train.steps == 9
    assert cfg.optim.lr == 5e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.parallel.pp_layers == [1, 3]
    assert cfg.model.rope_scaling.factor == 4.0 and cfg.model.rope_scaling.low_freq_factor == 1.0
    assert cfg.model.num_kv_heads is None and cfg.model.kv_heads == cfg.model.num_heads
    assert cfg.parallel.sp is True


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["model.arch=gpt", "train.steps=11", "parallel.pp_layers=[2,2]"],
                      validate=False)
    path = tmp_path / "resolved.yaml"
    dump_config(cfg, path)
    assert yaml.safe_load(path.read_text())["train"]["steps"] == 11
    assert load_config(path, validate=False) == cfg


def test_a_constant_schedule_takes_any_small_lr():
    # min_lr is read only by decaying schedules; its default must not make a
    # constant schedule with a smaller lr impossible to configure.
    cfg = load_config(None, ["optim.schedule=constant", "optim.lr=1e-5"])
    assert cfg.optim.lr == 1e-5
    with pytest.raises(ConfigError, match="optim.min_lr"):
        load_config(None, ["optim.schedule=cosine", "optim.lr=1e-5"])
