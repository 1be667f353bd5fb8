"""
Muon for the blocks' weight matrices, with the orthogonalization's dtype a parameter: torch.optim.Muon always casts
to bf16, which a CPU without bf16 instructions emulates at ~20x fp32's cost. Otherwise torch's algorithm and state, so a
checkpoint of either resumes in the other.

    muon, adamw = muon_optimizers(model, 0.1, 6e-4, 2e-2, 0.95, (0.9, 0.95), "cpu", torch.float32)
"""

import math

import torch

# Keller Jordan's quintic coefficients and step count, torch.optim.Muon's defaults
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def orthogonalize(update: torch.Tensor, dtype: torch.dtype, steps: int = NS_STEPS,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz iterations that push every singular value of `update` (2-D) towards 1 (to roughly 0.7-1.2
    with these coefficients): about U·Vᵀ of its SVD, computed in `dtype`, returned in `dtype`."""
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.to(dtype)
    x = x.T if tall else x  # (rows <= cols): the Gram matrix below is the smaller square
    x = x / x.norm().clamp(min=eps)  # not in place: in fp32 `x` may be the caller's momentum buffer
    for _ in range(steps):
        gram = x @ x.T                                           # (rows, rows)
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·G + c·G²
        x = torch.addmm(x, polynomial, x, beta=a)               # a·X + (b·G + c·G²)·X
    return x.T if tall else x


def adjusted_lr(lr: float, shape: torch.Size, adjust_lr_fn: str | None) -> float:
    """torch.optim.Muon's per-matrix scale: Keller's sqrt(max(1, rows/cols)), or Moonshot's 0.2·sqrt(max(rows, cols))
    ("match_rms_adamw": the update's RMS matches AdamW's, so AdamW's learning rate carries over)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update with the orthogonalization in `orthogonalize_dtype`. The dtype is this object's,
    not a parameter group's: a checkpoint made on another machine restores the momentum, never the dtype."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = NS_STEPS, adjust_lr_fn: str | None = None,
                 orthogonalize_dtype: torch.dtype = torch.bfloat16):
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)  # the same group keys as torch.optim.Muon: their state dicts agree
        self.orthogonalize_dtype = orthogonalize_dtype
        shapes = [tuple(p.shape) for group in self.param_groups for p in group["params"] if p.dim() != 2]
        if shapes:
            raise ValueError(f"Muon takes 2-D weight matrices only, got parameters of shape {shapes}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momentum, lr = group["momentum"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalize(update, self.orthogonalize_dtype, group["ns_steps"], group["ns_coefficients"],
                                       group["eps"])
                p.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay
                p.add_(update, alpha=-adjusted_lr(lr, p.shape, group["adjust_lr_fn"]))
        return loss


def muon_parameters(model) -> list[torch.nn.Parameter]:
    """A GPT's 2-D weight matrices inside the transformer blocks: what Muon orthogonalizes. The embeddings (and the
    lm_head tied to one), biases and norms are not matrices of a hidden-to-hidden map; AdamW keeps them."""
    return [p for p in model.transformer.h.parameters() if p.dim() == 2 and p.requires_grad]


def muon_optimizers(model, weight_decay: float, learning_rate: float, muon_lr: float, momentum: float, betas,
                    device_type: str, orthogonalize_dtype: torch.dtype) -> list[torch.optim.Optimizer]:
    """Muon for muon_parameters(model) at muon_lr, AdamW (model.configure_optimizers) for every other parameter at
    learning_rate. Muon's update is scaled to AdamW's RMS ("match_rms_adamw", Moonshot's recipe), so AdamW's
    learning rates and weight decay carry over as starting points; its Newton-Schulz runs in orthogonalize_dtype."""
    matrices = muon_parameters(model)
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    muon = Muon(matrices, lr=muon_lr, momentum=momentum, weight_decay=weight_decay,
                adjust_lr_fn="match_rms_adamw", orthogonalize_dtype=orthogonalize_dtype)
    return [muon, model.configure_optimizers(weight_decay, learning_rate, betas, device_type, params=rest)]
