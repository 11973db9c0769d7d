"""Chat templates: render a conversation to text and find which tokens the
model should learn (the assistant's), as Hugging Face does.

A template is Jinja text with the same environment as ``transformers``'
``apply_chat_template`` (sandboxed, ``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, ``raise_exception``, ``strftime_now`` and a ``tojson``
filter), so a tokenizer's own ``chat_template`` renders here exactly as it
does there. Three are built in: ``llama3``, ``chatml`` and ``alpaca``.

Assistant spans come from one of two places:

* ``{% generation %}...{% endgeneration %}`` blocks, the markers HF's
  ``return_assistant_tokens_mask=True`` relies on (the built-in templates have
  them, and include each turn's end-of-turn token so the model learns to stop);
* otherwise, incremental rendering: the text a template adds for assistant
  turn ``i`` is ``render(messages[:i+1])`` minus its prefix
  ``render(messages[:i], add_generation_prompt=True)``. This needs a template
  whose output for a longer conversation extends the shorter one's, which is
  checked and explained when it fails.

Token labels follow HF's rule: every token from the one holding a span's first
character to the one holding its last character carries loss.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from torch import nn

from giantmodel.config.errors import UserInputError
from giantmodel.models.generate import generate

ROLES = ("system", "user", "assistant", "tool")

# Private-use code points bracket generation blocks while rendering; they are
# stripped from the text and never reach the tokenizer.
_OPEN, _CLOSE = "\ue000", "\ue001"

_LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' -}}{% endgeneration %}"
    "{%- else -%}"
    "{{- message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

_CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_ALPACA_PREAMBLE = ("Below is an instruction that describes a task. Write a response that "
                    "appropriately completes the request.\\n\\n")
_ALPACA = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{{- '" + _ALPACA_PREAMBLE + "' -}}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '### Response:\\n' -}}"
    "{% generation %}{{- message['content'] + eos_token -}}{% endgeneration %}"
    "{{- '\\n\\n' -}}"
    "{%- else -%}"
    "{{- '### Instruction:\\n' + message['content'] + '\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '### Response:\\n' -}}{%- endif -%}"
)

BUILTIN_TEMPLATES = {"llama3": _LLAMA3, "chatml": _CHATML, "alpaca": _ALPACA}
"""Named templates for ``data.chat_template``."""

# Tokens that end an assistant turn in common templates (generation stops there).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|end_of_turn|>", "<end_of_turn>")

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}body{% endgeneration %}``: the body, bracketed by
        markers that :meth:`ChatTemplate.render` turns into spans."""

        tags = {"generation"}  # noqa: RUF012 - jinja's Extension API reads a set

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]
    """Character ranges [start, end) of the text the assistant should learn."""


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may use."""

    def __init__(self, source: str, name: str = "custom", bos_token: str = "",
                 eos_token: str = ""):
        import jinja2

        self.source, self.name = source, name
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        self.has_generation = bool(_GENERATION_TAG.search(source))
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise UserInputError(f"chat template {name!r} is not valid Jinja: {e.message} "
                                 f"(line {e.lineno})") from None

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, bos_token=self.bos_token,
                                         eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:
            raise UserInputError(f"chat template {self.name!r} failed to render: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> Rendered:
        """The conversation as text, and the character spans of assistant text."""
        raw = self._render(messages, add_generation_prompt)
        if self.has_generation:
            return _strip_markers(raw)
        return Rendered(raw, [] if add_generation_prompt else self._incremental_spans(messages, raw))

    def prompt(self, messages: list[dict]) -> str:
        """Text that asks the model for the next assistant turn."""
        return self.render(messages, add_generation_prompt=True).text

    def _incremental_spans(self, messages: list[dict], full: str) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], add_generation_prompt=True)
            through = self._render(messages[:i + 1], add_generation_prompt=False)
            if not (through.startswith(before) and full.startswith(through)):
                raise UserInputError(
                    f"chat template {self.name!r} has no {{% generation %}} markers and does not "
                    "render conversations incrementally, so the assistant's tokens cannot be "
                    "found; add {% generation %}...{% endgeneration %} around assistant content, "
                    "or set data.mask_prompt=false")
            spans.append((len(before), len(through)))
        return spans


def _strip_markers(raw: str) -> Rendered:
    out, spans, start = [], [], None
    pos = 0
    for ch in raw:
        if ch == _OPEN:
            start = pos
        elif ch == _CLOSE:
            if start is not None and pos > start:
                spans.append((start, pos))
            start = None
        else:
            out.append(ch)
            pos += 1
    return Rendered("".join(out), spans)


def tokenizer_chat_template(tokenizer_path: str | Path | None) -> str | None:
    """The ``chat_template`` stored beside a HF tokenizer (``chat_template.jinja``
    or ``tokenizer_config.json``), or None."""
    if tokenizer_path is None:
        return None
    p = Path(tokenizer_path)
    d = p if p.is_dir() else p.parent
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    cfg_file = d / "tokenizer_config.json"
    if not cfg_file.is_file():
        return None
    try:
        tmpl = json.loads(cfg_file.read_text()).get("chat_template")
    except ValueError:
        return None
    if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl if isinstance(tmpl, str) else None


def resolve_template(setting: str, tokenizer, tokenizer_path=None) -> ChatTemplate:
    """The template ``data.chat_template`` names: "auto" (the tokenizer's own,
    else the built-in whose special tokens the tokenizer has, else alpaca), a
    built-in name, a ``.jinja`` file, or inline Jinja text."""
    bos = token_string(tokenizer, getattr(tokenizer, "bos_id", None))
    eos = token_string(tokenizer, tokenizer.eos_id)
    if setting == "auto":
        own = tokenizer_chat_template(tokenizer_path)
        if own:
            return ChatTemplate(own, "tokenizer", bos, eos)
        name = ("chatml" if has_token(tokenizer, "<|im_start|>") else
                "llama3" if has_token(tokenizer, "<|start_header_id|>") else "alpaca")
        return ChatTemplate(BUILTIN_TEMPLATES[name], name, bos, eos)
    if setting in BUILTIN_TEMPLATES:
        return ChatTemplate(BUILTIN_TEMPLATES[setting], setting, bos, eos)
    if "{{" in setting or "{%" in setting:
        return ChatTemplate(setting, "custom", bos, eos)
    path = Path(setting).expanduser()
    if path.suffix in (".jinja", ".j2", ".txt") and path.is_file():
        return ChatTemplate(path.read_text(), str(path), bos, eos)
    raise UserInputError(template_error(setting))


def template_error(setting: str) -> str:
    return (f"unknown chat template {setting!r}: use auto, one of "
            f"{', '.join(BUILTIN_TEMPLATES)}, a .jinja file, or inline Jinja text")


def has_token(tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text)
    return len(ids) == 1


def token_string(tokenizer, token_id: int | None) -> str:
    if token_id is None:
        return ""
    return tokenizer.id_to_token(token_id)


def stop_ids(tokenizer) -> list[int]:
    """EOS plus every end-of-turn token the tokenizer has as one token."""
    out = [tokenizer.eos_id]
    for t in END_OF_TURN_TOKENS:
        ids = tokenizer.encode(t)
        if len(ids) == 1 and ids[0] not in out:
            out.append(ids[0])
    return out


def spans_to_token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """bool [n]: tokens from the one holding each span's first character to the
    one holding its last (``offsets`` is [n, 2] character [start, end))."""
    n = len(offsets)
    mask = np.zeros(n, dtype=bool)
    if n == 0:
        return mask
    starts, ends = offsets[:, 0], offsets[:, 1]
    for s, e in spans:
        first = _token_at(starts, ends, s)
        last = _token_at(starts, ends, e - 1)
        if first is not None and last is not None:
            mask[first:last + 1] = True
    return mask


def _token_at(starts: np.ndarray, ends: np.ndarray, char: int) -> int | None:
    hit = np.nonzero((starts <= char) & (char < ends))[0]
    return int(hit[0]) if len(hit) else None


def encode_conversation(tokenizer, template: ChatTemplate, messages: list[dict],
                        mask_prompt: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32 [n], loss mask bool [n]) of one rendered conversation.
    With ``mask_prompt`` only assistant tokens carry loss; otherwise all do."""
    for m in messages:
        if _OPEN in m["content"] or _CLOSE in m["content"]:
            raise UserInputError("message content uses the private code points U+E000/U+E001, "
                                 "which chat rendering reserves")
    rendered = template.render(messages)
    ids, offsets = tokenizer.encode_offsets(rendered.text)
    ids = np.asarray(ids, dtype=np.int32)
    if not mask_prompt:
        return ids, np.ones(len(ids), dtype=bool)
    return ids, spans_to_token_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2),
                                    rendered.spans)


def chat_reply(model: nn.Module, tokenizer, template: ChatTemplate, messages: list[dict],
               max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 50,
               seed: int = 0) -> str:
    """The assistant's reply to ``messages`` rendered with ``template``;
    generation stops at EOS or an end-of-turn token, which is left out."""
    ids, _ = tokenizer.encode_offsets(template.prompt(messages))
    stops = stop_ids(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    out = generate(model, torch.tensor([ids]), max_new_tokens, temperature, top_k, gen,
                   eos_id=stops, vocab_limit=tokenizer.vocab_size)
    new = out[0, len(ids):].tolist()
    while new and new[-1] in stops:
        new.pop()
    return tokenizer.decode(new)
