"""
One-file GPT-2 with a switch for the attention implementation and one for vocab padding.

    from model import GPT, GPTConfig
    model = GPT(GPTConfig(attn="flash", pad_vocab=True))
    model = GPT.from_pretrained("gpt2", attn="sdpa")          # or a local Hugging Face directory (hf.py)

Every implementation in ATTENTION computes the same causal attention; they differ only in which kernel
PyTorch runs. `attention_problem` is the one place that decides whether an implementation can run here.
"""

import dataclasses
import functools
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from errors import UserError


# -----------------------------------------------------------------------------
# attention implementations: same signature, same function, different kernels
#   q: (B, nh, Tq, hs), k and v: (B, nh, Tk, hs) -> (B, nh, Tq, hs)
#   causal_mask: (Tq, Tk) bool, True where attention is allowed, or None when no mask is needed
#   (a single query attending to a KV cache sees every cached position).

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], float], torch.Tensor]


def manual_attention(q, k, v, causal_mask, dropout_p):
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, Tq, Tk)
    if causal_mask is not None:
        att = att.masked_fill(~causal_mask, float("-inf"))
    att = F.softmax(att, dim=-1)
    att = F.dropout(att, p=dropout_p, training=dropout_p > 0)
    return att @ v


def sdpa_mask_attention(q, k, v, causal_mask, dropout_p):
    # An explicit mask is what pushes CUDA off the fused kernels and onto the generic one.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask, dropout_p=dropout_p)


def sdpa_attention(q, k, v, causal_mask, dropout_p):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal_mask is not None)


def _forced_backend(backend: SDPBackend) -> AttentionFn:
    def attention(q, k, v, causal_mask, dropout_p):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal_mask is not None)
    attention.__name__ = f"{backend.name.lower()}_attention"
    return attention


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


_block_masks: dict = {}


def _causal_block_mask(q_len: int, kv_len: int, device: torch.device):
    # Building a block mask costs milliseconds; one per shape and device is enough.
    key = (q_len, kv_len, str(device))
    if key not in _block_masks:
        _block_masks[key] = create_block_mask(_causal, None, None, q_len, kv_len, device=device)
    return _block_masks[key]


@functools.cache
def _compiled_flex_attention():
    # FlexAttention is meant to be compiled: eager, it is PyTorch's unfused reference (the T x T scores in memory)
    return torch.compile(flex_attention)


def flex_causal_attention(q, k, v, causal_mask, dropout_p):
    if dropout_p > 0:
        raise UserError("attn='flex' has no attention dropout; set dropout=0.0 or pick another attn.")
    block_mask = None if causal_mask is None else _causal_block_mask(q.size(-2), k.size(-2), q.device)
    # On CUDA always compiled (inside a compiled model dynamo traces flex_attention itself). On CPU only inside
    # a compiled model (compile=True): compiling costs seconds per shape, and CPU flex is inference-only anyway.
    compiled = q.is_cuda and not torch.compiler.is_compiling()
    return (_compiled_flex_attention() if compiled else flex_attention)(q, k, v, block_mask=block_mask)


ATTENTION: dict[str, AttentionFn] = {
    "manual": manual_attention,
    "sdpa_mask": sdpa_mask_attention,
    "sdpa": sdpa_attention,
    "flash": _forced_backend(SDPBackend.FLASH_ATTENTION),
    "efficient": _forced_backend(SDPBackend.EFFICIENT_ATTENTION),
    "cudnn": _forced_backend(SDPBackend.CUDNN_ATTENTION),
    "math": _forced_backend(SDPBackend.MATH),
    "flex": flex_causal_attention,
}


def attention_names(spec) -> list[str]:
    """'all', or a comma list such as 'manual,flash' (a list or tuple too), as checked ATTENTION keys, each once."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = list(ATTENTION) if [s.strip() for s in items] == ["all"] else [s.strip() for s in items if s.strip()]
    unknown = [n for n in names if n not in ATTENTION]
    if unknown or not names:
        raise UserError(f"unknown attn {', '.join(map(repr, unknown)) or '(none given)'}; "
                        f"use all or a comma-separated list of {', '.join(ATTENTION)}.")
    return list(dict.fromkeys(names))


@functools.lru_cache(maxsize=None)
def attention_problem(attn: str, device_type: str, dtype: torch.dtype, dropout_p: float, head_size: int,
                      needs_grad: bool, seq_len: int = 64) -> Optional[str]:
    """None if `attn` runs here, else why not: we ask PyTorch by running it once, because which kernel accepts
    which device/dtype/dropout/head size/layout changes from release to release."""
    cpu = device_type == "cpu"
    if attn in ("efficient", "cudnn") and device_type != "cuda":
        return f"the {'memory-efficient' if attn == 'efficient' else 'cuDNN'} kernel is CUDA-only"
    if attn == "flex" and dropout_p > 0:
        return "FlexAttention has no attention dropout"
    if attn == "flex" and cpu and needs_grad:
        return "FlexAttention has no backward pass on CPU"
    if attn == "flash" and cpu and dropout_p > 0:
        return "the CPU flash kernel does not support dropout"
    # fork_rng: the probe must not move the RNG that dropout and resumed runs depend on
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device_type == "cuda" else []):
        return _probe(attn, device_type, dtype, dropout_p, head_size, needs_grad, seq_len)


def _probe(attn: str, device_type: str, dtype: torch.dtype, dropout_p: float, head_size: int,
           needs_grad: bool, seq_len: int) -> Optional[str]:
    """Run `attn` on what the model really passes it: q, k, v as strided views of one projection at the full
    sequence length (with backward when training), and for inference also a one-query decode step against a
    slice of a longer KV cache. Kernels' limits differ between these layouts."""
    T = seq_len
    qkv = torch.randn(1, T, 3 * head_size, device=device_type, dtype=dtype, requires_grad=needs_grad)
    q, k, v = (t.view(1, T, 1, head_size).transpose(1, 2) for t in qkv.split(head_size, dim=2))  # (1, 1, T, hs)
    mask = torch.ones(T, T, dtype=torch.bool, device=device_type).tril()  # (T, T)
    try:
        with warnings.catch_warnings(record=True) as caught:  # PyTorch explains kernel refusals as warnings
            warnings.simplefilter("always")
            y = ATTENTION[attn](q, k, v, mask, dropout_p)
            if needs_grad:
                y.sum().backward()
            else:
                cache = torch.randn(2, 1, T + 8, head_size, device=device_type, dtype=dtype)  # (k|v, 1, T + 8, hs)
                ATTENTION[attn](q[:, :, -1:], cache[:1, :, :T], cache[1:, :, :T], None, 0.0)
    except (RuntimeError, NotImplementedError) as e:
        # CUDA warns a header ("Flash attention kernel not used because:") and then the reason itself
        reasons = [line for w in caught for line in str(w.message).splitlines()[:1] if not line.endswith("because:")]
        reasons = reasons or [str(e).splitlines()[0]]
        return f"PyTorch has no kernel for it ({reasons[0].rstrip('.')})"
    return None


def check_attention(attn: str, device_type: str, dtype: torch.dtype, dropout_p: float, head_size: int,
                    needs_grad: bool, seq_len: int = 64, problem: Optional[str] = None) -> None:
    """Raise UserError, naming what can run instead, if `attn` cannot run with these settings (or if the
    caller already knows the `problem`, say a kernel that refused a real call)."""
    problem = problem or attention_problem(attn, device_type, dtype, dropout_p, head_size, needs_grad, seq_len)
    if problem is None:
        return
    runnable = [a for a in ATTENTION if a != attn and
                attention_problem(a, device_type, dtype, dropout_p, head_size, needs_grad, seq_len) is None]
    dtype_name = str(dtype).removeprefix("torch.")
    mode = "training" if needs_grad else "inference"
    raise UserError(f"attn='{attn}' cannot run for {mode} on {device_type} in {dtype_name} with dropout={dropout_p} "
                    f"and head size {head_size}: {problem}; use one of {', '.join(runnable)}.")


# -----------------------------------------------------------------------------
# the model

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257   # the tokenizer's vocabulary; the embedding may be padded beyond it
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True         # biases in Linear and LayerNorm, as GPT-2
    attn: str = "sdpa"        # a key of ATTENTION
    pad_vocab: bool = False   # round the embedding/lm_head up to a multiple of 64 (50257 -> 50304)
    gelu: str = "tanh"        # GPT-2's GELU is the tanh approximation; "none" is the exact erf GELU

    def __post_init__(self):
        if self.attn not in ATTENTION:
            raise UserError(f"unknown attn '{self.attn}'; choose one of {', '.join(ATTENTION)}.")
        if self.n_embd % self.n_head != 0:
            raise UserError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                            f"pick sizes where n_embd is a multiple of n_head.")
        if self.gelu not in ("tanh", "none"):
            raise UserError(f"gelu must be 'tanh' or 'none', got '{self.gelu}'.")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout}.")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)}.")

    @classmethod
    def from_settings(cls, settings: dict) -> "GPTConfig":
        """The config a script's settings name (n_layer, n_embd, attn, pad_vocab, ...; other keys are ignored)."""
        return cls(**{f.name: settings[f.name] for f in dataclasses.fields(cls) if f.name in settings})

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / 64) * 64 if self.pad_vocab else self.vocab_size


class KVCache:
    """Keys and values of every layer for positions [0, length), preallocated up to block_size."""

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype):
        shape = (batch_size, config.n_head, config.block_size, config.head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store this step's k, v (B, nh, T, hs) after the cached ones; return all of them."""
        end = self.length + k.size(2)
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.layer = config.n_head, config.n_embd, layer
        self.set_attention(config.attn)
        # not persistent: it is derived, so neither checkpoints nor DDP's broadcast need to carry it
        causal = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", causal, persistent=False)

    def set_attention(self, attn: str) -> None:
        self.attn_name = attn                # a key of ATTENTION, for checks and messages
        self.attention = ATTENTION[attn]     # the function that computes it

    def forward(self, x: torch.Tensor, kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        B, T, C = x.size()
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.attn_dropout if self.training else 0.0
        block_size = self.causal_mask.size(0)
        if not torch.compiler.is_compiling():  # compiled code was checked when it was traced
            check_attention(self.attn_name, q.device.type, q.dtype, dropout_p, hs, q.requires_grad, block_size)
        start = 0
        if kv_cache is not None:
            start = kv_cache.length
            k, v = kv_cache.update(self.layer, k, v)  # (B, nh, start + T, hs)
        if T == 1:
            mask = None  # one new query sees every position before it
        elif start == 0:
            mask = self.causal_mask[:T, :T]
        else:
            raise ValueError("a KV cache is filled by one prefill from position 0, then one position per step")
        try:
            y = self.attention(q, k, v, mask, dropout_p)  # (B, nh, T, hs)
        except RuntimeError as e:  # a kernel refusing a shape or layout the probe did not meet
            if torch.compiler.is_compiling() or "No available kernel" not in str(e):
                raise
            check_attention(self.attn_name, q.device.type, q.dtype, dropout_p, hs, q.requires_grad, block_size,
                            problem=f"PyTorch refused q of shape {tuple(q.shape)} at run time")
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

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache: Optional[KVCache] = None):
        x = x + self.attn(self.ln_1(x), kv_cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
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
        """Parameter count; the position embedding is left out by default (the token embedding is tied to
        lm_head, so it counts as compute)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, all_positions: bool = False):
        """idx (B, T) -> logits over the padded vocabulary, padded ids at -inf.
        With targets: (B, T, V) logits and the mean cross-entropy (targets of -1 are ignored).
        Without: logits for the last position only, (B, 1, V), or for every position with all_positions."""
        B, T = idx.size()
        start = kv_cache.length if kv_cache is not None else 0
        if start + T > self.config.block_size:
            raise UserError(f"cannot forward a sequence of {start + T} tokens: block_size is "
                            f"{self.config.block_size}; crop the input or use a smaller block_size.")
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, kv_cache)
        if kv_cache is not None:
            kv_cache.length += T
        x = self.transformer.ln_f(x)
        if targets is None and not all_positions:
            x = x[:, [-1], :]  # (B, 1, C): only the next token is needed
        padded = self.config.padded_vocab_size > self.config.vocab_size
        logits = F.linear(x, self.lm_head.weight, self.vocab_bias if padded else None)  # (B, T, V)
        if targets is None:
            return logits, None
        # reshape, not view: targets may be any (B, T) tensor, a strided slice such as x[:, 1:] included
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def set_attention(self, attn: str) -> "GPT":
        """Read the same weights through another attention implementation, in place; returns the model."""
        self.config = dataclasses.replace(self.config, attn=attn)  # checks the name
        for block in self.transformer.h:
            block.attn.set_attention(attn)
        return self

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context, e.g. to fine-tune GPT-2 (1024) at a shorter block_size."""
        if block_size > self.config.block_size:
            raise UserError(f"block_size={block_size} is larger than the model's {self.config.block_size}; "
                            f"use at most {self.config.block_size}.")
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        for block in self.transformer.h:
            block.attn.causal_mask = block.attn.causal_mask[:block_size, :block_size]

    # -- optimizer and FLOPs ---------------------------------------------------------------------------

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas, device_type: str):
        """AdamW; weight decay on 2-D tensors (matmul weights, embeddings) only, not on biases and norms."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused or None)

    def flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Training FLOPs (forward + backward) per token, PaLM appendix B: 6N for the matmuls with weights
        plus 12·L·C·T for attention scores and their weighted sum."""
        cfg, T = self.config, seq_len or self.config.block_size
        return 6 * self.get_num_params() + 12 * cfg.n_layer * cfg.n_embd * T

    def estimate_mfu(self, tokens_per_s: float, peak_flops: float, seq_len: Optional[int] = None) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over the device's peak for the dtype in use."""
        return self.flops_per_token(seq_len) * tokens_per_s / peak_flops

    # -- generation -------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 use_cache: bool = True) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T). temperature=0 is greedy.
        The cache holds at most block_size positions; once the text is longer, every step sees the last
        block_size tokens at fresh positions, so the cache is refilled - the same tokens as without it."""
        cache = None
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            if not use_cache:
                logits, _ = self(context)
            # one new position fits after the cached ones, and they are still the text's own positions (once the
            # text outgrows block_size, cropping shifts every position, so the whole context is run again)
            elif cache is not None and cache.length < self.config.block_size and idx.size(1) == cache.length + 1:
                logits, _ = self(idx[:, -1:], kv_cache=cache)
            else:
                cache = KVCache(self.config, idx.size(0), idx.device, self.lm_head.weight.dtype)
                logits, _ = self(context, kv_cache=cache)
            idx = torch.cat((idx, sample_next(logits[:, -1, :], temperature, top_k, generator)), dim=1)
        return idx

    # -- GPT-2 weights ----------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_path: str, **overrides) -> "GPT":
        """GPT-2 weights from a local Hugging Face directory or a hub name ('gpt2', 'gpt2-medium', ...).
        `overrides` may set attn, pad_vocab and dropout. See hf.py."""
        from hf import gpt2_from_hf  # hf.py builds on this module
        return gpt2_from_hf(name_or_path, **overrides)


def sample_next(logits: torch.Tensor, temperature: float, top_k: Optional[int],
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token id per row from logits (B, V) -> (B, 1)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    probs = F.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
