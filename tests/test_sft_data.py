"""SFT data: record formats, chat templates and which tokens carry loss.

The loss mask is checked against Hugging Face's own
``apply_chat_template(..., return_assistant_tokens_mask=True)`` for every
format and every template that has generation markers, and against the
template's own incremental rendering for one that has none.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from giantmodel.config.errors import ConfigError, UserInputError

transformers = pytest.importorskip("transformers")

from giantmodel.core.loss import IGNORE_INDEX
from giantmodel.data.chat import BUILTIN_TEMPLATES, ChatTemplate, encode_conversation, resolve_template
from giantmodel.data.conversations import read_records, to_messages
from giantmodel.data.loader import rows_to_batch
from giantmodel.data.sft import SFTStats, build_rows, fit_examples
from giantmodel.data.sft_builtin import _train_tokenizer, tiny_instructions
from giantmodel.data.tokenizer import load_tokenizer

RECORDS = {
    "alpaca": {"instruction": "Reverse the word 'river'.", "input": "Answer in lower case.",
               "output": "revir", "system": "You are terse."},
    "messages": {"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "2 plus 3 is 5."},
        {"role": "user", "content": "And 4 times 4?"},
        {"role": "assistant", "content": " 4 times 4 is 16. "}]},
    "sharegpt": {"conversations": [
        {"from": "human", "value": "Name the capital of Peru."},
        {"from": "gpt", "value": "The capital of Peru is Lima."}]},
}

# A custom template with generation markers, and the Zephyr-style one without
# (handled by incremental rendering).
CUSTOM = ("{% for m in messages %}{{ '[' + m['role'] + ']: ' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}"
          "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '[assistant]: ' }}{% endif %}")
NO_MARKERS = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + "
              "message['content'] + eos_token + '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train, _ = tiny_instructions(300, 1)
    chatml = ChatTemplate(BUILTIN_TEMPLATES["chatml"], "chatml", "", "<|im_end|>")
    texts = [chatml.render(to_messages(r, "auto", "t")).text for r in train]
    texts += [json.dumps(r) for r in RECORDS.values()]
    _train_tokenizer(texts, 400, d)
    return d


@pytest.fixture(scope="module")
def toks(tok_dir):
    return load_tokenizer(tok_dir), transformers.AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.mark.parametrize("template", ["tokenizer", "chatml", "llama3", "alpaca", "custom"])
@pytest.mark.parametrize("fmt", list(RECORDS))
def test_loss_mask_matches_hf_assistant_mask(toks, tok_dir, fmt, template):
    ours, hf = toks
    setting = {"tokenizer": "auto", "custom": CUSTOM}.get(template, template)
    tmpl = resolve_template(setting, ours, tok_dir)
    msgs = to_messages(RECORDS[fmt], fmt, "test")
    ids, mask = encode_conversation(ours, tmpl, msgs)
    kw = {} if template == "tokenizer" else {"chat_template": tmpl.source}
    ref = hf.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True, **kw)
    assert ids.tolist() == list(ref["input_ids"])
    assert mask.astype(int).tolist() == list(ref["assistant_masks"])
    assert mask.any() and not mask.all()
    # The masked tokens are exactly the assistant turns and their end-of-turn token.
    answers = [m["content"] for m in msgs if m["role"] == "assistant"]
    learned = hf.decode(ids[mask])
    for a in answers:
        assert (a.strip() if template == "llama3" else a) in learned
    assert "user" not in learned and "Instruction" not in learned


def test_template_without_markers_masks_what_each_turn_adds(toks):
    ours, hf = toks
    tmpl = ChatTemplate(NO_MARKERS, "zephyr", "", "<|im_end|>")
    msgs = to_messages(RECORDS["messages"], "messages", "test")
    ids, mask = encode_conversation(ours, tmpl, msgs)
    text = hf.apply_chat_template(msgs, chat_template=NO_MARKERS, tokenize=False)
    assert ids.tolist() == hf(text, add_special_tokens=False)["input_ids"]
    # Mask runs are the texts render(msgs[:i+1]) adds after render(msgs[:i], prompt).
    runs = np.split(np.arange(len(ids))[mask], np.nonzero(np.diff(np.arange(len(ids))[mask]) > 1)[0] + 1)
    got = [hf.decode(ids[r]) for r in runs]
    want = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            before = hf.apply_chat_template(msgs[:i], chat_template=NO_MARKERS, tokenize=False,
                                            add_generation_prompt=True)
            through = hf.apply_chat_template(msgs[:i + 1], chat_template=NO_MARKERS,
                                             tokenize=False)
            want.append(through[len(before):])
    assert got == want


def test_mask_prompt_false_and_labels_in_rows(toks, tok_dir):
    ours, _ = toks
    tmpl = resolve_template("chatml", ours, tok_dir)
    msgs = to_messages(RECORDS["messages"], "messages", "test")
    ids, mask = encode_conversation(ours, tmpl, msgs, mask_prompt=False)
    assert mask.all()
    ids, mask = encode_conversation(ours, tmpl, msgs)
    stats = SFTStats()
    rows = build_rows(fit_examples([(ids, mask)], 200, True, stats), 200, False, ours.eos_id,
                      stats)
    batch = rows_to_batch(rows, packed=False)
    labels = batch["labels"][0].numpy()
    # label t is token t+1 where token t+1 is an assistant token
    want = np.where(mask[1:], ids[1:], IGNORE_INDEX)
    assert labels[:len(want)].tolist() == want.tolist()
    assert (labels[len(want):] == IGNORE_INDEX).all()
    assert stats.loss_tokens == int(mask[1:].sum())


def test_truncate_and_drop_are_counted(toks, tok_dir):
    ours, _ = toks
    tmpl = resolve_template("chatml", ours, tok_dir)
    short = encode_conversation(ours, tmpl, to_messages(RECORDS["sharegpt"], "auto", "t"))
    long = encode_conversation(ours, tmpl, to_messages(RECORDS["messages"], "auto", "t"))
    seq = len(short[0]) + 2
    assert len(long[0]) > seq + 1
    stats = SFTStats()
    kept = fit_examples([short, long], seq, True, stats)
    assert (stats.examples, stats.truncated, stats.kept) == (2, 1, 2)
    assert len(kept[1][0]) == seq + 1
    stats = SFTStats()
    kept = fit_examples([short, long], seq, False, stats)
    assert (stats.dropped_too_long, stats.kept) == (1, 1)
    # A prompt that fills the whole window leaves no response: dropped and counted.
    stats = SFTStats()
    first_answer = int(np.argmax(long[1]))
    fit_examples([long], first_answer - 1, True, stats)
    assert stats.dropped_no_response == 1 and "no response" in stats.summary("t")


def test_record_readers(tmp_path):
    recs = list(RECORDS.values())
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    (tmp_path / "b.json").write_text(json.dumps(recs))
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([RECORDS["alpaca"]] * 3).save_to_disk(str(tmp_path / "ds"))
    a = [to_messages(r, "auto", w) for w, r in read_records(tmp_path / "a.jsonl")]
    b = [to_messages(r, "auto", w) for w, r in read_records(tmp_path / "b.json")]
    c = [to_messages(r, "alpaca", w) for w, r in read_records(tmp_path / "ds")]
    assert a == b and len(a) == 3 and len(c) == 3
    assert a[0][0] == {"role": "system", "content": "You are terse."}
    assert a[0][1]["content"] == "Reverse the word 'river'.\n\nAnswer in lower case."
    assert [m["role"] for m in a[2]] == ["user", "assistant"]


@pytest.mark.parametrize("record, fmt, needle", [
    ({"messages": [{"content": "hi"}]}, "auto", "message 0 has no 'role'"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "auto", "unknown role 'robot'"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "auto", "unknown 'from'"),
    ({"instruction": "x"}, "auto", "has no 'output'"),
    ({"text": "x"}, "auto", "cannot tell the record's format"),
    ({"messages": [{"role": "user", "content": 3}]}, "auto", "must be a string"),
    ({"instruction": "x", "output": "y"}, "messages", "record has no 'messages'"),
])
def test_bad_records_name_the_line(tmp_path, record, fmt, needle):
    f = tmp_path / "bad.jsonl"
    first = RECORDS["messages"] if fmt == "messages" else RECORDS["sharegpt"]
    f.write_text(json.dumps(first) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserInputError) as e:
        [to_messages(r, fmt, w) for w, r in read_records(f)]
    assert needle in str(e.value) and f"{f}:2" in str(e.value)


def test_bad_settings_fail_before_training(tmp_path):
    from giantmodel.config import load_config
    from giantmodel.data.checks import check_data

    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"messages": [{"content": "no role"}]}) + "\n")
    cfg = load_config(overrides=["data.source=sft", f"data.paths=[{f}]"])
    with pytest.raises(ConfigError, match="data.paths.*message 0 has no 'role'"):
        check_data(cfg.data)
    cfg = load_config(overrides=["data.source=sft", "data.chat_template=vicuna"])
    with pytest.raises(ConfigError, match="data.chat_template.*unknown chat template 'vicuna'"):
        check_data(cfg.data)
    with pytest.raises(UserInputError, match="not valid Jinja"):
        ChatTemplate("{% for %}", "broken")


def test_bundled_set_covers_every_format_and_holds_out_unseen_records():
    train, valid = tiny_instructions()
    fmts = {k for r in train for k in r if k in ("instruction", "messages", "conversations")}
    assert fmts == {"instruction", "messages", "conversations"}
    seen = {json.dumps(r, sort_keys=True) for r in train}
    assert not any(json.dumps(r, sort_keys=True) in seen for r in valid)
    assert tiny_instructions() == (train, valid)  # deterministic
