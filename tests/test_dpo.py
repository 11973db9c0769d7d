"""Preference tuning (objective dpo): the losses against their closed forms,
the pair data (TRL's forms, truncation, bad input), the reference model
(LoRA adapters off; the first step's rewards are exactly zero) and the
layouts (dp2 ZeRO-3, tp2, pp2) against one process."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from giantmodel.config import load_config
from giantmodel.config.dpo import DPOConfig
from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.core.loss import IGNORE_INDEX
from giantmodel.data.chat import BUILTIN_TEMPLATES, ChatTemplate
from giantmodel.data.preference import (
    PreferenceStats,
    Truncation,
    build_pair_rows,
    build_preference_rows,
    parse_record,
    read_pairs,
    truncate_pair,
)
from giantmodel.data.preference_builtin import tiny_preferences
from giantmodel.objectives.dpo import sequence_logps
from giantmodel.objectives.dpo_loss import preference_loss
from giantmodel.testing import run_ranks

TINY = ["model.arch=llama", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.vocab_size=1024",
        "model.max_seq_len=128"]
TRAIN = ["objective=dpo", "data.source=preference", "data.valid_fraction=0",
         "train.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=2",
         "train.device=cpu", "optim.lr=0.002", "optim.eps=1e-5", "optim.warmup_steps=0",
         "optim.schedule=constant", "optim.grad_clip=1.0", "precision=fp32",
         "dpo.max_prompt_length=40", "lora.rank=4", "lora.alpha=8.0",
         "lora.targets=[all_linear]"]
STEPS = 3


# --------------------------------------------------------------------------- losses

def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_every_loss_matches_its_closed_form():
    pc, pr, rc, rr = [-10.0, -20.0], [-12.0, -15.0], [-11.0, -19.0], [-11.5, -16.0]
    nc, nr = [4, 5], [3, 8]
    policy, ref = torch.tensor([pc, pr], dtype=torch.float64), torch.tensor([rc, rr],
                                                                           dtype=torch.float64)
    counts = torch.tensor([nc, nr])
    beta, ls, gamma = 0.3, 0.1, 0.7
    for i in range(2):
        h = (pc[i] - pr[i]) - (rc[i] - rr[i])
        ha = (pc[i] / nc[i] - pr[i] / nr[i]) - (rc[i] / nc[i] - rr[i] / nr[i])
        ac, ar = pc[i] / nc[i], pr[i] / nr[i]
        log_odds = (ac - ar) - (math.log1p(-math.exp(ac)) - math.log1p(-math.exp(ar)))
        expected = {
            ("sigmoid", 0.0): -math.log(_sig(beta * h)),
            ("sigmoid", ls): -(1 - ls) * math.log(_sig(beta * h)) - ls * math.log(_sig(-beta * h)),
            ("robust", ls): (-(1 - ls) * math.log(_sig(beta * h))
                             + ls * math.log(_sig(-beta * h))) / (1 - 2 * ls),
            ("hinge", 0.0): max(0.0, 1 - beta * h),
            ("ipo", 0.0): (ha - 1 / (2 * beta)) ** 2,
            ("simpo", 0.0): -math.log(_sig(beta * (ac - ar) - gamma)),
            ("orpo", 0.0): -ac - beta * math.log(_sig(log_odds)),
        }
        for (kind, smooth), want in expected.items():
            cfg = DPOConfig(loss_type=kind, beta=beta, label_smoothing=smooth, simpo_gamma=gamma)
            losses, r_c, r_r, _, _ = preference_loss(cfg, policy, counts, ref)
            assert float(losses[i]) == pytest.approx(want, rel=1e-12), (kind, smooth)
            if kind in ("sigmoid", "hinge", "robust"):
                assert float(r_c[i]) == pytest.approx(beta * (pc[i] - rc[i]), rel=1e-12)
                assert float(r_r[i]) == pytest.approx(beta * (pr[i] - rr[i]), rel=1e-12)
    # the policy equal to the reference: zero rewards, DPO's loss ln 2
    losses, r_c, r_r, _, _ = preference_loss(DPOConfig(), ref, counts, ref)
    assert r_c.abs().max() == 0 and r_r.abs().max() == 0
    assert float(losses[0]) == pytest.approx(math.log(2), rel=1e-12)


def test_sequence_logps_sum_each_pairs_answer_tokens_in_packed_rows():
    # one pair row holding two pairs (documents 0 and 1), then padding
    T, V = 10, 7
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1, -1, -1], [0, 0, 0, 0, 1, 1, -1, -1, -1, -1]])
    labels = torch.full((2, T), IGNORE_INDEX)
    labels[0, 1:3], labels[0, 5:7] = torch.tensor([1, 2]), torch.tensor([3, 4])
    labels[1, 2:4], labels[1, 5] = torch.tensor([5, 6]), 0
    logits = torch.randn(2, T, V, generator=torch.Generator().manual_seed(0))
    sums, counts, valid = sequence_logps(logits, labels, docs)
    logp = torch.log_softmax(logits, -1)

    def tok(r, t):
        return float(logp[r, t, labels[r, t]])

    assert valid.tolist() == [True, True]
    assert counts.tolist() == [[2, 2], [2, 1]]
    want = [[tok(0, 1) + tok(0, 2), tok(0, 5) + tok(0, 6)], [tok(1, 2) + tok(1, 3), tok(1, 5)]]
    assert torch.allclose(sums, torch.tensor(want), atol=1e-6)


# --------------------------------------------------------------------------- data

class _CharTokenizer:
    """One token per character: lengths are easy to reason about."""

    eos_id = 1

    def encode(self, text: str) -> list[int]:
        return [1 if c == "\x01" else 3 + ord(c) % 200 for c in text]

    def id_to_token(self, i: int) -> str:
        return "\x01" if i == 1 else chr(i - 3)


def _chatml() -> ChatTemplate:
    return ChatTemplate(BUILTIN_TEMPLATES["chatml"], "chatml", "", "<|im_end|>")


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_trl_forms_render_and_score_only_the_answers(tmp_path):
    user = [{"role": "user", "content": "Hi?"}]
    records = [
        {"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " 5"},
        {"prompt": user, "chosen": [{"role": "assistant", "content": "yes"}],
         "rejected": [{"role": "assistant", "content": "no"}]},
        {"chosen": user + [{"role": "assistant", "content": "yes"}],
         "rejected": user + [{"role": "assistant", "content": "no"}]},
    ]
    pairs = read_pairs([_write(tmp_path / "p.jsonl", records)])
    assert pairs[0][1] == ("Q: 2+2?", " 4", " 5")
    assert pairs[1][1] == pairs[2][1]  # the implicit prompt is the common prefix
    rows = build_preference_rows(pairs, _CharTokenizer(), _chatml(), seq_len=63, pack=False,
                                 truncation=Truncation(64), name="t", report=False)
    assert rows.rows.shape == (3, 2, 3, 64)
    first = rows.rows[0]
    # scored: the answer's characters and the appended EOS, nothing of the prompt
    assert (first[0, 1] != IGNORE_INDEX).sum() == len(" 4") + 1
    assert first[0, 0, 7:10].tolist() == _CharTokenizer().encode(" 4") + [1]
    assert (first[0, 1, :7] == IGNORE_INDEX).all()
    chat = rows.rows[1, 0]
    prompt = _chatml().prompt(user)
    answer = _chatml().render(user + [{"role": "assistant", "content": "yes"}]).text[len(prompt):]
    # the template's end of turn closes a conversational answer: no EOS added
    assert int((chat[1] != IGNORE_INDEX).sum()) == len(answer)


def test_truncation_follows_trl_and_is_counted():
    stats = PreferenceStats()
    prompt, chosen, rejected = list(range(10, 30)), [5, 6, 7, 1], [8, 1]
    t = Truncation(max_length=12, max_prompt_length=10, mode="keep_end")
    (c, cm), (r, rm) = truncate_pair(prompt, chosen, rejected, t, stats, "x")
    assert c.tolist() == list(range(22, 30)) + chosen  # prompt: its last 10, then the end
    assert r.tolist() == list(range(20, 30)) + rejected and rm.sum() == 2
    assert (stats.prompts_truncated, stats.sequences_truncated) == (1, 1)
    t = Truncation(max_length=12, max_prompt_length=None, max_completion_length=3,
                   mode="keep_start")
    stats = PreferenceStats()
    with pytest.raises(UserInputError, match="x: the chosen answer is empty after truncation"):
        truncate_pair(prompt, chosen, rejected, t, stats, "x")
    stats = PreferenceStats()
    (c, cm), _ = truncate_pair(prompt[:9], chosen, rejected, t, stats, "x")
    assert c.tolist() == prompt[:9] + chosen[:3] and stats.answers_truncated == 1


def test_packing_keeps_each_pair_on_adjacent_rows():
    stats = PreferenceStats()
    pair = ((np.arange(2, 7), np.array([0, 0, 1, 1, 1], bool)),
            (np.arange(2, 5), np.array([0, 1, 1], bool)))
    rows = build_pair_rows([pair, pair, pair], seq_len=11, pack=True, pad_id=0, stats=stats)
    assert rows.shape == (2, 2, 3, 12)  # two pairs fit the chosen row (5 + 5 <= 12)
    assert rows[0, 0, 2].tolist() == [0] * 5 + [1] * 5 + [-1] * 2
    assert rows[0, 1, 2].tolist() == [0] * 3 + [1] * 3 + [-1] * 6
    assert rows[1, 0, 2, :5].tolist() == [0] * 5


def test_bad_input_fails_in_one_line_naming_the_file_and_line(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                           {"prompt": "a", "chosen": "b"}])
    with pytest.raises(UserInputError, match=r"bad.jsonl:2: preference record has no 'rejected'"):
        read_pairs([path])
    with pytest.raises(UserInputError, match="both be strings or both message lists"):
        parse_record({"prompt": "a", "chosen": "b", "rejected": []}, "f:3")
    with pytest.raises(ConfigError, match=r"dpo.beta: must be > 0"):
        load_config(overrides=["objective=dpo", "data.source=preference", "dpo.beta=0"])
    with pytest.raises(ConfigError, match="data.source"):
        load_config(overrides=["objective=dpo"])
    cfg = load_config(overrides=TINY + TRAIN + [f"data.paths=[{path}]"])
    from giantmodel.objectives import build_objective

    with pytest.raises(ConfigError, match=r"data.paths: .*bad.jsonl:2: .*no 'rejected'"):
        build_objective(cfg)


# --------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> str:
    train, _ = tiny_preferences(num_train=16, num_valid=0)
    return _write(tmp_path_factory.mktemp("dpo") / "pairs.jsonl", train)


def run_dpo(overrides: list[str], steps: int = STEPS) -> dict:
    """Train ``steps`` steps of objective dpo in this process group (or
    alone): per-step losses and metrics, and the final parameters."""
    import torch.distributed as dist

    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.objectives.dpo import DPO
    from giantmodel.train.trainer import build_engine
    from tests.layout_harness import full_parameters

    cfg = load_config(overrides=TINY + TRAIN + overrides)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_config(cfg, world)
    if world > 1:
        dims.build_mesh("cpu")
    objective = DPO.from_config(cfg)
    engine = build_engine(cfg, objective, dims, torch.device("cpu"))
    loader, _ = objective.build_loaders(dp_rank=engine.data_rank, dp_size=engine.data_world)
    precision = Precision("fp32", "cpu")
    opt = engine.build_optimizer(cfg.optim)
    losses, metrics = [], []
    for _ in range(steps):
        mbs = [next(loader) for _ in range(loader.micro_per_step)]
        losses.append(engine.forward_backward(mbs, precision))
        metrics.append(objective.step_metrics())
        engine.clip_grad_norm_(cfg.optim.grad_clip)
        engine.optimizer_step(opt)
        engine.zero_grad(opt)
    params = {k: v.numpy() for k, v in full_parameters(engine).items()}
    if world > 1:
        dims.destroy_mesh()
    return {"losses": losses, "metrics": metrics, "params": params, "objective": objective,
            "engine": engine}


def _cases(rank: int, world: int, cases: list) -> list:
    from giantmodel.core.tensors import local_tensor

    out = []
    for overrides in cases:
        result = run_dpo(overrides)
        objective = result.pop("objective")
        result.pop("engine")
        refs = [p for ref in objective._refs.values() for p in ref.parameters()]
        # how much of the frozen reference copy this rank holds
        result["ref_share"] = (sum(local_tensor(p).numel() for p in refs) /
                               max(sum(p.numel() for p in refs), 1))
        out.append(result if rank == 0 else None)
    return out


def test_first_step_rewards_are_zero_and_the_lora_reference_is_the_base(pairs_file):
    from giantmodel.models.lora import LoRALinear, adapters_off

    run = run_dpo([f"data.paths=[{pairs_file}]", "dpo.use_lora=true"])
    first = run["metrics"][0]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert first[key] == 0.0, key  # the policy is the reference
    assert run["losses"][0] == pytest.approx(math.log(2), abs=1e-7)
    assert first["logps/chosen"] < 0 and run["metrics"][-1]["rewards/margins"] != 0.0
    model = run["engine"].parts[0]
    ids = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model(ids)
        with adapters_off(model):
            off = model(ids)
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.zero_()
        base = model(ids)
    assert (trained - base).abs().max() > 1e-4  # the adapters moved
    assert torch.equal(off, base)


def test_layouts_match_one_process(pairs_file):
    data = [f"data.paths=[{pairs_file}]"]
    cases = [
        data + ["dpo.use_lora=true", "parallel.dp=2", "parallel.zero=3"],
        # full fine-tuning: the frozen copy FSDP-sharded like the policy
        data + ["dpo.loss_type=ipo", "parallel.dp=2", "parallel.zero=3"],
        data + ["parallel.tp=2"],  # full fine-tuning: a frozen reference copy, tp-sharded
        data + ["dpo.use_lora=true", "parallel.tp=2", "data.pack=true", "dpo.loss_type=ipo"],
        data + ["dpo.loss_type=simpo", "parallel.pp=2"],
        # the reference under pp: LoRA adapters off in a forward-only walk of
        # the stages; a full fine-tune's frozen copy of each stage (packed)
        data + ["dpo.use_lora=true", "parallel.pp=2"],
        data + ["dpo.loss_type=ipo", "data.pack=true", "parallel.pp=2"],
    ]
    results = run_ranks(_cases, 2, cases, timeout=300)[0]
    for overrides, got in zip(cases, results, strict=True):
        ref = run_dpo([o for o in overrides if not o.startswith("parallel.")])
        label = " ".join(overrides[1:])
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, err_msg=label)
        for a, b in zip(got["metrics"], ref["metrics"], strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (label, k)
        if "dpo.loss_type=simpo" not in overrides:
            assert got["metrics"][0]["rewards/margins"] == 0.0, label  # policy == reference
        if "dpo.use_lora=true" not in overrides and "dpo.loss_type=simpo" not in overrides:
            sharded = "parallel.zero=3" in overrides or "parallel.tp=2" in overrides
            assert got["ref_share"] <= (0.55 if sharded else 1.0), label
            assert got["ref_share"] > (0.0 if sharded else 0.45), label
        for name, want in ref["params"].items():
            np.testing.assert_allclose(got["params"][name], want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{label}: {name}")


def test_trainer_logs_trl_metrics_to_metrics_jsonl(pairs_file, tmp_path):
    from giantmodel.train.trainer import Trainer

    cfg = load_config(overrides=TINY + TRAIN + [
        f"data.paths=[{pairs_file}]", "dpo.use_lora=true", "train.steps=2", "train.log_every=1",
        "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every=0",
        f"run.dir={tmp_path / 'run'}", "run.tensorboard=false", "run.progress=false"])
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rewards/margins" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["rewards/chosen"] == steps[0]["rewards/rejected"] == 0.0
    assert {"rewards/accuracies", "logps/chosen", "logps/rejected"} <= steps[1].keys()
