"""
The training step for train.py and bench.py alike, its optimizers (AdamW, or Muon and AdamW) and their schedule.

    trainer = Trainer(model, make_optimizers(model, cfg, rt), rt.grad_scaler(), rt, grad_clip=1.0)
    loss = trainer.step([(x, y), (x2, y2)])   # one optimizer step over two micro-batches; the loss stays on device
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from core.configurator import Settings
from core.runtime import Runtime
from model import GPT


def lr_multiplier(it: int, cfg: Settings) -> float:
    """The schedule as a fraction of each group's peak: linear warmup, cosine to min_lr / learning_rate by
    lr_decay_iters, then that floor; with early_decay_iters, a first cosine to early_decay_to there."""
    floor = cfg.min_lr / cfg.learning_rate
    if not cfg.decay_lr:
        return 1.0
    if it < cfg.warmup_iters:
        return (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return floor
    if cfg.warmup_iters < cfg.early_decay_iters < cfg.lr_decay_iters:
        if it <= cfg.early_decay_iters:
            return cosine((it - cfg.warmup_iters) / (cfg.early_decay_iters - cfg.warmup_iters), 1.0, cfg.early_decay_to)
        return cosine((it - cfg.early_decay_iters) / (cfg.lr_decay_iters - cfg.early_decay_iters), cfg.early_decay_to,
                      floor)
    return cosine((it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters), 1.0, floor)


def cosine(fraction: float, start: float, end: float) -> float:
    """From start (fraction 0) to end (fraction 1) along half a cosine."""
    return end + 0.5 * (1.0 + math.cos(math.pi * fraction)) * (start - end)


def make_optimizers(model: GPT, cfg: Settings, rt: Runtime) -> list:
    """AdamW, or Muon and AdamW (a resume's: its checkpoint's, checked in engine/resume.py); each group's
    peak rate is kept as `initial_lr`, which the schedule scales."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":
        optimizers = [model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas, rt.device_type)]
    else:
        from engine.muon import muon_optimizers  # only a Muon run reads the optimizer's code
        optimizers = muon_optimizers(model, cfg.weight_decay, cfg.learning_rate, cfg.muon_lr or cfg.learning_rate,
                                     cfg.muon_momentum, betas, rt.device_type, rt.orthogonalize_dtype)
    for group in (g for optimizer in optimizers for g in optimizer.param_groups):
        group["initial_lr"] = group["lr"]
    return optimizers


def set_learning_rates(optimizers: list, multiplier: float) -> None:  # each group's own peak x the schedule
    for group in (g for optimizer in optimizers for g in optimizer.param_groups):
        group["lr"] = group["initial_lr"] * multiplier


def gradient_sync(model: torch.nn.Module, sync: bool):
    """Gradient accumulation: reduce gradients across ranks only on the last micro-step."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    elif hasattr(model, "no_sync") and not sync:  # DDP
        return model.no_sync()
    return nullcontext()


@dataclass
class Trainer:
    """One model's training step: forward and backward per micro-batch (reduced across ranks on the last), gradients
    unscaled and clipped, each optimizer stepped, gradients dropped. Nothing is read back from the device but fp16's
    GradScaler overflow check."""
    model: GPT                               # the weights: what checkpoints, set_attention and MFU read
    optimizers: list[torch.optim.Optimizer]  # AdamW; or Muon and AdamW
    scaler: torch.amp.GradScaler
    rt: Runtime
    grad_clip: float = 0.0
    wrapped: Optional[Callable] = None       # what runs the step (compiled, DDP- or FSDP-wrapped); None: the model

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over micro-batches (x, y), (B, T) each; returns their mean loss, on the device. The next
        micro-batch's copy is queued behind the forward, from pinned memory."""
        forward, n = self.model if self.wrapped is None else self.wrapped, len(micro_batches)
        loss_sum = torch.zeros((), device=self.rt.device)
        x, y = self.rt.to_device(*micro_batches[0])
        for micro in range(n):
            with gradient_sync(forward, sync=micro == n - 1):
                with self.rt.autocast():
                    _, loss = forward(x, y)
                if micro + 1 < n:
                    x, y = self.rt.to_device(*micro_batches[micro + 1])
                self.scaler.scale(loss / n).backward()
            loss_sum += loss.detach()
        if self.grad_clip > 0:
            for optimizer in self.optimizers:
                self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        for optimizer in self.optimizers:
            self.scaler.step(optimizer)
        self.scaler.update()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return loss_sum / n

    def resident_bytes(self) -> int:
        """Tensors that live across steps: weights, buffers, optimizer state."""
        state = [t for o in self.optimizers for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers(), *state])
