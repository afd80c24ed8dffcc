"""PyTorch reference of astrai's optimizers and gradient clipping (engine/optim.c,
docs/design.md §8).

- adamw: torch.optim.AdamW itself (betas 0.9/0.95, eps 1e-8, decoupled weight decay on every
  parameter).
- muon: AstrAI's MuonMix (scripts/tools/train.py): torch.optim.Muon for 2-D weights whose names
  contain none of norm/bias/embed/lm_head, AdamW with weight decay 0 for the rest. Muon is written
  out here after torch >= 2.9's `_single_tensor_muon` (Debian's torch may predate it), with the
  Newton-Schulz iteration in fp32 where torch uses bf16.

Both optimizers share one small API, so the reference model can be trained with them:

    opt = make_optimizer("muon", model.named_parameters(), lr=3e-4, weight_decay=0.1)
    loss.backward(); norm = clip_grad_norm(model.parameters(), 1.0); opt.step(lr); opt.zero_grad()

`state_tensors()` returns the optimizer state under the tensor names of astrai's
optimizer.safetensors (exp_avg.<param>, exp_avg_sq.<param>, momentum_buffer.<param>, step).
"""

import math

import torch

BETAS = (0.9, 0.95)
EPS = 1e-8
MUON_MOMENTUM = 0.95
NS_STEPS = 5
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
MUON_EXCLUDED = ("norm", "bias", "embed", "lm_head")


def muon_owns(name, param):
    """MuonMix's split: Muon for matrices that are not norms, biases, embeddings or the head."""
    return param.dim() >= 2 and not any(word in name for word in MUON_EXCLUDED)


def newton_schulz(update, steps=NS_STEPS, eps=NS_EPS):
    """torch.optim._muon._zeropower_via_newtonschulz, in fp32."""
    a, b, c = NS_COEFFICIENTS
    transposed = update.size(0) > update.size(1)
    x = update.float()
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*A + c*A@A
        x = torch.addmm(x, poly, x, beta=a)  # a*X + B@X
    return x.T if transposed else x


def match_rms_adamw_lr(lr, shape):
    """torch.optim.Muon adjust_lr_fn="match_rms_adamw"."""
    return lr * 0.2 * math.sqrt(max(shape[0], shape[1]))


def adjusted_lr(lr, shape, adjust_lr="match_rms_adamw"):
    """torch.optim.Muon's _adjust_lr: "original" sqrt(max(1, A/B)), or match_rms_adamw."""
    if adjust_lr == "original":
        return lr * math.sqrt(max(1.0, shape[0] / shape[1]))
    return match_rms_adamw_lr(lr, shape)


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon (default nesterov, match_rms_adamw), Newton-Schulz in fp32."""

    def __init__(self, params, lr, weight_decay=0.1, momentum=MUON_MOMENTUM, ns_steps=NS_STEPS,
                 nesterov=True, adjust_lr="match_rms_adamw"):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps,
                        nesterov=nesterov, adjust_lr=adjust_lr)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_steps"])
                p.mul_(1 - lr * wd)  # decoupled decay uses the unadjusted lr
                p.add_(update, alpha=-adjusted_lr(lr, p.shape, group["adjust_lr"]))


def _adamw(params, lr, weight_decay):
    return torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)


class _NamedOptimizers:
    """Steps a list of torch optimizers together at a given lr; names the state like astrai."""

    def __init__(self, named_params, optimizers):
        self.named_params = named_params
        self.optimizers = optimizers

    def step(self, lr=None):
        for opt in self.optimizers:
            if lr is not None:
                for group in opt.param_groups:
                    group["lr"] = lr
            opt.step()

    def zero_grad(self):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_tensors(self):
        out = {}
        steps = []
        for opt in self.optimizers:
            for name, p in self.named_params:
                state = opt.state.get(p)
                if not state:
                    continue
                for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                    if key in state:
                        out[f"{key}.{name}"] = state[key].detach().clone()
                if "step" in state:
                    steps.append(float(state["step"]))
        out["step"] = torch.tensor([steps[0] if steps else 0.0])
        return out


class AdamW(_NamedOptimizers):
    """astrai's `adamw`: torch.optim.AdamW on every parameter."""

    def __init__(self, named_params, lr=3e-4, weight_decay=0.1):
        named = list(named_params)
        super().__init__(named, [_adamw([p for _, p in named], lr, weight_decay)])


class MuonMix(_NamedOptimizers):
    """astrai's `muon` (AstrAI MuonMix): Muon for hidden matrices, AdamW (wd 0) for the rest."""

    def __init__(self, named_params, lr=3e-4, weight_decay=0.1, **muon):
        named = list(named_params)
        matrices = [p for n, p in named if muon_owns(n, p)]
        others = [p for n, p in named if not muon_owns(n, p)]
        optimizers = []
        if matrices:
            optimizers.append(Muon(matrices, lr=lr, weight_decay=weight_decay, **muon))
        if others:
            optimizers.append(_adamw(others, lr, 0.0))
        super().__init__(named, optimizers)


def make_optimizer(kind, named_params, lr=3e-4, weight_decay=0.1, **muon):
    """muon: the Muon knobs (momentum, ns_steps, nesterov, adjust_lr) of --muon_* flags."""
    if kind == "adamw":
        return AdamW(named_params, lr, weight_decay)
    if kind == "muon":
        return MuonMix(named_params, lr, weight_decay, **muon)
    raise ValueError(f"unknown optimizer {kind!r} (adamw, muon)")


def clip_grad_norm(params, max_norm):
    """torch clip_grad_norm_ when max_norm > 0; only the norm otherwise. Returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.norm(torch.stack([torch.norm(g.detach(), 2.0) for g in grads]), 2.0)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coef)
    return float(norm)
