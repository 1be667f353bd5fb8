"""
bench.py's train mode: a model and Trainer shared by the rows of one padding, mask and loss, whether a batch fits,
and the `auto` rows beside the fastest measured row.
"""

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from benchmarks.bench_masks import block_documents, mask_settings, tokens_with_documents
from attention.attn_auto import Workload, choose
from benchmarks.measure import free_memory, out_of_memory, paired_speedup, profiled_run
from core import runtime
from core.configurator import Settings
from core.runtime import Runtime
from engine.trainer import Trainer
from model import IMPLEMENTATIONS, GPT, GPTConfig


@dataclass
class SharedTrainer:
    """One model, its Trainer and one batch, shared by every attn row of one padding, mask and loss (one model's memory,
    not one per row): a row switches the attention and takes real training steps."""
    trainer: Trainer
    compile: bool                        # each attn's forward compiled apart (compiled_forward)
    batch: torch.Tensor                  # (2, B, T): inputs and targets
    docs: Optional[torch.Tensor] = None  # (B, T) the inputs' document ids, with doc_mask
    forwards: dict = field(default_factory=dict)  # attn -> its compiled forward

    @property
    def model(self) -> GPT:
        return self.trainer.model

    def step(self, attn: str) -> None:
        """One training step through `attn`: forward, backward, optimizer step (unclipped)."""
        self.model.set_attention(attn, dtype=self.trainer.rt.torch_dtype)  # asked once per row: then a lookup
        self.trainer.wrapped = self.compiled_forward(attn)
        self.trainer.step([(self.batch[0], self.batch[1])])

    def compiled_forward(self, attn: str) -> Callable:
        """The model's forward for `attn`'s row, compiled apart per attn with a recompile budget of its own (a shared
        one would run the later rows eagerly past its limit), or the model itself."""
        if not self.compile:
            return self.model
        if attn not in self.forwards:
            self.forwards[attn] = runtime.compile_isolated(self.model.forward)
        return self.forwards[attn]

    def eager_pass(self, attn: str) -> None:
        """Forward and backward through the uncompiled model, no update: what the kernel audit profiles."""
        self.model.set_attention(attn, dtype=self.trainer.rt.torch_dtype)
        with self.trainer.rt.autocast():
            _, loss = self.model(*self.batch)
        loss.backward()
        self.model.zero_grad(set_to_none=True)

    def resident_bytes(self) -> int:
        """Tensors that live across steps: weights, buffers, optimizer state, the batch."""
        return self.trainer.resident_bytes() + self.batch.numel() * self.batch.element_size()


def build_trainer(cfg: Settings, rt: Runtime, attn: str, pad_vocab: bool, batch_size: int,
                  mask: str = "causal", loss: str = "chunked") -> SharedTrainer:
    torch.manual_seed(cfg.seed)  # the same weights whatever the row
    doc_mask, window = mask_settings(mask, cfg.window)
    config = GPTConfig.build({**cfg.as_dict(), "block_size": cfg.seq_len, "pad_vocab": pad_vocab},
                             dict(attn=attn, doc_mask=doc_mask, window=window, eot_token=cfg.vocab_size - 1,
                                  chunked_loss=loss == "chunked"))
    model = GPT(config).to(rt.device)
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), rt.device_type)
    batch = torch.randint(cfg.vocab_size, (2, batch_size, cfg.seq_len),
                          generator=torch.Generator().manual_seed(cfg.seed))  # random ids cost as text
    docs = block_documents(cfg.doc_data, cfg.doc_len, batch_size, cfg.seq_len, cfg.seed) if doc_mask else None
    if doc_mask:  # the inputs carry end-of-text where the documents of real blocks begin
        batch[0] = tokens_with_documents(docs, cfg.vocab_size, cfg.vocab_size - 1, cfg.seed)
    return SharedTrainer(Trainer(model, [optimizer], rt.grad_scaler(), rt), cfg.compile, batch.to(rt.device), docs)


def fits(cfg: Settings, rt: Runtime, attn: str, pad_vocab: bool, batch_size: int, mask: str = "causal",
         loss: str = "chunked") -> bool:
    """Whether training at this batch size fits: two full steps (the second carries AdamW's state) without
    running out of memory of any kind; on CPU also resident plus peak step memory within mem_budget_gb."""
    trainer = None
    try:
        trainer = build_trainer(cfg, rt, attn, pad_vocab, batch_size, mask, loss)
        trainer.step(attn)
        if rt.is_cuda:
            trainer.step(attn)
            return True
        _, added = profiled_run(functools.partial(trainer.step, attn), rt)
        return trainer.resident_bytes() + added <= cfg.mem_budget_gb * 1e9
    except Exception as e:
        out_of_memory(e, rt)  # raises anything else
        return False
    finally:
        del trainer  # the model and its memory go before the next probe
        free_memory(rt)


def auto_rows(rows: dict, trainers: dict[tuple, SharedTrainer], cfg: Settings, rt: Runtime) -> list[dict]:
    """One row per (padding, mask, loss) with a measured row: the pick's measurements, not timed again, labelled auto,
    with `auto_pick`, `same_as` (the row whose timing it repeats), `fastest`, `pick_vs_fastest` (the pick's time over
    the fastest's, paired) and `within_noise`."""
    out = []
    for (pad, mask, loss), trainer in trainers.items():
        ran = {r["attn"]: r for r in rows.values()
               if (r["pad_vocab"], r["mask"], r["loss"]) == (pad, mask, loss) and r["status"] == "ok"}
        if not ran:
            continue
        workload = Workload.of(trainer.model.config, rt, cfg.batch_size, cfg.seq_len, training=True,
                               compiled=cfg.compile)
        decision = choose(workload, rt, IMPLEMENTATIONS, cfg.attn_auto_budget, cfg.attn_auto_refresh)
        fastest = min(ran.values(), key=lambda r: r["ms_per_iter"])
        if decision.pick not in ran:  # picked one the sweep did not run (--attn named others)
            out.append(dict(attn="auto", pad_vocab=pad, vocab=trainer.model.config.padded_vocab_size, mask=mask,
                            loss=loss, status="skipped", auto_pick=decision.pick, eager_reference=False,
                            reason=f"auto picked {decision.pick}, which this sweep did not run"))
            continue
        pick = ran[decision.pick]
        overlap = pick["ms_p25"] <= fastest["ms_p75"] and fastest["ms_p25"] <= pick["ms_p75"]
        out.append({**pick, "attn": "auto", "auto_pick": decision.pick, "same_as": decision.pick,
                    "auto_line": decision.line(),
                    "fastest": fastest["attn"], "pick_vs_fastest": 1 / paired_speedup(fastest, pick),
                    "within_noise": decision.pick == fastest["attn"] or overlap})
    return out
