"""The bundled tiny instruction set, and a tiny chat model to fine-tune on it.

Neither is downloaded: the instruction set is generated here from a fixed
seed (a dozen small task families written for this file: arithmetic, word
games, facts, short multi-turn chats), in all three record formats so every
reader is exercised; the model is a small LLaMA in Hugging Face format with a
byte-level BPE tokenizer trained on that set and a ChatML template, built on
first use under ``CACHE/tiny-chat-KEY/`` (a random initialisation: the
recipes that use it show the fine-tuning machinery, not a useful assistant).

``checkpoint.init_from: builtin:tiny-chat`` names that model.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

from giantmodel.config.errors import ConfigError
from giantmodel.data.builtin import file_lock
from giantmodel.data.chat import BUILTIN_TEMPLATES, ChatTemplate
from giantmodel.data.conversations import to_messages
from giantmodel.models.hf import hf_config_to_model_config, save_hf
from giantmodel.models.registry import build_model, init_weights

BUILTIN_PREFIX = "builtin:"
TINY_CHAT = "tiny-chat"
_RECIPE_VERSION = 1
_TRAIN_SEED, _VALID_SEED = 7, 8
NUM_TRAIN, NUM_VALID = 1200, 120

TINY_CHAT_MODEL = {
    "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 384, "vocab_size": 1024,
    "max_position_embeddings": 512,
}
"""Shape of the tiny chat model (its ``config.json`` fields); the tokenizer
is trained to exactly ``vocab_size`` tokens."""

TINY_FAMILIES = {
    TINY_CHAT: {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "tie_word_embeddings": False},
    "tiny-qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                   "tie_word_embeddings": True},
    "tiny-qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                   "head_dim": 48, "tie_word_embeddings": True},
    "tiny-mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                     "sliding_window": 128, "tie_word_embeddings": False},
    "tiny-gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                    "head_dim": 48, "hidden_activation": "gelu_pytorch_tanh",
                    "sliding_window": 128, "layer_types": ["sliding_attention"] * 3
                    + ["full_attention"], "query_pre_attn_scalar": 48,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "tiny-phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                  "original_max_position_embeddings": 512, "tie_word_embeddings": False},
}
"""Built-in tiny models (``builtin:NAME``): the tiny chat model's shape, tokenizer
and data in each family's own ``config.json`` (Qwen2's q/k/v biases, Qwen3's
qk-norm and wider heads, Mistral's sliding window, Gemma 3's local and
global layers, Phi-3's fused checkpoint layout)."""

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ---------------------------------------------------------------- task families

_CAPITALS = [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Japan", "Tokyo"),
             ("Germany", "Berlin"), ("Canada", "Ottawa"), ("Egypt", "Cairo"),
             ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"), ("Chile", "Santiago"),
             ("India", "New Delhi"), ("China", "Beijing"), ("Greece", "Athens"),
             ("Portugal", "Lisbon"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
             ("Ireland", "Dublin"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
             ("Mexico", "Mexico City"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"),
             ("Australia", "Canberra"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
             ("Turkey", "Ankara"), ("Russia", "Moscow"), ("Cuba", "Havana"),
             ("Hungary", "Budapest")]
_OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"),
              ("up", "down"), ("light", "dark"), ("old", "young"), ("open", "closed"),
              ("early", "late"), ("full", "empty"), ("hard", "soft"), ("wet", "dry"),
              ("loud", "quiet"), ("rich", "poor"), ("strong", "weak"), ("high", "low"),
              ("near", "far"), ("thick", "thin"), ("clean", "dirty"), ("true", "false"),
              ("win", "lose"), ("push", "pull"), ("first", "last"), ("begin", "end")]
_PLURALS = [("cat", "cats"), ("box", "boxes"), ("child", "children"), ("mouse", "mice"),
            ("city", "cities"), ("leaf", "leaves"), ("foot", "feet"), ("tooth", "teeth"),
            ("bus", "buses"), ("baby", "babies"), ("knife", "knives"), ("man", "men"),
            ("dish", "dishes"), ("story", "stories"), ("wolf", "wolves"), ("goose", "geese"),
            ("book", "books"), ("church", "churches"), ("person", "people"), ("fox", "foxes")]
_SOUNDS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"),
           ("sheep", "baa"), ("owl", "hoot"), ("lion", "roar"), ("horse", "neigh"),
           ("pig", "oink"), ("bee", "buzz"), ("frog", "croak"), ("snake", "hiss")]
_WORDS = ["garden", "planet", "window", "river", "pencil", "rocket", "silver", "forest",
          "candle", "market", "orange", "bridge", "summer", "winter", "number", "letter",
          "engine", "castle", "yellow", "basket", "travel", "spirit", "mirror", "pocket",
          "button", "circle", "dragon", "island", "jacket", "kitten", "ladder", "meadow"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant. Answer briefly.",
            "You are a friendly tutor."]


def _arith(r: random.Random) -> tuple[str, str]:
    a, b = r.randint(2, 99), r.randint(2, 99)
    op = r.choice(["plus", "minus", "times"])
    val = a + b if op == "plus" else a - b if op == "minus" else a * b
    q = r.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.",
                  f"Please tell me {a} {op} {b}."])
    return q, f"{a} {op} {b} is {val}."


def _reverse(r: random.Random) -> tuple[str, str]:
    w = r.choice(_WORDS)
    return r.choice([f"Reverse the word '{w}'.", f"Spell '{w}' backwards."]), w[::-1]


def _upper(r: random.Random) -> tuple[str, str]:
    words = " ".join(r.sample(_WORDS, r.randint(1, 3)))
    return f"Write '{words}' in capital letters.", words.upper()


def _count(r: random.Random) -> tuple[str, str]:
    w = r.choice(_WORDS)
    return f"How many letters are in the word '{w}'?", f"The word '{w}' has {len(w)} letters."


def _capital(r: random.Random) -> tuple[str, str]:
    c, cap = r.choice(_CAPITALS)
    return (r.choice([f"What is the capital of {c}?", f"Name the capital city of {c}."]),
            f"The capital of {c} is {cap}.")


def _opposite(r: random.Random) -> tuple[str, str]:
    a, b = r.choice(_OPPOSITES)
    if r.random() < 0.5:
        a, b = b, a
    return f"What is the opposite of '{a}'?", f"The opposite of '{a}' is '{b}'."


def _sort(r: random.Random) -> tuple[str, str]:
    xs = r.sample(range(1, 60), r.randint(3, 6))
    return (f"Sort these numbers from smallest to largest: {', '.join(map(str, xs))}.",
            ", ".join(map(str, sorted(xs))))


def _plural(r: random.Random) -> tuple[str, str]:
    a, b = r.choice(_PLURALS)
    return f"What is the plural of '{a}'?", f"The plural of '{a}' is '{b}'."


def _sound(r: random.Random) -> tuple[str, str]:
    a, s = r.choice(_SOUNDS)
    return f"What sound does a {a} make?", f"A {a} says {s}."


def _day(r: random.Random) -> tuple[str, str]:
    i = r.randrange(7)
    return f"Which day comes after {_DAYS[i]}?", f"{_DAYS[(i + 1) % 7]} comes after {_DAYS[i]}."


def _parity(r: random.Random) -> tuple[str, str]:
    n = r.randint(1, 500)
    return f"Is {n} even or odd?", f"{n} is {'even' if n % 2 == 0 else 'odd'}."


_TASKS = [_arith, _reverse, _upper, _count, _capital, _opposite, _sort, _plural, _sound, _day,
          _parity]


def _record(r: random.Random) -> dict:
    """One example in a randomly chosen format, sometimes with a system
    prompt, sometimes two turns long."""
    turns = [r.choice(_TASKS)(r) for _ in range(1 if r.random() < 0.8 else 2)]
    system = r.choice(_SYSTEMS) if r.random() < 0.3 else None
    fmt = r.choice(["alpaca", "messages", "sharegpt"]) if len(turns) == 1 else \
        r.choice(["messages", "sharegpt"])
    if fmt == "alpaca":
        q, a = turns[0]
        rec = {"instruction": q, "input": "", "output": a}
        if system:
            rec["system"] = system
        return rec
    msgs = [{"role": "system", "content": system}] if system else []
    for q, a in turns:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if fmt == "messages":
        return {"messages": msgs}
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]}


def tiny_instructions(num_train: int = NUM_TRAIN, num_valid: int = NUM_VALID
                      ) -> tuple[list[dict], list[dict]]:
    """The bundled training and held-out records (no held-out record appears
    verbatim in training)."""
    return seeded_split(_record, num_train, num_valid, _TRAIN_SEED, _VALID_SEED)


def seeded_split(make, num_train: int, num_valid: int, train_seed: int, valid_seed: int
                 ) -> tuple[list[dict], list[dict]]:
    """``num_train`` records ``make(rng)`` from one seed and ``num_valid``
    held-out ones from another, none of which appears verbatim in training."""
    r = random.Random(train_seed)
    train = [make(r) for _ in range(num_train)]
    seen = {json.dumps(x, sort_keys=True) for x in train}
    r = random.Random(valid_seed)
    valid: list[dict] = []
    while len(valid) < num_valid:
        rec = make(r)
        if json.dumps(rec, sort_keys=True) not in seen:
            valid.append(rec)
    return train, valid


def write_jsonl(records: list[dict], path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(x) + "\n" for x in records), encoding="utf-8")
    return p


# ---------------------------------------------------------------- the tiny chat model

def _train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": TINY_CHAT_MODEL["max_position_embeddings"],
        "chat_template": BUILTIN_TEMPLATES["chatml"]}, indent=1))


def _build_tiny_chat(out: Path, which: str = TINY_CHAT) -> None:
    train, _ = tiny_instructions()
    chatml = ChatTemplate(BUILTIN_TEMPLATES["chatml"], "chatml", "", "<|im_end|>")
    texts = [chatml.render(to_messages(rec, "auto", "bundled")).text for rec in train]
    _train_tokenizer(texts, TINY_CHAT_MODEL["vocab_size"], out)
    hf = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          **TINY_CHAT_MODEL, **TINY_FAMILIES[which]}
    cfg = hf_config_to_model_config(hf, name=which)
    model = init_weights(build_model(cfg), cfg, seed=0)
    save_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg, out,
            dtype=torch.float32)
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|im_end|>")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def ensure_tiny_chat_model(cache_dir: str | os.PathLike, which: str = TINY_CHAT) -> Path:
    """The HF directory of the tiny model ``which`` (a key of TINY_FAMILIES),
    built on first use (safe when several ranks ask at once: one builds
    under a lock, the others wait)."""
    cache = Path(cache_dir).expanduser()
    final = cache / f"{which}-v{_RECIPE_VERSION}"
    if (final / "config.json").is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / f"{which}.lock"):
        if (final / "config.json").is_file():
            return final
        tmp = cache / f".{which}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _build_tiny_chat(tmp, which)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def resolve_model_dir(name: str, data_cfg) -> Path:
    """A pretrained-weights setting as a directory: ``builtin:tiny-chat`` (or
    another of TINY_FAMILIES) is built on first use in the data cache;
    anything else is a path."""
    if name.startswith(BUILTIN_PREFIX):
        which = name[len(BUILTIN_PREFIX):]
        if which not in TINY_FAMILIES:
            known = ", ".join(BUILTIN_PREFIX + k for k in TINY_FAMILIES)
            raise ConfigError(f"unknown built-in model {name!r}; the built-ins are {known}",
                              key="checkpoint.init_from")
        return ensure_tiny_chat_model(data_cfg.resolved_cache_dir(), which)
    return Path(name).expanduser()
