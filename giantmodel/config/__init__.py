"""Typed job configuration: schema, strict YAML loading, overrides, dumps."""

from __future__ import annotations

from pathlib import Path

import yaml

from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.config.loader import apply_overrides, from_dict, read_yaml, to_dict
from giantmodel.config.schema import JobConfig


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                validate: bool = True):
    """Load a :class:`JobConfig` from YAML (or the embedded default when
    ``path`` is None), apply dotted ``KEY=VALUE`` overrides, and validate."""
    raw = read_yaml(path) if path is not None else {}
    raw = apply_overrides(raw, list(overrides), JobConfig)
    cfg = from_dict(JobConfig, raw)
    if validate:
        cfg.validate()
    return cfg


def dump_config(cfg: JobConfig, path: str | Path | None = None) -> str:
    """The resolved config as YAML; also written to ``path`` when given."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text


__all__ = ["ConfigError", "JobConfig", "UserInputError", "dump_config", "from_dict", "load_config", "to_dict"]
