"""pref.py: PyTorch reference of astrai's offline DPO and GRPO (docs/design.md §8), written in the
structure of AstrAI's DPOStrategy, GRPOStrategy and get_logprobs (astrai/trainer/strategy.py).

Records are token lists: DPO (prompt, chosen, rejected); GRPO (prompt, [responses], [rewards]).
Each (prompt, response) becomes one row s by the truncation rule of data/records.h (the
response's first q = min(R, W) tokens, after the prompt's last p = min(P, W + 1 - q)), the model
reads s[:-1] with positions 0..len-1, and a log-prob counts where s[t+1] is a response token.

    loss, metrics = dpo_loss(policy, reference, records, window, beta=0.1)
    loss, metrics = grpo_loss(policy, reference, records, window, clip_eps=0.2, kl_coef=0.01)
    loss.backward(); policy.grads()
    rows, policy = reference_pref_training(model_dir, "dpo", records, window, ...)

The reference model (and GRPO's old policy: offline, both are the frozen initial weights) runs
without gradients.
"""

import torch
import torch.nn.functional as F

from ref.model import RefModel
from train_util import reference_loop

ADV_EPS = 1e-8  # AstrAI's eps of the advantage's std and of the KL's log


def build_row(prompt, response, window):
    """(s, p): the row's tokens and the number of prompt tokens it keeps (s[p:] is response)."""
    q = min(len(response), window)
    p = min(len(prompt), window + 1 - q)
    return list(prompt[len(prompt) - p:]) + list(response[:q]), p


def pack_rows(rows):
    """(ids, loss_mask): (N,S) right-padded with 0. loss_mask[n, i] = 1 iff token i of row n is a
    response token. The padding sits after every real token, so causal attention keeps it out
    of every counted position (positions 0..len-1 are those of the unpadded row)."""
    S = max(len(s) for s, _ in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S)
    for n, (s, p) in enumerate(rows):
        ids[n, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[n, p:len(s)] = 1.0
    return ids, mask


def get_logprobs(model, input_ids, loss_mask, reduction):
    """AstrAI's get_logprobs: token log-probs of input_ids[:, 1:] given the prefix, masked by
    loss_mask[:, 1:]; "sum" per row (N), or "none" (N, S-1)."""
    shifted_ids = input_ids[:, 1:]
    shifted_mask = loss_mask[:, 1:]
    logits = model.forward(input_ids[:, :-1])
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    token_logprobs = torch.gather(log_probs, -1, shifted_ids.unsqueeze(-1)).squeeze(-1)
    if reduction == "sum":
        return (token_logprobs * shifted_mask).sum(dim=-1)
    if reduction == "none":
        return token_logprobs * shifted_mask
    raise ValueError(f"reduction must be sum or none, got {reduction!r}")


def dpo_loss(policy, reference, records, window, beta=0.1):
    """Rows: the chosen of every record, then their rejected (AstrAI's concat)."""
    rows = ([build_row(p, c, window) for p, c, _ in records] +
            [build_row(p, r, window) for p, _, r in records])
    ids, mask = pack_rows(rows)
    log_pi = get_logprobs(policy, ids, mask, "sum")
    with torch.no_grad():
        log_ref = get_logprobs(reference, ids, mask, "sum")
    n = len(records)
    ratio_diff = (log_pi[:n] - log_pi[n:]) - (log_ref[:n] - log_ref[n:])
    loss = -F.logsigmoid(beta * ratio_diff).mean()
    diff = ratio_diff.detach()
    return loss, {"reward_margin": float((beta * diff).mean()),
                  "reward_accuracy": float((diff > 0).float().mean())}


def grpo_loss(policy, reference, records, window, clip_eps=0.2, kl_coef=0.01, old=None):
    """Rows: response j of record r is row r*G + j. Offline the old policy and the KL's reference
    are both the frozen initial weights, so one no-grad forward serves as both. old: the
    behaviour policy's model instead (online: AstrAI's old_model, synced to the policy when the
    rollout was made)."""
    G = len(records[0][1])
    rows = [build_row(p, resp, window) for p, responses, _ in records for resp in responses]
    ids, mask = pack_rows(rows)
    token_masks = mask[:, 1:]
    log_policy = get_logprobs(policy, ids, mask, "none")  # (B*G, S-1)
    with torch.no_grad():
        log_ref = get_logprobs(reference, ids, mask, "none")
        log_old = log_ref if old is None else get_logprobs(old, ids, mask, "none")

    rewards = torch.tensor([list(r) for _, _, r in records], dtype=torch.float32)  # (B,G)
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    advantages = ((rewards - mean) / (std + ADV_EPS)).reshape(-1, 1)  # (B*G, 1) per token
    assert advantages.shape[0] == len(records) * G

    ratio = torch.exp(log_policy - log_old)
    surr1 = ratio * advantages
    surr2 = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    per_token_policy_loss = -torch.min(surr1, surr2)
    token_count = token_masks.sum().clamp(min=1.0)
    policy_loss = (per_token_policy_loss * token_masks).sum() / token_count

    r = torch.exp(log_ref - log_policy)
    kl_per_token = r - torch.log(r + ADV_EPS) - 1.0
    kl = (kl_per_token * token_masks).sum() / token_count
    loss = policy_loss + kl_coef * kl

    clipped = ((ratio.detach() - 1).abs() > clip_eps).float() * token_masks
    return loss, {"reward_mean": float(rewards.mean()), "kl": float(kl.detach()),
                  "clip_fraction": float(clipped.sum() / token_count)}


LOSSES = {"dpo": dpo_loss, "grpo": grpo_loss}
METRICS = {"dpo": ("reward_margin", "reward_accuracy"),
           "grpo": ("reward_mean", "kl", "clip_fraction")}


def reference_pref_training(model_dir, kind, records, window, batch, accum, steps_limit,
                            optimizer, max_lr, weight_decay, max_grad_norm, seed, knobs=None,
                            shuffle=True, warmup_ratio=0.05, min_rate=0.01, n_epoch=1):
    """Trains RefModel on preference records like astrai-train does (one rank); returns (rows,
    policy). A step's loss and metrics are the mean over its micro-batches."""
    loss_fn, knobs = LOSSES[kind], knobs or {}
    policy = RefModel.from_dir(model_dir)
    reference = RefModel.from_dir(model_dir)
    for p in reference.parameters():
        p.requires_grad_(False)

    def micro_loss(idx, consumed):
        return loss_fn(policy, reference, [records[i] for i in idx], window, **knobs)

    rows = reference_loop(policy, len(records), batch, accum, steps_limit, optimizer, max_lr,
                          weight_decay, max_grad_norm, seed, micro_loss, shuffle, warmup_ratio,
                          min_rate, n_epoch)
    return rows, policy
