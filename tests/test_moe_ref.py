"""test_moe_ref: DeepSeekMoE's router at its edges, the C model (tests/model_dump) against the
PyTorch reference (tests/ref/model.py) as tests/test_model_ref.py compares them (logits, loss,
every gradient, fp32, 1e-4 relative): every token routed to one expert (the others get none);
an expert no token chooses; exact ties in the router (all-zero router weights, so every
probability is 1/E; duplicated router rows), where torch.topk's own tie order picks the
experts and the C engine reproduces it (engine/topk.h: insertion sort, introsort's
nth_element and partial_sort, by E and k); top-k = n_routed_experts. Then 10 optimizer steps
of astrai-train (gqa+moe, mla+mlp, mla+moe with adamw; mla+moe with muon; sft, packed
documents and a loss mask, for gqa+moe and mla+moe) against the reference's training loop, as
tests/test_train_ref.py does for the dense model: the same loss, grad norm and lr per step.

    ASTRAI_BUILD=build python3 tests/test_moe_ref.py [routing|curves]
"""
import os
import sys

import torch

from test_model_ref import check_case, mla_config, moe_config, moe_keys

BIG = 0  # the hidden channel that dominate_channel makes large and positive for every token


def dominate_channel(weights, cfg, value=2.0):
    """Embedding column BIG large and positive, the post-attention norms' weight 1 there: every
    token's normed FFN input has a large positive entry BIG (~5.5 against ~0.15 elsewhere; the
    attention outputs cannot flip it), so the router's column BIG decides the logits."""
    weights["embed_tokens.weight"][:, BIG] = value
    for i in range(cfg["num_hidden_layers"]):
        weights[f"layers.{i}.post_attention_norm.weight"][BIG] = 1.0


def router_keys(cfg):
    return [f"layers.{i}.mlp.router.weight" for i in range(cfg["num_hidden_layers"])]


def routing(ref):
    """[(router logits (N,E), chosen experts (N,k))] of each layer of the last forward."""
    assert ref.routing, "no MoE layer ran"
    return list(ref.routing.values())


def one_expert(winner):
    """Every token of every layer chooses routed expert `winner` first, by far."""
    def edit(weights, cfg):
        dominate_channel(weights, cfg)
        for k in router_keys(cfg):
            weights[k][:, BIG] = 0.0
            weights[k][winner, BIG] = 10.0

    def expect(ref):
        for _, chosen in routing(ref):
            assert bool((chosen[:, 0] == winner).all()), chosen
    return edit, expect


def unused_expert(loser):
    """Routed expert `loser` has by far the lowest logit of every token: no token chooses it."""
    def edit(weights, cfg):
        dominate_channel(weights, cfg)
        for k in router_keys(cfg):
            weights[k][loser, BIG] = -10.0

    def expect(ref):
        for _, chosen in routing(ref):
            assert not bool((chosen == loser).any()), chosen
    return edit, expect


def zero_router():
    """All router logits exactly 0: every probability 1/E, a tie of all E experts."""
    def edit(weights, cfg):
        for k in router_keys(cfg):
            weights[k][:] = 0.0

    def expect(ref):
        for logits, _ in routing(ref):
            assert bool((logits == 0).all())
    return edit, expect


def duplicated_rows(pairs):
    """Router rows b equal to rows a for (a, b) in pairs: those experts' logits tie exactly, and
    the tie decides some token's choice (one of a pair chosen, the other not)."""
    def edit(weights, cfg):
        for k in router_keys(cfg):
            for a, b in pairs:
                weights[k][b] = weights[k][a]

    def expect(ref):
        decided = 0
        for logits, chosen in routing(ref):
            for a, b in pairs:
                assert torch.equal(logits[:, a], logits[:, b]), (a, b)
                decided += int(((chosen == a).any(1) != (chosen == b).any(1)).sum())
        assert decided > 0, "no choice was decided by a tie"
    return edit, expect


def plain():
    return (lambda weights, cfg: None), None


def routing_cases():
    """(name, config, check_case arguments, whether AstrAI's own modules can run it)."""
    cases = []

    def add(name, cfg, how, astrai=True, **args):
        edit, expect = how
        args.setdefault("B", 2)
        args.setdefault("T", 16)
        cases.append((name, cfg, dict(args, edit_weights=lambda w, rng: edit(w, cfg),
                                      check_ref=expect), astrai))

    small = dict(intermediate_size=8)
    add("top-1, every token to expert 2 (others none)", moe_config(4, 1, 1, **small),
        one_expert(2), seed=51, zero_floor=1e-6)
    add("top-1, every token to expert 0, no shared, mla K=1", mla_config(
        4, 4, 12, num_key_value_heads=1, **moe_keys(3, 0, 1), **small), one_expert(0), seed=52,
        zero_floor=1e-6)
    add("top-2, expert 3 of 5 chosen by no token", moe_config(5, 1, 2, **small),
        unused_expert(3), seed=53)
    add("top-3, expert 0 of 6 chosen by no token, packed", moe_config(6, 2, 3, **small),
        unused_expert(0), seed=54, doc_starts=[[0, 4], [0, 9]])
    # ties of all E experts, through each of torch.topk's paths (k*64 <= E: partial_sort;
    # otherwise nth_element, introsort beyond 16 elements, then a sort of the first k-1)
    add("zero router: all tied, E=4 k=2", moe_config(4, 1, 2, **small), zero_router(), seed=55)
    add("zero router: all tied, E=8 k=8 (k = E)", moe_config(8, 0, 8, **small), zero_router(),
        seed=56)
    add("zero router: all tied, E=24 k=3 (nth_element introsort)",
        moe_config(24, 1, 3, intermediate_size=4), zero_router(), seed=57)
    add("zero router: all tied, E=64 k=1 (partial_sort)",
        moe_config(64, 0, 1, intermediate_size=4), zero_router(), seed=58, B=1, zero_floor=1e-6)
    add("zero router: all tied, E=130 k=2 (partial_sort), mla K=H",
        mla_config(4, 4, 8, num_key_value_heads=4, num_hidden_layers=1,
                   **moe_keys(130, 1, 2), intermediate_size=4), zero_router(), seed=59, B=1)
    add("duplicated router rows (0=1, 2=3), E=4 k=1", moe_config(4, 1, 1, **small),
        duplicated_rows([(0, 1), (2, 3)]), seed=60, zero_floor=1e-6)
    add("duplicated router rows (0=1=2, 3=4), E=6 k=2", moe_config(6, 0, 2, **small),
        duplicated_rows([(0, 1), (0, 2), (3, 4)]), seed=61)
    add("duplicated router rows (1=5), E=6 k=3, mla K=2<H", mla_config(
        4, 4, 12, num_key_value_heads=2, **moe_keys(6, 2, 3), **small),
        duplicated_rows([(1, 5)]), astrai=False, seed=62, doc_starts=[[0, 8], [0]])
    add("top-k = E = 4, all experts weighted", moe_config(4, 2, 4, **small), plain(), seed=63)
    add("top-k = E = 1 (weight 1)", moe_config(1, 1, 1, **small), plain(), seed=64,
        zero_floor=1e-6)
    return cases


def check_routing():
    for name, cfg, args, _ in routing_cases():
        check_case(name, cfg, **args)


# ------------------------------------------------------------------------- training curves

CURVE_CONFIGS = {
    "gqa+moe": {**moe_keys(4, 1, 2), "intermediate_size": 64},
    "mla+mlp": {"attn_type": "mla", "kv_lora_rank": 24, "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 8, "num_key_value_heads": 1},
    "mla+moe": {"attn_type": "mla", "kv_lora_rank": 24, "qk_nope_head_dim": 12,
                "qk_rope_head_dim": 4, "num_key_value_heads": 4, **moe_keys(4, 2, 2),
                "intermediate_size": 64},
}
WINDOW, BATCH, STEPS = 32, 4, 10


def check_curves():
    """10 steps (40 windows of 32 bytes, batches of 4) of astrai-train and of the reference from
    the same astrai-model init: adamw for every config, muon (AstrAI's MuonMix: which tensors
    Muon steps, the router's and every expert's matrices among them) for mla+moe, and sft (packed
    documents, a loss mask) for gqa+moe and mla+moe."""
    import train_util as tu
    failures = []
    runs = [(name, over, "adamw", "seq") for name, over in CURVE_CONFIGS.items()]
    runs.append(("mla+moe", CURVE_CONFIGS["mla+moe"], "muon", "seq"))
    # sft: packed documents (position ids restarting inside windows) and half the targets
    # masked, through the router and experts of both attention types
    runs += [(name, CURVE_CONFIGS[name], "adamw", "sft") for name in ("gqa+moe", "mla+moe")]
    for name, over, kind, train_type in runs:
        curve(tu, f"{name} {kind} {train_type}", dict(tu.SMALL_CONFIG, **over), kind,
              train_type, failures)
    return tu.finish(failures)


def curve(tu, name, cfg, kind, train_type, failures):
    root = tu.tmpdir()
    model_dir = tu.make_model(root, cfg)
    n_tokens = STEPS * BATCH * WINDOW + 1
    sft = {}
    if train_type == "sft":
        data_dir = tu.make_sft_data(root, n_tokens)
        tokens, mask, pos = tu.sft_arrays(n_tokens)
        sft = {"loss_mask": mask, "position_ids": pos}
        assert (pos[1:] <= pos[:-1]).sum() > STEPS * BATCH, "too few packed documents"
    else:
        data_dir, tokens = tu.make_text_data(root, n_tokens)
    ckpt_dir = os.path.join(root, "ckpt")
    lr, wd = 3e-3, 0.1
    tu.train({"train_type": train_type, "param_path": model_dir, "data_root_path": data_dir,
              "batch_per_device": BATCH, "window_size": WINDOW, "optimizer": kind,
              "max_lr": lr, "weight_decay": wd, "max_grad_norm": 1.0,
              "ckpt_dir": ckpt_dir, "ckpt_interval": 1000, "threads": 2})
    ours = tu.metric_rows(tu.latest_checkpoint(ckpt_dir))
    ref, _ = tu.reference_training(model_dir, tokens, WINDOW, BATCH, 1, 0, kind, lr, wd, 1.0,
                                   seed=3407, **sft)
    if len(ours) != STEPS or len(ref) != STEPS:
        failures.append(f"{name}: {len(ours)} steps, reference {len(ref)}, expected {STEPS}")
        return
    worst = 0.0
    for a, b in zip(ours, ref):
        for key in ("loss", "grad_norm", "lr"):
            err = tu.rel_err(a[key], b[key])
            worst = max(worst, err)
            if err > 1e-4:
                failures.append(f"{name} step {a['step']}: {key} {a[key]} vs reference {b[key]}")
    print(f"{name}: {STEPS} steps, loss {ours[0]['loss']:.4f} -> {ours[-1]['loss']:.4f}, "
          f"worst relative error {worst:.2e}")


def main(argv):
    torch.set_num_threads(2)
    what = argv[1:] or ["routing", "curves"]
    if "routing" in what:
        check_routing()
    if "curves" in what:
        return check_curves()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
