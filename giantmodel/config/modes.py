"""Settings that only one mode of a section reads.

A section with a mode switch (``data.source``, ``comm.backend``,
``optim.schedule``, ...) has keys that only some modes read. Setting one of
them while another mode is selected used to be ignored without a word: the
run trained on the built-in corpus although ``data.paths`` named a dataset.
:func:`refuse_unused` turns that into a ConfigError naming the key and the
switch. A key counts as set when its value differs from the field's default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from giantmodel.config.errors import ConfigError


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _show(mode: Any) -> str:
    return str(mode).lower() if isinstance(mode, bool) else str(mode)


def refuse_unused(section: Any, prefix: str, switch: str, read_by: dict[str, tuple]) -> None:
    """Raise if a key of ``section`` that the current mode ignores is set.

    ``read_by`` maps a field name to the values of ``section.<switch>`` that
    read it; fields not listed are read by every mode."""
    mode = getattr(section, switch)
    for f in dataclasses.fields(section):
        modes = read_by.get(f.name)
        if modes is None or mode in modes:
            continue
        value = getattr(section, f.name)
        if value == _default(f):
            continue
        choices = " or ".join(f"{prefix}.{switch}={_show(m)}" for m in modes)
        raise ConfigError(
            f"is set to {value!r}, but {prefix}.{switch} is {_show(mode)}, which ignores it "
            f"(only {', '.join(_show(m) for m in modes)} read it); set {choices}, "
            f"or remove {prefix}.{f.name}", key=f"{prefix}.{f.name}")
