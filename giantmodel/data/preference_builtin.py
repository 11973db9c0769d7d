"""The bundled tiny preference set: generated, never downloaded.

Each pair asks one of the tiny instruction set's tasks
(:mod:`giantmodel.data.sft_builtin`); the chosen answer is the right one,
the rejected one is the answer to another question of the same task (a
fluent, wrong reply, as a weaker model would give). Records come in TRL's
conversational forms, with an explicit prompt and with the prompt left
implicit (the common prefix), so both readers are exercised; the held-out
pairs never appear in training.
"""

from __future__ import annotations

import random

from giantmodel.data.sft_builtin import _SYSTEMS, _TASKS, seeded_split

_TRAIN_SEED, _VALID_SEED = 17, 18
NUM_TRAIN, NUM_VALID = 600, 60


def _pair(r: random.Random) -> dict:
    task = r.choice(_TASKS)
    q, good = task(r)
    bad = good
    while bad == good:
        bad = task(r)[1]
    prompt = [{"role": "system", "content": r.choice(_SYSTEMS)}] if r.random() < 0.2 else []
    prompt.append({"role": "user", "content": q})
    chosen = [{"role": "assistant", "content": good}]
    rejected = [{"role": "assistant", "content": bad}]
    if r.random() < 0.5:
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    return {"chosen": prompt + chosen, "rejected": prompt + rejected}


def tiny_preferences(num_train: int = NUM_TRAIN, num_valid: int = NUM_VALID
                     ) -> tuple[list[dict], list[dict]]:
    """The bundled training and held-out preference records."""
    return seeded_split(_pair, num_train, num_valid, _TRAIN_SEED, _VALID_SEED)
