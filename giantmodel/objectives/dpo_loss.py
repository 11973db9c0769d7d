"""Preference losses on sequence log-probabilities, as TRL computes them.

Inputs are per-pair tensors ``[P]``: the summed log-probs of the chosen and
the rejected answer under the policy (and the reference), and the number of
scored tokens of each. Each loss returns ``(losses [P], chosen rewards [P],
rejected rewards [P], chosen logps [P], rejected logps [P])``, as TRL logs
them: rewards are ``beta`` times the policy/reference log-ratio of the
summed logps (ipo's loss alone averages it per token), and for the
reference-free simpo and orpo ``beta`` times the length-averaged logps.

* sigmoid (DPO, Rafailov et al. 2023), with label smoothing (cDPO);
* robust (Chowdhury et al. 2024): unbiased under preference noise ``ls``;
* hinge (SLiC): ``relu(1 - beta * h)``;
* ipo (Azar et al. 2023): ``(h - 1 / (2 beta))^2``, each answer's log-ratio
  averaged over its tokens;
* simpo (Meng et al. 2024): reference-free, ``-log sigmoid(beta * (avg_c -
  avg_r) - gamma)``;
* orpo (Hong et al. 2024): reference-free, the chosen answer's mean NLL minus
  ``beta * log sigmoid(log odds ratio)`` on length-averaged logps.

``h`` is the DPO margin ``(pi_c - pi_r) - (ref_c - ref_r)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from giantmodel.config.dpo import DPOConfig

REFERENCE_FREE = ("simpo", "orpo")  # length-averaged logps, no reference (TRL's CPO/ORPO)


def preference_loss(cfg: DPOConfig, policy: torch.Tensor, counts: torch.Tensor,
                    reference: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``policy`` and ``reference``: summed logps ``[2, P]`` (row 0 chosen,
    row 1 rejected); ``counts``: scored tokens ``[2, P]``. See the module
    docstring for what is returned."""
    kind, beta, ls = cfg.loss_type, cfg.beta, cfg.label_smoothing
    counts = counts.to(policy.dtype)
    if kind in REFERENCE_FREE:
        policy = policy / counts
    pc, pr = policy[0], policy[1]
    if kind == "simpo":
        logits = beta * (pc - pr) - cfg.simpo_gamma
        losses = -F.logsigmoid(logits) * (1 - ls) - F.logsigmoid(-logits) * ls
        return losses, beta * pc.detach(), beta * pr.detach(), pc.detach(), pr.detach()
    if kind == "orpo":
        log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
        losses = -pc - beta * F.logsigmoid(log_odds)
        return losses, beta * pc.detach(), beta * pr.detach(), pc.detach(), pr.detach()
    if reference is None:
        raise ValueError(f"loss {kind} needs reference log-probs")
    rc, rr = reference[0], reference[1]
    h = (pc - pr) - (rc - rr)
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - ls) - F.logsigmoid(-beta * h) * ls
    elif kind == "robust":
        losses = (-F.logsigmoid(beta * h) * (1 - ls) + F.logsigmoid(-beta * h) * ls) / (1 - 2 * ls)
    elif kind == "hinge":
        losses = torch.relu(1 - beta * h)
    elif kind == "ipo":
        # Each answer's log-ratio averaged over its tokens (TRL's IPO).
        ratios = (policy - reference) / counts
        losses = (ratios[0] - ratios[1] - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}")
    rewards_c = beta * (pc - rc).detach()
    rewards_r = beta * (pr - rr).detach()
    return losses, rewards_c, rewards_r, pc.detach(), pr.detach()


# The step metrics, in TRL's names, from the per-pair sums kept over a step.
METRIC_SLOTS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


def metric_sums(rewards_c: torch.Tensor, rewards_r: torch.Tensor, logps_c: torch.Tensor,
                logps_r: torch.Tensor) -> torch.Tensor:
    """float64 ``[1 + 6]``: the pair count, then each metric summed over pairs."""
    parts = [rewards_c, rewards_r, (rewards_c > rewards_r).to(rewards_c.dtype),
             rewards_c - rewards_r, logps_c, logps_r]
    sums = torch.stack([p.detach().double().sum() for p in parts])
    count = torch.tensor([float(rewards_c.numel())], dtype=torch.float64, device=sums.device)
    return torch.cat([count, sums])


def metric_means(sums: torch.Tensor) -> dict[str, float]:
    """Means over pairs from :func:`metric_sums` totals (empty without pairs)."""
    values = sums.tolist()
    n = values[0]
    if n <= 0:
        return {}
    return {name: v / n for name, v in zip(METRIC_SLOTS, values[1:], strict=True)}
