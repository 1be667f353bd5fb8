"""
One-file GPT-2 with a switch for the attention implementation and one for vocab padding.

    from model import GPT, GPTConfig
    model = GPT(GPTConfig(attn="flash", pad_vocab=True))
    logits, loss = model(idx, targets)
"""

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.nn import functional as F

import masks
from attention import IMPLEMENTATIONS, AttnCall, Implementation, check_attention, doc_window_mask
from core.errors import UserError


# -----------------------------------------------------------------------------
# the model

# What a run may choose for weights trained otherwise: the attention implementation, its masks and dropout.
RUN_FIELDS = ("attn", "dropout", "doc_mask", "window", "eot_token", "chunked_loss")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257   # the tokenizer's vocabulary; the embedding may be padded beyond it
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True         # biases in Linear and LayerNorm, as GPT-2
    attn: str = "sdpa"        # a key of IMPLEMENTATIONS
    pad_vocab: bool = False   # round the embedding/lm_head up to a multiple of 64 (50257 -> 50304)
    gelu: str = "tanh"        # GPT-2's GELU is the tanh approximation; "none" is the exact erf GELU
    doc_mask: bool = False    # attend within a document only: end-of-text (eot_token) opens the next one
    window: int = 0           # attend to at most the last `window` tokens (itself included); 0: no limit
    eot_token: int = -1       # the dataset's end-of-text id (-1: it has none), what doc_mask splits on
    chunked_loss: bool = False  # with targets: lm_head and the loss over row chunks, logits None (train.py's)

    def __post_init__(self):
        if self.attn == "auto":
            raise UserError("attn='auto' is measured on a model, not stored in a config: build it with another attn "
                            "(say 'sdpa'), then call model.set_attention('auto').")
        if self.attn not in IMPLEMENTATIONS:
            raise UserError(f"unknown attn '{self.attn}'; choose one of {', '.join(IMPLEMENTATIONS)}.")
        if self.n_embd % self.n_head != 0:
            raise UserError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                            f"pick sizes where n_embd is a multiple of n_head.")
        if self.gelu not in ("tanh", "none"):
            raise UserError(f"gelu must be 'tanh' or 'none', got '{self.gelu}'.")
        if self.doc_mask and not 0 <= self.eot_token < self.vocab_size:
            raise UserError(f"doc_mask needs the end-of-text token that separates documents, and eot_token="
                            f"{self.eot_token} is not a token of the {self.vocab_size}-token vocabulary; use a dataset "
                            f"whose meta.json names one (shakespeare, openwebtext) or doc_mask=False.")
        if self.window < 0:
            raise UserError(f"window must be 0 (no limit) or a positive number of tokens, got {self.window}.")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout}.")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)}.")

    @classmethod
    def build(cls, shape: dict, run: dict) -> "GPTConfig":
        """The one way a config is made (scratch, a checkpoint, Hugging Face's or nanoGPT's files): `shape`, what the
        weights fix (keys that are not fields are ignored), then `run`, what this run chooses (RUN_FIELDS)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"chunked_loss"}  # the caller's, never the weights'
        return cls(**{**{k: v for k, v in shape.items() if k in names},
                      **{k: v for k, v in run.items() if k in RUN_FIELDS}})

    @property
    def masked(self) -> bool:
        """Whether attention is narrower than causal: documents, a window, or both."""
        return self.doc_mask or self.window > 0

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / 64) * 64 if self.pad_vocab else self.vocab_size


# rows of logits per chunk: 2^26 fp32 elements (256 MB; 1334 rows of GPT-2's padded 50304, so 7 chunks for a step
# of 8,192 tokens): small beside the whole logits, and few chunks, since each adds lm_head's weight gradient once
LOSS_CHUNK_ELEMENTS = 2 ** 26


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """F.cross_entropy(x @ weight.T + bias, targets, ignore_index=-1), never holding the whole (N, V) logits: with
    gradients through ChunkedLMHeadLoss, without them (evaluation) one chunk's loss at a time. x (N, C), targets
    (N,); matmuls in `dtype`, sums in fp32."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return ChunkedLMHeadLoss.apply(x, weight, bias, targets, dtype)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    with torch.autocast(x.device.type, enabled=False):  # the matmuls in exactly `dtype`
        for _, _, ts, log_probs in chunk_log_probs(x, weight.to(dtype), bias, targets):
            loss += F.nll_loss(log_probs, ts, ignore_index=-1, reduction="sum")
    return loss / (targets != -1).sum()


def chunk_log_probs(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor):
    """(start, x's rows in w's dtype, their targets, their (n, V) fp32 log-softmax) for each chunk of rows (callers
    turn autocast off). F.nll_loss over it ignores and refuses targets as F.cross_entropy(ignore_index=-1) does."""
    rows = max(1, LOSS_CHUNK_ELEMENTS // w.size(0))
    for start in range(0, x.size(0), rows):
        xs = x[start:start + rows].to(w.dtype)
        logits = (xs @ w.t()).float()  # (n, V)
        if bias is not None:
            logits += bias
        log_probs = torch.log_softmax(logits, dim=-1)  # (n, V)
        del logits  # not held while the caller works on this chunk
        yield start, xs, targets[start:start + rows], log_probs


class ChunkedLMHeadLoss(torch.autograd.Function):
    """lm_head and the mean cross-entropy, a chunk of rows at a time: each chunk's logits give its loss and at once
    its gradients (softmax minus one-hot), which backward only scales, so the (N, V) logits never exist whole and
    nothing is recomputed."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, dtype: torch.dtype):  # x (N, C), weight (V, C), targets (N,)
        valid = targets != -1
        count = valid.sum()
        w = weight.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with torch.autocast(x.device.type, enabled=False):  # the matmuls in exactly `dtype`
            for start, xs, ts, log_probs in chunk_log_probs(x, w, bias, targets):
                loss += F.nll_loss(log_probs, ts, ignore_index=-1, reduction="sum")  # checks the targets
                hit = valid[start:start + len(ts)]  # (n,)
                ids = ts.masked_fill(~hit, 0)[:, None]  # (n, 1)
                # d(the chunk's summed loss)/d(logits): softmax minus one-hot, in place; ignored rows add nothing
                minus_one = torch.full_like(ids, -1, dtype=log_probs.dtype)
                grad = log_probs.exp_().scatter_add_(1, ids, minus_one).mul_(hit[:, None]).to(dtype)
                grad_x[start:start + len(ts)] = grad @ w
                grad_weight += grad.t() @ xs  # bf16/fp16 products summed over chunks in fp32
        ctx.save_for_backward(grad_x, grad_weight.to(weight.dtype), count)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count.clamp(min=1)  # nothing counted: the saved gradients are zeros, and stay so
        return grad_x * scale.to(grad_x.dtype), grad_weight * scale.to(grad_weight.dtype), None, None, None


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig, layer: int, impl: Implementation):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.layer = config.n_head, config.n_embd, layer
        self.impl = impl  # resolved once by GPT (set_attention), shared by every layer

    def forward(self, x: torch.Tensor, mask=None, cache: Optional["KVCache"] = None,
                input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, T, C), attended causally within `mask`; with a cache, k and v are written at input_pos too, and a
        decode step (T == 1) attends over the cache."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            cached_k, cached_v = cache.update(self.layer, input_pos, k, v)  # (B, nh, block_size, hs)
            k, v = (cached_k, cached_v) if T == 1 else (k, v)
        dropout_p = self.attn_dropout if self.training else 0.0
        y = self.impl(q, k, v, mask, dropout_p, self.training)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config: GPTConfig, layer: int, impl: Implementation):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer, impl)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, mask=None, cache: Optional["KVCache"] = None, input_pos: Optional[torch.Tensor] = None):
        x = x + self.attn(self.ln_1(x), mask, cache, input_pos)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.impl = Implementation(config.attn, config.block_size)  # checked at every first call (and set_attention)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, layer, self.impl) for layer in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        # Padded ids are not words: a -inf logit bias keeps them out of the softmax, so the loss is over the real
        # vocabulary only (identical to an unpadded model's) and sampling can never pick them. As lm_head's bias
        # it rides in the matmul's epilogue; a separate masked_fill would cost a full pass over the logits.
        is_padding = torch.arange(config.padded_vocab_size) >= config.vocab_size
        self.register_buffer("vocab_bias", torch.zeros(is_padding.shape).masked_fill(is_padding, float("-inf")),
                             persistent=False)
        self.cache: Optional["KVCache"] = None  # decode state (decode.KVCache), made by setup_cache
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled residual projections, GPT-2 paper
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position embedding (wte, tied to lm_head, counts as compute)."""
        return sum(p.numel() for p in self.parameters()) - (self.transformer.wpe.weight.numel() if non_embedding else 0)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                input_pos: Optional[torch.Tensor] = None, all_positions: bool = False):
        """idx (B, T) -> logits over the padded vocabulary, padded ids at -inf. With targets: (B, T, V) logits and
        the mean cross-entropy (targets of -1 are ignored), as nanoGPT's; with config.chunked_loss, None and the
        same loss, the logits never whole (chunked_cross_entropy). Without: the last position's, (B, 1, V), or every
        position's with all_positions. With input_pos (T,), after setup_cache: idx's positions, written to the KV
        cache: a prefill (T tokens from position 0) or one token at any position."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise UserError(f"cannot forward a sequence of {T} tokens: block_size is "
                            f"{self.config.block_size}; crop the input or use a smaller block_size.")
        pos = torch.arange(T, dtype=torch.long, device=idx.device) if input_pos is None else input_pos  # (T,)
        if input_pos is not None and self.cache is None:
            raise ValueError("input_pos needs a KV cache: call model.setup_cache(batch_size) first")
        cache = None if input_pos is None else self.cache.checked(T, input_pos)  # what this call writes to
        mask = self._attention_mask(idx, cache, input_pos)  # one for every layer
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, mask, cache, input_pos)
        x = self.transformer.ln_f(x)
        if targets is None and not all_positions:
            x = x[:, [-1], :]  # (B, 1, C): only the next token is needed
        padded = self.config.padded_vocab_size > self.config.vocab_size
        bias = self.vocab_bias if padded else None
        if targets is not None and self.config.chunked_loss and not all_positions:  # the logits never whole
            loss = chunked_cross_entropy(x.reshape(-1, x.size(-1)), self.lm_head.weight, bias, targets.reshape(-1),
                                         self.compute_dtype())  # (B*T, C) rows
            return None, loss
        logits = F.linear(x, self.lm_head.weight, bias)  # (B, T, V)
        if targets is None:
            return logits, None
        # reshape, not view: targets may be any (B, T) tensor, a strided slice such as x[:, 1:] included
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def _attention_mask(self, idx: torch.Tensor, cache: Optional["KVCache"], input_pos: Optional[torch.Tensor]):
        """The mask every layer takes beyond causality: for training and a prefill, None (causal) or the documents'
        and window's mask in the implementation's form; for a decode step, the cache positions it sees."""
        if cache is not None and idx.size(1) == 1:
            return cache.step(idx, input_pos)
        if cache is not None:
            cache.prefill(idx)
        config = self.config
        if not config.masked:
            return None
        docs = masks.document_ids(idx, config.eot_token) if config.doc_mask else None  # (B, T)
        return doc_window_mask(config.attn, docs, config.window, idx.size(0), idx.size(1), idx.device)

    def setup_cache(self, batch_size: int, dtype: Optional[torch.dtype] = None) -> None:
        """A KV cache (all the state decoding keeps) for batch_size sequences, in the keys' `dtype`."""
        from decode import KVCache  # generation's own state: training never makes one
        weight = self.transformer.wpe.weight
        self.cache = KVCache(self.config, batch_size, weight.device, dtype or weight.dtype)

    def clear_cache(self) -> None:  # and its buffers with it
        self.cache = None

    def cache_bytes(self) -> int:
        """Memory held by the KV cache (0 without one), doc_mask's document starts included."""
        return self.cache.nbytes() if self.cache is not None else 0

    def compute_dtype(self) -> torch.dtype:
        """Autocast's dtype when autocast is on for the model's device, else the weights'."""
        weight = self.transformer.wpe.weight  # never quantized (int8 weights report their own dtype)
        device = weight.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype

    def set_attention(self, attn: str, training: Optional[bool] = None, dtype: Optional[torch.dtype] = None,
                      check: bool = True) -> "GPT":
        """Read the same weights through another attention implementation, in place; returns the model. Checked on
        the model's device, in its mode (or `training`) and compute dtype (or `dtype`); check=False: the caller asked
        attention_problem itself. attn='auto': the fastest correct one on this model's shapes, measured."""
        training = self.training if training is None else training
        dtype = dtype or self.compute_dtype()
        if attn == "auto":  # the fastest here, measured for this model, `training` and `dtype` (attn_auto.py)
            from attn_auto import choose_for_model
            attn = choose_for_model(self, training, dtype)
        config, device = dataclasses.replace(self.config, attn=attn), self.transformer.wpe.weight.device.type
        if check:
            check_attention(attn, AttnCall(device, dtype, config.head_size, needs_grad=training,
                                           dropout_p=config.dropout if training else 0.0, seq_len=config.block_size,
                                           masked=config.masked))
        self.config, self.impl = config, Implementation(attn, config.block_size)
        for block in self.transformer.h:
            block.attn.impl = self.impl
        return self

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context, e.g. to fine-tune GPT-2 (1024) at a shorter block_size."""
        if block_size > self.config.block_size:
            raise UserError(f"block_size={block_size} is larger than the model's {self.config.block_size}; "
                            f"use at most {self.config.block_size}.")
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        self.clear_cache()

    # -- optimizer and FLOPs ---------------------------------------------------------------------------

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas, device_type: str,
                             params: Optional[list] = None) -> torch.optim.AdamW:
        """AdamW; weight decay on 2-D tensors (matmul weights, embeddings) only, not on biases and norms.
        `params`: a subset of the parameters (what Muon leaves to AdamW); all of them by default."""
        params = [p for p in (self.parameters() if params is None else params) if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused or None)

    def flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Training FLOPs per token (PaLM appendix B): 6N for the weights' matmuls, 12·L·C·T for attention's."""
        cfg, T = self.config, seq_len or self.config.block_size
        return 6 * self.get_num_params() + 12 * cfg.n_layer * cfg.n_embd * T

    def model_flops_utilization(self, tokens_per_s: float, peak_flops: float, seq_len: Optional[int] = None) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over the device's peak for the dtype in use."""
        return self.flops_per_token(seq_len) * tokens_per_s / peak_flops

    # -- nanoGPT's API: its signatures and meanings --------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_type: str, override_args: Optional[dict] = None) -> "GPT":
        """GPT-2's weights: a nanoGPT name (gpt2 ... gpt2-xl, from the Hugging Face hub) or a local Hugging Face
        directory. override_args may set dropout, as nanoGPT's does, and attn, pad_vocab and the masks."""
        from core import hf  # Hugging Face's format: read only here
        overrides = dict(override_args or {})
        if set(overrides) - hf.OVERRIDES:
            raise UserError(f"from_pretrained can only override {sorted(hf.OVERRIDES)}, got {sorted(overrides)}.")
        shape, state_dict = hf.read_gpt2(model_type)
        config = GPTConfig.build({**shape, "pad_vocab": overrides.pop("pad_vocab", False)}, overrides)
        model = cls(config)
        model.load_state_dict(hf.convert_hf_state_dict(state_dict, config.vocab_size, config.padded_vocab_size))
        return model

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None) -> torch.Tensor:
        """nanoGPT's: idx (B, T) with max_new_tokens tokens appended, drawn with torch's global RNG (temperature 0:
        greedy), over a KV cache. The model stays in its mode: call model.eval() first, as with nanoGPT."""
        from decode import decode_tokens  # the one generation loop, beside the KV cache
        had_cache = self.cache_bytes() > 0
        try:
            return decode_tokens(self, idx, max_new_tokens, temperature, top_k)
        finally:
            if not had_cache:  # nanoGPT's generate leaves no state behind: free the cache it made, and its buffers
                self.clear_cache()

    def estimate_mfu(self, fwdbwd_per_iter: float, dt: float, peak_flops: float = 312e12) -> float:
        """nanoGPT's MFU: the fraction of an A100's bf16 peak (or `peak_flops`) reached by an iteration of
        fwdbwd_per_iter sequences of block_size tokens in dt seconds."""
        return self.model_flops_utilization(fwdbwd_per_iter * self.config.block_size / dt, peak_flops)
