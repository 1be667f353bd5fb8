"""
One-file GPT-2 with a switch for the attention implementation and one for vocab padding.

    from model import GPT, GPTConfig
    model = GPT(GPTConfig(attn="flash", pad_vocab=True))
    logits, loss = model(idx, targets)
"""

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


# model.py copied by itself into another project trains and generates with manual, sdpa_mask, sdpa and flash, and
# from_pretrained reads GPT-2 through transformers; the rest (the kernel probe and its error line, documents and
# windows, flex, varlen, attn=auto) needs the repository
IN_REPOSITORY = (Path(__file__).resolve().parent / "attention" / "kernels.py").is_file()


def user_error(message: str) -> Exception:  # a setting to fix: the scripts print it as one `error:` line
    if not IN_REPOSITORY:
        return ValueError(message)
    from core.errors import UserError
    return UserError(message)


def needs_repository(feature: str) -> None:
    if not IN_REPOSITORY:
        raise user_error(f"{feature} needs the rest of the nanoGPT-attn repository (attention/, core/), which model.py "
                         f"copied by itself does not have; copy the whole repository, or do without {feature}.")


# -----------------------------------------------------------------------------
# attention: one function per implementation, one signature for all
#   q (B, nh, Tq, hs), k and v (B, nh, Tk, hs), mask, dropout_p -> (B, nh, Tq, hs)
# mask None is causal, aligned to the end (query i sees keys 0 .. i + Tk - Tq); with documents or a window it is
# their mask in the implementation's layout (Attention.mask, attention/masks.py); for a decode step, a row over the keys
# it reads (bool or additive), or for flex a score mod.

def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """(q_len, kv_len) bool, True where query i may see key j: j <= i + kv_len - q_len."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def manual_attention(q, k, v, mask, dropout_p):
    # nanoGPT's: the scores, masked, softmaxed, then the weighted values
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, Tq, Tk)
    if mask is None:
        mask = causal_mask(q.size(-2), k.size(-2), q.device)
    att = att.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else att + mask  # bool, or additive
    att = F.softmax(att, dim=-1)
    att = F.dropout(att, p=dropout_p, training=dropout_p > 0)
    return att @ v


def sdpa_mask_attention(q, k, v, mask, dropout_p):
    # an explicit mask: CUDA's flash kernel takes none, so SDPA picks another (cuDNN's on Hopper, else the efficient
    # or the math kernel)
    if mask is None:
        mask = causal_mask(q.size(-2), k.size(-2), q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def sdpa_attention(q, k, v, mask, dropout_p):
    # is_causal is aligned to the start (top-left) in PyTorch; without a mask the model only passes square problems
    # or a single query, where start and end alignment agree
    is_causal = False
    if mask is None and q.size(-2) > 1:  # a branch, not a flag: a concrete bool even when the length is dynamic
        is_causal = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


def forced(backend: SDPBackend):
    """SDPA with one backend forced (efficient, cudnn, math): PyTorch's error where that kernel refuses."""
    def attention(q, k, v, mask, dropout_p):
        # cuDNN refuses a key length of 1, which the first step of cache-free generation from a one-token prompt
        # asks for; the one key visible then takes all the weight, so its value is the exact answer
        # (docs/torch_versions.md)
        if backend == SDPBackend.CUDNN_ATTENTION and k.size(-2) == 1 and mask is None and dropout_p == 0.0:
            return v  # (B, nh, 1, hs)
        with sdpa_kernel(backend):
            return sdpa_attention(q, k, v, mask, dropout_p)
    return attention


FLASH_KERNELS: dict = {}  # device type -> `flash`'s SDPA backends, first choice first (flash_kernels fills it)


def flash_kernels(device: torch.device) -> tuple:
    """The kernels attn='flash' runs on `device`, first choice first: cuDNN's flash kernel, then FlashAttention-2 for
    what it refuses, where attention/cuda.py's cudnn_first holds (Hopper, Blackwell); elsewhere FlashAttention-2
    (on a CPU, its flash kernel). Decided on the host once per device type, before a compiled model traces
    flash_attention (GPTConfig.check_attention asks first)."""
    if device.type not in FLASH_KERNELS:
        first = False
        if device.type == "cuda" and IN_REPOSITORY:
            from attention.cuda import cuda_facts, cudnn_first
            first = cudnn_first(*cuda_facts(device))
        FLASH_KERNELS[device.type] = ((SDPBackend.CUDNN_ATTENTION,) if first else ()) + (SDPBackend.FLASH_ATTENTION,)
    return FLASH_KERNELS[device.type]


def flash_attention(q, k, v, mask, dropout_p):
    # the fastest flash kernel the device has: SDPA tries them in flash_kernels' order
    kernels = FLASH_KERNELS.get(q.device.type) if torch.compiler.is_compiling() else flash_kernels(q.device)
    with sdpa_kernel(list(kernels or (SDPBackend.FLASH_ATTENTION,)), set_priority=True):
        return sdpa_attention(q, k, v, mask, dropout_p)


FLEX_REGION = "attention.flex_attention"  # the profiler region every eager-called flex runs in (bench's audit)
# an eager flex call compiles flex on CUDA (eager flex there is a slow reference); a CPU runs it eagerly (a compiled
# model traces flex itself): tests set this to compile it on a CPU as CUDA does
COMPILE_FLEX_OFF_CUDA = False


@functools.cache  # building one costs milliseconds: one per shape and device
def causal_block_mask(q_len: int, kv_len: int, device: str) -> BlockMask:
    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, q_len, kv_len, device=device)


@functools.cache
def compiled_flex(use: str):
    """flex_attention compiled per use ('causal', 'decode'): `use` only keys the cache, so each use gets a compiled
    callable, and a recompile count, of its own."""
    from core.runtime import compile_isolated
    return compile_isolated(flex_attention, recompile_limit=16)


def flex_causal_attention(q, k, v, mask, dropout_p):
    # mask: None (causal), a BlockMask (documents, window) or a decode step's score mod (masks.visible_mask)
    if dropout_p > 0:
        raise user_error("FlexAttention has no attention dropout; set dropout=0.0 or pick another attn.")
    if q.size(-2) == 1 and torch.compiler.is_compiling():
        # inductor's CPU flex lowering (torch 2.13) fails on a one-query view with an odd stride; a copy compiles
        # (docs/torch_versions.md)
        q = q.clone(memory_format=torch.contiguous_format)
    block_mask = mask if isinstance(mask, BlockMask) else None
    score_mod = mask if mask is not None and block_mask is None else None
    if mask is None and q.size(-2) > 1:  # a trace builds it into the graph: the cache is for eager calls
        build = causal_block_mask.__wrapped__ if torch.compiler.is_compiling() else causal_block_mask
        block_mask = build(q.size(-2), k.size(-2), str(q.device))
    if torch.compiler.is_compiling():  # inside a compiled model dynamo traces flex itself
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    compile_it = q.is_cuda or COMPILE_FLEX_OFF_CUDA
    flex = compiled_flex("causal" if score_mod is None else "decode") if compile_it else flex_attention
    with torch.profiler.record_function(FLEX_REGION):  # a compiled call shows the profiler no flex op of its own
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)


def varlen_attention(q, k, v, mask, dropout_p):
    # FlashAttention's variable-length kernel (CUDA) takes the batch as one packed sequence of documents, and the
    # window as flash's window_size. Imported here: its module imports dynamo, which only a varlen run needs.
    from torch.nn.attention.varlen import varlen_attn
    if isinstance(mask, torch.Tensor):  # a decode step's row over the cache: SDPA runs it
        return sdpa_attention(q, k, v, mask, dropout_p)
    B, nh, Tq, hs = q.shape
    Tk = k.size(-2)  # more keys than queries: a decode step over the written keys, causal aligned to the end

    def rows(T):  # each row one sequence: (B + 1,) starts
        return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    cu_q, max_q, window = (mask.cu_seqlens, mask.max_len, mask.window) if mask is not None else (rows(Tq), Tq, 0)
    cu_k, max_k = (cu_q, max_q) if Tk == Tq else (rows(Tk), Tk)
    q = q.transpose(1, 2).reshape(B * Tq, nh, hs)  # (B*Tq, nh, hs): rows end to end
    k, v = (t.transpose(1, 2).reshape(B * Tk, nh, hs) for t in (k, v))  # (B*Tk, nh, hs)
    y = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(window - 1 if window else -1, 0))  # (B*Tq, nh, hs)
    return y.reshape(B, Tq, nh, hs).transpose(1, 2)


@dataclass(frozen=True)
class Attention:
    """An implementation, and what the model asks of it where it runs (attention/kernels.py and masks.py); what bench's
    audit expects to see it run is benchmarks/measure.py's AUDIT."""
    fn: Callable               # (q, k, v, mask, dropout_p) -> y, as above
    title: str                 # what an error line calls it
    mask: str = "dense"        # the layout of documents' and windows' masks: "dense" (bool), "block" (flex's),
                               # "packed" (varlen's)
    devices: str = "cpu cuda mps"  # where it runs; where it takes attention dropout; where it has a backward
    dropout: str = "cpu cuda mps"
    grad: str = "cpu cuda mps"
    backend: Optional[SDPBackend] = None  # the SDPA kernel it forces (flash: FlashAttention-2, cuDNN's before it)
    picks: bool = False        # SDPA picks the kernel (on Hopper it may pick cuDNN)
    tries_cudnn: bool = False  # tries cuDNN's flash kernel first where SDPA ranks it first (flash: flash_kernels)
    skips_future_keys: bool = False  # computes none of the keys causal attention leaves out

    def __call__(self, q, k, v, mask, dropout_p):
        return self.fn(q, k, v, mask, dropout_p)

    def kernels_on(self, device: torch.device) -> str:
        """For a banner: the CUDA kernels it tries on `device`, first choice first, where they depend on the GPU."""
        if not self.tries_cudnn or device.type != "cuda":
            return ""
        names = {SDPBackend.CUDNN_ATTENTION: "cuDNN's flash kernel", SDPBackend.FLASH_ATTENTION: "FlashAttention-2"}
        return ", then ".join(names[b] for b in flash_kernels(device))


def sdpa_forcing(backend: SDPBackend, title: str, **record) -> Attention:
    return Attention(forced(backend), title, backend=backend, **record)


IMPLEMENTATIONS = {  # nanoGPT's masked softmax and SDPA's two calls first, then SDPA's kernels forced, flex and varlen
    "manual": Attention(manual_attention, "the masked softmax"),
    "sdpa_mask": Attention(sdpa_mask_attention, "SDPA with a mask", picks=True),
    "sdpa": Attention(sdpa_attention, "SDPA", picks=True, skips_future_keys=True),
    "flash": Attention(flash_attention, "the flash kernel", backend=SDPBackend.FLASH_ATTENTION, dropout="cuda",
                       tries_cudnn=True, skips_future_keys=True),
    "flash2": sdpa_forcing(SDPBackend.FLASH_ATTENTION, "PyTorch's FlashAttention-2", devices="cuda",
                           skips_future_keys=True),
    "efficient": sdpa_forcing(SDPBackend.EFFICIENT_ATTENTION, "the memory-efficient kernel", devices="cuda",
                              skips_future_keys=True),
    "cudnn": sdpa_forcing(SDPBackend.CUDNN_ATTENTION, "the cuDNN kernel", devices="cuda", skips_future_keys=True),
    "math": sdpa_forcing(SDPBackend.MATH, "the math kernel"),
    "flex": Attention(flex_causal_attention, "FlexAttention", mask="block", dropout="", grad="cuda"),
    "varlen": Attention(varlen_attention, "varlen_attn", mask="packed", devices="cuda", dropout="",
                        skips_future_keys=True),
}


# -----------------------------------------------------------------------------
# the model; RUN_FIELDS: what a run may choose for weights trained otherwise (attention, its masks, dropout)

# the allowed range of each size GPTConfig holds, "[lo, hi)": checked here, and in train.py's LIMITS at the command line
SHAPE_RANGES = {"block_size": "[1, inf)", "n_layer": "[1, inf)", "n_head": "[1, inf)", "n_embd": "[1, inf)",
                "dropout": "[0, 1)", "window": "[0, inf)"}
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
            raise user_error("attn='auto' is measured on a model, not stored in a config: build it with another "
                             "attn (say 'sdpa'), then call model.set_attention('auto').")
        if self.attn not in IMPLEMENTATIONS:
            raise user_error(f"unknown attn '{self.attn}'; choose one of {', '.join(IMPLEMENTATIONS)}.")
        for name, spec in {**SHAPE_RANGES, "vocab_size": "[1, inf)"}.items():
            lo, hi = (float(bound) for bound in spec[1:-1].split(","))  # "[lo, hi)"
            if not lo <= getattr(self, name) < hi:
                raise user_error(f"{name} must be at least {lo:g}" + (f" and less than {hi:g}" if hi < math.inf else "")
                                 + f", got {getattr(self, name)}.")
        if self.n_embd % self.n_head != 0:
            raise user_error(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                             f"pick sizes where n_embd is a multiple of n_head.")
        if self.gelu not in ("tanh", "none"):
            raise user_error(f"gelu must be 'tanh' or 'none', got '{self.gelu}'.")
        if self.doc_mask and not 0 <= self.eot_token < self.vocab_size:
            raise user_error(f"doc_mask needs the end-of-text token that separates documents, and eot_token="
                             f"{self.eot_token} is not a token of the {self.vocab_size}-token vocabulary; use a "
                             f"dataset whose meta.json names one (shakespeare, openwebtext) or doc_mask=False.")

    @classmethod
    def build(cls, shape: dict, run: dict) -> "GPTConfig":
        """A config from two parts, as train.py, sample.py, from_pretrained and nanoGPT's files make one: `shape`, what
        the weights determine (keys that are not fields are ignored), then `run`, what this run chooses (RUN_FIELDS).
        GPTConfig(...) itself, as in nanoGPT, takes every field at once."""
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

    def check_attention(self, device_type: str, dtype: torch.dtype, training: bool, seq_len: int,
                        problem: Optional[str] = None, decoding: bool = True) -> None:
        """Whether the implementation runs here (attention/kernels.py decides, once per call it is asked), else one
        error line naming what does (training is checked with its backward, at its own length; inference at
        block_size, with a decode step unless `decoding` is False: a forward without a KV cache, an evaluation's)."""
        decoding = decoding and not training
        if not IN_REPOSITORY:  # no probe: a kernel that cannot run here raises PyTorch's own error
            if self.attn in ("flex", "varlen"):
                needs_repository(f"attn='{self.attn}'")
            return
        from attention.kernels import AttnCall, refuse_unless_runs  # the one decision, and its error line
        call = AttnCall(device_type, dtype, self.head_size, needs_grad=training,
                        dropout_p=self.dropout if training else 0.0,
                        seq_len=seq_len if training else self.block_size, masked=self.masked,
                        decode_step=decoding)
        refuse_unless_runs(self.attn, call, IMPLEMENTATIONS, problem)


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.layer = config.n_head, config.n_embd, layer
        self.attend = IMPLEMENTATIONS[config.attn].fn  # chosen once (GPT.set_attention), called as is

    def forward(self, x: torch.Tensor, mask=None, cache: Optional["KVCache"] = None,
                input_pos: Optional[torch.Tensor] = None, keys: slice = slice(None)) -> torch.Tensor:
        """x (B, T, C), attended causally within `mask`; with a cache, k and v are written at input_pos too, and a
        decode step (T == 1) attends to the cache positions `keys`."""
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs) each
                   for t in self.c_attn(x).split(self.n_embd, dim=2))
        if cache is not None:
            cache_k, cache_v = cache.update(self.layer, input_pos, k, v)  # (B, nh, block_size, hs) each
            k, v = (cache_k[:, :, keys], cache_v[:, :, keys]) if T == 1 else (k, v)  # (B, nh, keys read, hs)
        y = self.attend(q, k, v, mask, self.attn_dropout if self.training else 0.0)  # (B, nh, T, hs)
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

    def forward(self, x, mask=None, cache: Optional["KVCache"] = None, input_pos: Optional[torch.Tensor] = None,
                keys: slice = slice(None)):
        x = x + self.attn(self.ln_1(x), mask, cache, input_pos, keys)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, layer) for layer in range(config.n_layer)]),
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
        self.cache: Optional[KVCache] = None  # decode state, made by setup_cache
        self.attention_checked: Optional[tuple] = None  # what forward last checked its attention for
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

    def get_num_params(self, non_embedding: bool = True) -> int:  # wte, tied to lm_head, counts as compute
        return sum(p.numel() for p in self.parameters()) - (self.transformer.wpe.weight.numel() if non_embedding else 0)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                input_pos: Optional[torch.Tensor | int] = None, all_positions: bool = False):
        """idx (B, T) -> logits over the padded vocabulary, padded ids at -inf. With targets: (B, T, V) logits and
        the mean cross-entropy (targets of -1 ignored), as nanoGPT's; with config.chunked_loss, None and the same
        loss. Without: the last position's (B, 1, V), or every position's with all_positions. With input_pos, after
        setup_cache: a prefill at positions 0 .. T-1 ((T,) tensor), then one token at a time at the next position:
        an int (the step reads the keys it sees) or a (1,) tensor (the whole cache behind a mask row: one shape at
        every position, as a compiled step needs)."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise user_error(f"cannot forward a sequence of {T} tokens: block_size is "
                             f"{self.config.block_size}; crop the input or use a smaller block_size.")
        if input_pos is not None and self.cache is None:
            raise ValueError("input_pos needs a KV cache: call model.setup_cache(batch_size) first")
        cache = None if input_pos is None else self.cache
        training = self.training and torch.is_grad_enabled()
        asked = (self.config.attn, self.config.block_size, idx.device.type, self.compute_dtype(), training,
                 T if training else None, input_pos is not None)  # what the check depends on
        if asked != self.attention_checked and not torch.compiler.is_compiling():  # a trace cannot run the probe:
            self.config.check_attention(*asked[2:5], T, decoding=asked[6])         # set_attention checked it
            self.attention_checked = asked
        position = input_pos if isinstance(input_pos, int) else None  # an eager decode step's, on the host
        if position is not None:
            input_pos = torch.full((1,), position, device=idx.device)  # (1,): a fill, not a copy from the host
        pos = torch.arange(T, dtype=torch.long, device=idx.device) if input_pos is None else input_pos  # (T,)
        mask, keys = self._attention_mask(idx, cache, input_pos, position)  # one for every layer
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        try:
            for block in self.transformer.h:
                x = block(x, mask, cache, input_pos, keys)
        except (RuntimeError, NotImplementedError) as e:  # a kernel refusing what the check could not foresee
            if "No available kernel" in str(e):  # SDPA's text (docs/torch_versions.md)
                shape = (B, self.config.n_head, T, self.config.head_size)  # q's
                self.config.check_attention(idx.device.type, self.compute_dtype(),
                                            self.training and torch.is_grad_enabled(), T,
                                            problem=f"PyTorch refused q of shape {shape} at run time")
            raise
        x = self.transformer.ln_f(x)
        if targets is None and not all_positions:
            x = x[:, -1:, :]  # (B, 1, C): only the next token is needed
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

    def _attention_mask(self, idx: torch.Tensor, cache: Optional["KVCache"], input_pos: Optional[torch.Tensor],
                        position: Optional[int]):
        """(mask, keys) for every layer: for training and a prefill, None (causal) or the documents' and window's mask
        in the implementation's layout, over all keys; for a decode step, the cache positions it reads and the mask
        over them (attention/masks.py's decode_step): at a host `position`, a range around the keys it sees; at a
        tensor input_pos alone, the whole cache."""
        if cache is not None:
            cache.update_documents(idx, input_pos)
        cfg = self.config
        if cache is not None and idx.size(1) == 1:
            whole = position is None
            if not IN_REPOSITORY:  # model.py copied by itself: no documents, no window: every key written so far
                row = (torch.arange(cfg.block_size, device=idx.device) <= input_pos)[None, None, None, :]
                return (row, slice(None)) if whole else (None, slice(0, position + 1))
            from attention.masks import decode_step
            keys, mask = decode_step(IMPLEMENTATIONS[cfg.attn].mask, input_pos + 1 if whole else position + 1,
                                     cfg.window, cfg.block_size, whole or cache.takes_mask, idx.device,
                                     None if whole else cache.dtype, cache.doc_start)
            return mask, keys
        if not cfg.masked:
            return None, slice(None)
        needs_repository("a doc_mask or window mask")
        from attention.masks import doc_window_mask  # documents and windows: only a run that asks for them
        return doc_window_mask(cfg, IMPLEMENTATIONS[cfg.attn].mask, idx), slice(None)

    def setup_cache(self, batch_size: int, dtype: Optional[torch.dtype] = None) -> None:  # the one KV cache
        weight = self.transformer.wpe.weight
        self.cache = KVCache(self.config, batch_size, weight.device, dtype or weight.dtype)
        self._decide_decode_mask()

    def _decide_decode_mask(self) -> None:
        """Whether an eager decode step reads its keys behind a mask row (attention/masks.py's decode_step): decided
        once a generation (and again when the attention changes), not at every token."""
        if self.cache is not None and IN_REPOSITORY:
            from attention.kernels import decodes_with_mask
            cfg = self.config
            self.cache.takes_mask = decodes_with_mask(cfg.attn, IMPLEMENTATIONS[cfg.attn], self.cache.device_type,
                                                      self.cache.dtype, cfg.head_size)

    def clear_cache(self) -> None:  # and its buffers with it
        self.cache = None

    def cache_bytes(self) -> int:  # the KV cache's buffers, doc_mask's document starts included
        return sum(t.numel() * t.element_size() for t in self.cache.buffers()) if self.cache is not None else 0

    def compute_dtype(self) -> torch.dtype:  # autocast's dtype when it is on for the model's device, else the weights'
        weight = self.transformer.wpe.weight  # never quantized (int8 weights report their own dtype)
        device = weight.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype

    def set_attention(self, attn: str, training: Optional[bool] = None, dtype: Optional[torch.dtype] = None) -> "GPT":
        """Read the same weights through another implementation, in place; returns the model. Checked on the
        model's device, in its mode (or `training`) and compute dtype (or `dtype`). attn='auto': the fastest
        correct one on this model's shapes, measured (attention/attn_auto.py)."""
        training = self.training if training is None else training
        dtype = dtype or self.compute_dtype()
        if attn == "auto":
            needs_repository("attn='auto'")
            from attention.attn_auto import choose_for_model
            attn = choose_for_model(self, IMPLEMENTATIONS, training, dtype)
        previous, self.config = self.config, dataclasses.replace(self.config, attn=attn)  # checks the name
        try:
            self.config.check_attention(self.transformer.wpe.weight.device.type, dtype, training,
                                        self.config.block_size)
        except Exception:
            self.config = previous
            raise
        for block in self.transformer.h:
            block.attn.attend = IMPLEMENTATIONS[attn].fn
        self._decide_decode_mask()
        return self

    def crop_block_size(self, block_size: int) -> None:  # e.g. to fine-tune GPT-2 (1024) at a shorter block_size
        if block_size > self.config.block_size:
            raise user_error(f"block_size={block_size} is larger than the model's {self.config.block_size}; "
                             f"use --block_size={self.config.block_size} or less.")
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
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type in ("cuda", "cpu") or None)

    def flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Training FLOPs per token (PaLM appendix B): 6N for the weights' matmuls, 12·L·C·T for attention's."""
        cfg, T = self.config, seq_len or self.config.block_size
        return 6 * self.get_num_params() + 12 * cfg.n_layer * cfg.n_embd * T

    def model_flops_utilization(self, tokens_per_s: float, peak_flops: float, seq_len: Optional[int] = None) -> float:
        # achieved training FLOP/s over the device's peak for the dtype in use
        return self.flops_per_token(seq_len) * tokens_per_s / peak_flops

    # -- nanoGPT's API: its signatures and meanings --------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_type: str, override_args: Optional[dict] = None) -> "GPT":
        """GPT-2's weights: a nanoGPT name (gpt2 ... gpt2-xl, from the Hugging Face hub) or a local Hugging Face
        directory. override_args may set dropout, as nanoGPT's does, and attn, pad_vocab and the masks."""
        overrides, allowed = dict(override_args or {}), {"pad_vocab", *RUN_FIELDS}
        if set(overrides) - allowed:
            raise user_error(f"from_pretrained can only override {sorted(allowed)}, got {sorted(overrides)}.")
        if IN_REPOSITORY:
            from core import hf  # Hugging Face's files, read with one error line where they are not GPT-2's
            shape, state_dict = hf.read_gpt2(model_type)
        else:  # model.py copied by itself: transformers reads them, as in nanoGPT's model.py
            from transformers import GPT2LMHeadModel
            hf_model = GPT2LMHeadModel.from_pretrained(model_type)
            c, state_dict = hf_model.config, hf_model.state_dict()
            shape = dict(block_size=c.n_positions, vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head,
                         n_embd=c.n_embd, bias=True, gelu="none" if c.activation_function == "gelu" else "tanh")
        config = GPTConfig.build({**shape, "pad_vocab": overrides.pop("pad_vocab", False)}, overrides)
        model = cls(config)
        model.load_state_dict(from_hf_names(state_dict, config))
        return model

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None) -> torch.Tensor:
        """nanoGPT's: idx (B, T) with max_new_tokens tokens appended, drawn with torch's global RNG (temperature 0:
        greedy), over a KV cache. The model stays in its mode: call model.eval() first, as with nanoGPT."""
        had_cache = self.cache is not None
        try:
            return decode_tokens(self, idx, max_new_tokens, temperature, top_k)
        finally:
            if not had_cache:  # nanoGPT's generate leaves no state behind: free the cache it made, and its buffers
                self.clear_cache()

    def estimate_mfu(self, fwdbwd_per_iter: float, dt: float, peak_flops: float = 312e12) -> float:
        """nanoGPT's MFU: the fraction of an A100's bf16 peak (or `peak_flops`) reached by an iteration of
        fwdbwd_per_iter sequences of block_size tokens in dt seconds."""
        return self.model_flops_utilization(fwdbwd_per_iter * self.config.block_size / dt, peak_flops)


# Hugging Face's GPT-2 stores these as Conv1D, (in, out): nn.Linear's are (out, in)
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def from_hf_names(hf_state_dict: dict, config: GPTConfig) -> dict:
    """A Hugging Face GPT2LMHeadModel state dict in this model's names and layout, the token embedding padded to
    config.padded_vocab_size (lm_head tied to it)."""
    out = {}
    for key, tensor in hf_state_dict.items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue  # causal-mask buffers, and lm_head, which is tied to wte
        out["transformer." + key] = tensor.t() if key.endswith(CONV1D_WEIGHTS) else tensor
    wte = out["transformer.wte.weight"]
    if wte.size(0) != config.vocab_size:
        raise user_error(f"the checkpoint has {wte.size(0)} token embeddings but vocab_size is {config.vocab_size}.")
    padded = torch.zeros(config.padded_vocab_size, wte.size(1), dtype=wte.dtype)
    padded[:config.vocab_size] = wte
    out["transformer.wte.weight"] = out["lm_head.weight"] = padded
    return out


# -----------------------------------------------------------------------------
# the loss over row chunks (chunked_loss, train.py's default): lm_head and cross-entropy, the (N, V) logits never whole

# A chunk holds at most about LOSS_CHUNK_ELEMENTS logits (GPT-2's padded 50304: 4 chunks of 2048 rows for a step of
# 8,192 tokens, 5 for 12,288): few chunks, since each adds lm_head's weight gradient once, of equal rows rounded up to
# a multiple of LOSS_CHUNK_ROWS, which tensor-core tiles divide
LOSS_CHUNK_ELEMENTS = 2 ** 27
LOSS_CHUNK_ROWS = 128


def loss_chunk_rows(rows: int, vocab: int) -> int:
    """Rows per chunk: the fewest chunks of about LOSS_CHUNK_ELEMENTS logits each, equal but for the last."""
    chunks = -(-rows * vocab // LOSS_CHUNK_ELEMENTS)
    per_chunk = -(-rows // chunks)
    return -(-per_chunk // LOSS_CHUNK_ROWS) * LOSS_CHUNK_ROWS


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """F.cross_entropy(x @ weight.T + bias, targets, ignore_index=-1), x (N, C) and targets (N,), matmuls in `dtype`
    and sums in fp32: with gradients through ChunkedLMHeadLoss, without them one chunk's loss at a time."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return ChunkedLMHeadLoss.apply(x, weight, bias, targets, dtype)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    with torch.autocast(x.device.type, enabled=False):  # the matmuls in exactly `dtype`
        for _, _, ts, logits in chunk_logits(x, weight.to(dtype), bias, targets):
            loss += F.cross_entropy(logits, ts, ignore_index=-1, reduction="sum")
    return loss / (targets != -1).sum()


def chunk_logits(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor):
    """(start, x's rows in w's dtype, their targets, their (n, V) logits in fp32) for each chunk of rows (callers turn
    autocast off). The matmul accumulates in fp32 and rounds to w's dtype, as the whole logits' F.linear does; the
    fp32 copy feeds reductions and the gradient, which a compiled step fuses without writing it out."""
    rows = loss_chunk_rows(x.size(0), w.size(0))
    for start in range(0, x.size(0), rows):
        xs = x[start:start + rows].to(w.dtype)
        logits = (xs @ w.t()).float()  # (n, V)
        if bias is not None:
            logits += bias  # in place: one (n, V) chunk held
        yield start, xs, targets[start:start + rows], logits


class ChunkedLMHeadLoss(torch.autograd.Function):
    """Each chunk's logits give its loss and at once its gradients (softmax minus one-hot), which backward only
    scales: the (N, V) logits never exist whole and nothing is recomputed."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, dtype: torch.dtype):  # x (N, C), weight (V, C), targets (N,)
        valid = targets != -1
        count = valid.sum()
        w = weight.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        vocab_ids = torch.arange(weight.size(0), device=x.device)  # (V,)
        with torch.autocast(x.device.type, enabled=False):  # the matmuls in exactly `dtype`
            for start, xs, ts, logits in chunk_logits(x, w, bias, targets):
                loss += F.cross_entropy(logits, ts, ignore_index=-1, reduction="sum")  # checks the targets too
                hit = valid[start:start + len(ts), None]  # (n, 1)
                # d(the chunk's summed loss)/d(logits): softmax minus one-hot, zero on ignored rows; in place over
                # the logits (eager holds one fp32 chunk), elementwise only (compiled, one fused pass into `dtype`)
                probs = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()  # (n, V)
                one_hot = (vocab_ids == ts[:, None]).to(torch.uint8)  # (n, V), a byte an id
                grad = probs.sub_(one_hot).mul_(hit).to(dtype)
                grad_x[start:start + len(ts)] = grad @ w
                grad_weight += grad.t() @ xs  # bf16/fp16 products summed over chunks in fp32
        ctx.save_for_backward(grad_x, grad_weight.to(weight.dtype), count)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count.clamp(min=1)  # nothing counted: the saved gradients are zeros, and stay so
        return grad_x * scale.to(grad_x.dtype), grad_weight * scale.to(grad_weight.dtype), None, None, None


# -----------------------------------------------------------------------------
# decoding: one KV cache for the model, beside the layers (gpt-fast keeps one in each attention module), and the one
# generation loop

class KVCache(nn.Module):
    """Every layer's keys and values for positions [0, block_size), in fixed buffers (one shape at every position,
    so a decode step compiles once), and each row's document start. The decode loop owns the position."""

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype):
        super().__init__()
        self.eot_token, self.batch_size, self.dtype = config.eot_token, batch_size, dtype
        self.device_type, self.takes_mask = torch.device(device).type, False  # takes_mask: GPT decides it
        shape = (batch_size, config.n_head, config.block_size, config.head_size)
        for layer in range(config.n_layer):  # buffers of their own: CPU flex refuses a key tensor inside another's
            self.register_buffer(f"k{layer}", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
            self.register_buffer(f"v{layer}", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        starts = torch.zeros(batch_size, dtype=torch.long, device=device) if config.doc_mask else None  # (B,)
        self.register_buffer("doc_start", starts, persistent=False)

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write layer's k, v (B, nh, T, hs) at input_pos (T,); return its whole cache, (B, nh, block_size, hs) each."""
        cache_k, cache_v = getattr(self, f"k{layer}"), getattr(self, f"v{layer}")
        cache_k.index_copy_(2, input_pos, k.to(cache_k.dtype))
        cache_v.index_copy_(2, input_pos, v.to(cache_v.dtype))
        return cache_k, cache_v

    def update_documents(self, idx: torch.Tensor, input_pos: torch.Tensor) -> None:
        """Where each row's last document starts (with doc_mask): a prompt idx (B, T) from position 0 sets it (0
        without end-of-text); a decode step (T == 1) that writes end-of-text opens one."""
        if self.doc_start is None:
            return
        if idx.size(1) > 1:
            pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
            self.doc_start.copy_(torch.where(idx == self.eot_token, pos, 0).amax(dim=1))  # (B,)
        else:
            start = torch.where(input_pos == 0, 0, self.doc_start)  # position 0: a new text
            self.doc_start.copy_(torch.where(idx[:, 0] == self.eot_token, input_pos, start))  # (B,)


def sample_next(logits: torch.Tensor, temperature: float, top_k: Optional[int],
                generator: Optional[torch.Generator]) -> torch.Tensor:  # logits (B, V) -> one token id per row (B, 1)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # <= 0 over a float32 temperature that cannot round to 0: no inf - inf or 0 / 0 however small it is
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))  # (B, k), largest first
        logits = logits.masked_fill(logits < v[:, -1:], float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


def last_logits(model: GPT, idx: torch.Tensor, input_pos: Optional[torch.Tensor | int]) -> torch.Tensor:
    # one generation step: idx (B, T) at input_pos (None: no cache; a decode step's: an int) -> next logits (B, V)
    logits, _ = model(idx, input_pos=input_pos)  # (B, 1, V)
    return logits[:, -1]


def decode_tokens(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                  top_k: Optional[int] = None, generator: Optional[torch.Generator] = None, use_cache: bool = True,
                  prefill=last_logits, decode=last_logits, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Append max_new_tokens sampled tokens to idx (B, T), each row its own text; temperature=0 is greedy. Over the
    model's KV cache in `dtype`, with the given `prefill` and `decode` steps (compiled ones: tools/decoding.py); the
    loop owns the position, and passes a decode step its own as an int."""
    if idx.dim() != 2 or idx.size(1) == 0:
        raise user_error(f"generation needs a prompt of at least one token per row, shape (B, T), got "
                         f"{tuple(idx.shape)}; start from a token such as end-of-text.")
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):  # NaN fails too
        raise user_error(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}.")
    if top_k is not None and top_k < 1:
        raise user_error(f"top_k must be None (every token) or a positive number of tokens, got {top_k}.")
    block_size, cache = model.config.block_size, None
    if use_cache:
        dtype = dtype or model.compute_dtype()
        if model.cache is None or model.cache.batch_size != idx.size(0) or model.cache.dtype != dtype:
            model.setup_cache(idx.size(0), dtype)  # else reused: compiled steps keep reading the same buffers
        cache = model.cache
    written, token = 0, None  # positions of this text in the cache, and the token sampled last (B, 1)
    for _ in range(max_new_tokens):
        context = idx[:, -block_size:]  # (B, <= block_size)
        if cache is None:
            logits = last_logits(model, context, None)
        elif 0 < written < block_size and written == idx.size(1) - 1:  # one new token fits after them
            logits = decode(model, token, written)
            written += 1
        else:  # the first step, or the text outgrew block_size and every position shifted: run it all again
            # a fresh contiguous tensor, never a view of idx: one layout, so one compiled prefill serves all
            context = context.clone(memory_format=torch.contiguous_format)
            positions = torch.arange(context.size(1), device=idx.device)  # (T,)
            logits = prefill(model, context, positions) if context.size(1) > 1 else decode(model, context, 0)
            written = context.size(1)
        token = sample_next(logits, temperature, top_k, generator)  # (B, 1): the next step's input
        idx = torch.cat((idx, token), dim=1)
    return idx
