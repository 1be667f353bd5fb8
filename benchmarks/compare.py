"""
The same weights through every attention implementation (`python sample.py --compare=all`), testing the claim of
PyTorch's post that the original attention and SDPA sample alike: tokens with one seed, speed with and without the
cache, teacher-forced logits against float64, Appendix A's formulations; with --quantize=int8, int8 weights too.
"""

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch.nn import functional as F

import numpy as np

from core import runtime
from attention.kernels import AttnCall, attention_problem
from core.configurator import comma_list_of
from core.dataset import read_windows
from core.files import token_file
from core.errors import UserError
from engine.generate import Decoder, Sampling, draw_samples, for_inference, full_warmup, print_samples, tokens_per_s
from engine.generate import weight_bytes
from model import IMPLEMENTATIONS, GPT, GPTConfig
from core.runtime import Runtime
from core.tokenizer import CharTokenizer, Tokenizer
from benchmarks.bench_report import format_table


def attention_names(spec) -> list[str]:
    """'all', or a comma list such as 'manual,flash' (a list or tuple too), as implementation names, each once."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = list(IMPLEMENTATIONS) if [s.strip() for s in items] == ["all"] else [s.strip() for s in items if s.strip()]
    if "all" in names:
        raise UserError(f"'all' stands alone, and {','.join(names)} names others beside it; pass all, or a "
                        f"comma-separated list of {', '.join(IMPLEMENTATIONS)}.")
    unknown = [n for n in names if n not in IMPLEMENTATIONS]
    if unknown or not names:
        close = comma_list_of(*IMPLEMENTATIONS).suggestion(names)  # "." or "; did you mean ...?"
        raise UserError(f"unknown attn {', '.join(map(repr, unknown)) or '(none given)'}; "
                        f"use all or a comma-separated list of {', '.join(IMPLEMENTATIONS)}{close}")
    return list(dict.fromkeys(names))


_MIN_NUMERICS_TOKENS = 16  # a shorter prompt is too little text for the teacher-forced comparison
_DEFAULT_TEXT = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep: perchance to dream: ay, there's the rub;
For in that sleep of death what dreams may come
When we have shuffled off this mortal coil,
Must give us pause: there's the respect
That makes calamity of so long life.
"""
FORMULATIONS = {"a": "q.kT then scale (nanoGPT)", "b": "q, k pre-scaled by d^-1/4", "c": "SDPA",
                "d": "SDPA's math backend"}


def with_attn(model: GPT, attn: str, dtype: Optional[torch.dtype] = None) -> GPT:
    """A copy of the same weights, read through another attention implementation in `dtype` (the run's; None: the
    weights')."""
    return copy.deepcopy(model).eval().set_attention(attn, dtype=dtype)


def numerics_ids(tok: Tokenizer, prompt: list[int], block_size: int) -> list[int]:
    """The text for teacher-forced logits: the prompt if long enough, else _DEFAULT_TEXT; at most block_size."""
    if len(prompt) < _MIN_NUMERICS_TOKENS:
        text = _DEFAULT_TEXT
        if isinstance(tok, CharTokenizer):  # a character vocabulary may lack some of its characters
            text = "".join(c for c in text if c in tok.stoi)
        prompt = tok.encode(text) or prompt
    return prompt[:block_size]


def reduced_dtype(rt: Runtime) -> str:
    """The reduced precision reported next to fp32: the run's, else bf16 (fp16 on GPUs without bf16 in hardware)."""
    if rt.dtype != "float32":
        return rt.dtype
    return "float16" if rt.is_cuda and not runtime.bf16_native("cuda") else "bfloat16"


def first_divergence(reference: list[list[int]], samples: list[list[int]]) -> Optional[dict]:
    """The first (sample, new token) index where the samples differ from the reference; None if identical."""
    for i, (ref, other) in enumerate(zip(reference, samples)):
        for j, (a, b) in enumerate(zip(ref, other)):
            if a != b:
                return {"sample": i, "token": j}
    return None


# -----------------------------------------------------------------------------
# numerics

def forced_logits(model: GPT, x: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """Teacher-forced logits over the real vocabulary, (T, vocab_size) in float64 (padded columns dropped)."""
    with torch.no_grad(), rt.autocast():
        logits, _ = model(x, all_positions=True)  # (1, T, padded V)
    return logits[0, :, :model.config.vocab_size].double()


def logit_errors(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    """max |dlogit|, the same over max(1, max |reference logit|), and KL(reference || logits) per position."""
    max_abs = (logits - ref).abs().max().item()
    log_p, log_q = F.log_softmax(ref, dim=-1), F.log_softmax(logits, dim=-1)  # (T, V)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0)  # (T,) rounding can make it a hair negative
    return {"max_abs": max_abs, "scaled": max_abs / max(1.0, ref.abs().max().item()),
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item()}


def layer_qkv(model: GPT, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v, each (1, nh, T, hs), as block `layer` computes them for x (fp32, no autocast)."""
    captured = []
    hook = model.transformer.h[layer].attn.c_attn.register_forward_hook(lambda m, i, out: captured.append(out))
    try:
        with torch.no_grad():
            model(x)
    finally:
        hook.remove()
    B, T, _ = captured[0].shape
    cfg = model.config
    q, k, v = captured[0].split(cfg.n_embd, dim=2)  # each (B, T, C)
    return tuple(t.view(B, T, cfg.n_head, cfg.head_size).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)


def formulations(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """Appendix A: the same causal attention written three ways, each (B, nh, T, hs); SDPA twice, as PyTorch
    dispatches it and forced onto the math backend, the one the PyTorch blog post describes."""
    d = q.size(-1)
    mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()  # (T, T)

    def attend(scores: torch.Tensor) -> torch.Tensor:  # scores (B, nh, T, T)
        return F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v

    return {
        "a": attend((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))),
        "b": attend((q * d ** -0.25) @ (k * d ** -0.25).transpose(-2, -1)),
        "c": F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "d": IMPLEMENTATIONS["math"](q, k, v, None, 0.0),  # None: causal
    }


def appendix_a(qkv: tuple[torch.Tensor, ...], dtype: str) -> dict:
    """Each formulation in `dtype` against (a) in float64, and each pair against the other."""
    ref = formulations(*(t.double() for t in qkv))["a"]
    ys = formulations(*(t.to(runtime.DTYPES[dtype]) for t in qkv))
    pairs = {}
    for a, b in itertools.combinations(ys, 2):
        pairs[f"{a}-{b}"] = {"max_abs": (ys[a] - ys[b]).abs().max().item(), "allclose": torch.allclose(ys[a], ys[b])}
    return {"vs_float64": {n: (y.double() - ref).abs().max().item() for n, y in ys.items()}, "pairwise": pairs}


# -----------------------------------------------------------------------------
# comparison

@dataclass
class Comparison:
    """What every implementation in a comparison runs with."""
    rt: Runtime
    reduced: str  # the reduced precision reported next to fp32
    sampling: Sampling
    prompt: list[int]
    compile: bool
    x: Optional[torch.Tensor] = None  # (1, T) the teacher-forced text
    ref_logits: Optional[torch.Tensor] = None  # (T, vocab_size) float64 logits of x through attn='manual'
    held_out: Optional[tuple] = None  # (windows (N, T + 1), where they came from): each implementation's loss on them

    def problem(self, attn: str, dtype: str, config: GPTConfig) -> Optional[str]:
        return attention_problem(attn, AttnCall(self.rt.device_type, runtime.DTYPES[dtype], config.head_size,
                                                seq_len=config.block_size, masked=config.masked),
                                 IMPLEMENTATIONS[attn])


def resolve_compare(compare: str, comparison: Comparison, config: GPTConfig) -> tuple[list[str], dict[str, str]]:
    """The implementations asked for, in order, and why those that cannot run here are skipped."""
    names = attention_names(compare)
    skipped = {n: p for n in names if (p := comparison.problem(n, comparison.rt.dtype, config))}
    if len(skipped) == len(names):
        rt = comparison.rt
        raise UserError(f"none of {', '.join(names)} can run on {rt.device} in {rt.dtype}; try --compare=all.")
    return names, skipped


def compare_one(model: GPT, comparison: Comparison, first: Optional[list[list[int]]]) -> dict:
    """Generation with and without the KV cache, and teacher-forced logits, of one implementation."""
    sampling = comparison.sampling
    decoder = Decoder(model, comparison.compile, dtype=comparison.rt.torch_dtype)  # draws under autocast
    warmup = full_warmup(model, sampling)
    cached, t_cached, _ = draw_samples(decoder, comparison.prompt, comparison.rt, sampling, True, warmup)
    plain, t_plain, _ = draw_samples(decoder, comparison.prompt, comparison.rt, sampling, False, warmup)
    first = cached if first is None else first
    result = {"samples": cached, "identical_to_first": cached == first,
              "first_divergence": first_divergence(first, cached), "cache_equals_no_cache": cached == plain,
              "tokens_per_s": tokens_per_s(t_cached, sampling),
              "tokens_per_s_no_cache": tokens_per_s(t_plain, sampling), "logits": {},
              "held_out_loss": held_out_loss(model, comparison.held_out[0])[0]}
    for dt in ("float32", comparison.reduced):
        problem = comparison.problem(model.config.attn, dt, model.config)
        result["logits"][dt] = ({"skipped": problem} if problem else
                                logit_errors(forced_logits(model, comparison.x, Runtime(comparison.rt.device, dt)),
                                             comparison.ref_logits))
    return result


def run_compare(model: GPT, tok: Tokenizer, comparison: Comparison, names: list[str], skipped: dict[str, str],
                data: Optional[Path] = None) -> dict:
    """Every runnable implementation in turn, its samples printed as they come; returns all the numbers."""
    ids = numerics_ids(tok, comparison.prompt, model.config.block_size)
    comparison.x = torch.tensor([ids], dtype=torch.long, device=comparison.rt.device)  # (1, T)
    # the same windows for each implementation and each set of weights
    comparison.held_out = held_out_windows(data, comparison.x, model.config.block_size, model.config.vocab_size)
    ref_device = "cpu" if comparison.rt.device_type == "mps" else comparison.rt.device  # MPS has no float64
    ref_model = with_attn(model, "manual").double().to(ref_device)
    comparison.ref_logits = forced_logits(ref_model, comparison.x.to(ref_device),
                                          Runtime(ref_device, "float32")).to(comparison.rt.device)
    del ref_model
    layer = model.config.n_layer // 2
    qkv = layer_qkv(model, comparison.x, layer)
    report = {"order": names, "skipped": skipped, "implementations": {}, "numerics_tokens": len(ids),
              "held_out": comparison.held_out[1], "block_size": model.config.block_size,
              "reduced_dtype": comparison.reduced,
              "appendix_a": {"layer": layer, "head_size": model.config.head_size,
                             **{dt: appendix_a(qkv, dt) for dt in ("float32", comparison.reduced)}}}
    first_name, first = None, None
    printed: dict[str, list] = {}  # the implementation whose samples were printed -> those samples
    for name in names:
        if name in skipped:
            print(f"=== {name}: skipped, {skipped[name]}")
            continue
        twin = with_attn(model, name, comparison.rt.torch_dtype)
        try:
            result = compare_one(twin, comparison, first)
        except UserError as e:  # a kernel that refused a shape only the real run met: skip the row, not the run
            skipped[name] = str(e)  # the same dict as report["skipped"]
            print(f"=== {name}: skipped, {e}")
            continue
        result["texts"] = [tok.decode(comparison.prompt + sample) for sample in result["samples"]]
        div = result["first_divergence"]
        if first is None:
            first_name, first, verdict = name, result["samples"], "the reference tokens"
        elif div is None:
            verdict = f"tokens identical to {first_name}'s"
        else:
            verdict = f"tokens differ from {first_name}'s at sample {div['sample']}, new token {div['token']}"
        same_as = next((other for other, samples in printed.items() if samples == result["samples"]), None)
        if same_as is None:
            print(f"=== {name}: {verdict}")
            print_samples(tok, comparison.prompt, result["samples"])
            printed[name] = result["samples"]
        else:  # identical text is printed once, under the first implementation that produced it
            print(f"=== {name}: {verdict} (the samples printed under {same_as})")
        report["implementations"][name] = result
    return report


def print_comparison(comparison: Comparison, report: dict) -> None:
    """The summary tables (bench.py's layout): generation, teacher-forced logits, Appendix A."""
    sampling, gens, dts = comparison.sampling, report["implementations"], ("float32", comparison.reduced)
    first, short = next(iter(gens)), {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    print(f"\n== generation: {sampling.num_samples} sample(s) x {sampling.max_new_tokens} new tokens in one batch, "
          f"seed {sampling.seed}, {comparison.rt.dtype} on {comparison.rt.device}"
          f"{', compiled' if comparison.compile else ''}; "
          f"tokens compared with {first}'s; held-out loss (fp32) on {comparison.held_out[1]}")
    rows = [dict(attn=n, status="skipped", reason=report["skipped"][n]) if n in report["skipped"]
            else dict(gens[n], attn=n, status="ok", tokens=tokens_cell(n, gens, first)) for n in report["order"]]
    print(format_table(rows, {
        "attn": lambda r: r["attn"], "tokens": lambda r: r.get("tokens", ""),
        "tok/s cache": lambda r: f"{r['tokens_per_s']:.1f}",
        "tok/s no cache": lambda r: f"{r['tokens_per_s_no_cache']:.1f}",
        "held-out loss": lambda r: f"{r['held_out_loss']:.4f}",
        "cache = no cache": lambda r: "yes" if r["cache_equals_no_cache"] else "NO"}))
    differs = [r["attn"] for r in rows if r["status"] == "ok" and (r["tokens"] not in ("reference", "identical") or
                                                                   not r["cache_equals_no_cache"])]
    if differs and comparison.rt.dtype != "float32":  # what holds, and what does not, in a reduced dtype
        print(f"({', '.join(differs)} part from {first}'s tokens or from their own without the cache in "
              f"{comparison.rt.dtype}: where two tokens' logits are closer than {comparison.rt.dtype}'s rounding, "
              f"the order of the sums decides, and every implementation and cache length sums in its own order; "
              f"with --dtype=float32 the tokens of every implementation, cache or not, are identical)")
    block, tokens = report["block_size"], len(comparison.prompt) + sampling.max_new_tokens
    if tokens > block:  # why "tok/s cache" can trail "no cache" in this table
        print(f"(the cache holds block_size={block} positions and a sample reaches {tokens}: past the block every new "
              f"token fills the cache again from the last {block}, a prefill as dear as a step without a cache, so "
              f"here the cache gains little or loses; fewer new tokens, or bench.py --mode=generate, show its gain)")
    print(f"\n== teacher-forced logits on {report['numerics_tokens']} tokens vs float64 manual "
          f"(scaled = max|dlogit| / max(1, max|ref logit|); KL(ref||impl) in nats/token, mean over positions)")
    errors = {f"{short[dt]} {col}": (dt, key) for dt in dts
              for col, key in (("max|dlogit|", "max_abs"), ("scaled", "scaled"), ("KL", "kl_mean"))}
    cell = lambda e, key: "n/a" if "skipped" in e else f"{e[key]:.2e}"  # noqa: E731
    print(format_table([dict(g, attn=n, status="ok") for n, g in gens.items()], {
        "attn": lambda r: r["attn"],
        **{col: (lambda r, dt=dt, key=key: cell(r["logits"][dt], key)) for col, (dt, key) in errors.items()}}))
    a = report["appendix_a"]
    print(f"\n== Appendix A on layer {a['layer']}'s q, k, v (T={report['numerics_tokens']}, d={a['head_size']}): "
          + "; ".join(f"({k}) {v}" for k, v in FORMULATIONS.items()))
    rows = [dict(status="ok", label=f"({k}) vs f64", **{dt: (a[dt]["vs_float64"][k], "") for dt in dts})
            for k in FORMULATIONS]
    rows += [dict(status="ok", label=pair, **{dt: (a[dt]["pairwise"][pair]["max_abs"],
                                                   a[dt]["pairwise"][pair]["allclose"]) for dt in dts})
             for pair in a["float32"]["pairwise"]]
    print(format_table(rows, {"": lambda r: r["label"], **{
        column: (lambda r, dt=dt, i=i: f"{r[dt][0]:.2e}" if i == 0 else str(r[dt][1])) for dt in dts
        for i, column in enumerate((f"{short[dt]} max|dy|", f"{short[dt]} allclose"))}}))
    print("(the PyTorch blog post's Appendix A: the same attention scaled in different places rounds differently; allclose is "
          "torch.allclose's default rtol 1e-5, atol 1e-8, so in fp32 False at 1e-7 to 1e-5, fp32's rounding grown "
          "over a head's sums, is rounding, not other attention)")


def tokens_cell(name: str, gens: dict, first: str) -> str:
    """How `name`'s tokens compare with the first implementation's, naming an earlier one that drew the same."""
    g, div = gens[name], gens[name]["first_divergence"]
    if name == first:
        return "reference"
    if div is None:
        return "identical"
    twin = next((o for o in list(gens)[1:list(gens).index(name)] if gens[o]["samples"] == g["samples"]), None)
    return f"differ at s{div['sample']} t{div['token']}" + (f", = {twin}" if twin else "")


# -----------------------------------------------------------------------------
# weights: fp32, reduced precision, int8

def held_out_windows(data: Optional[Path], x: torch.Tensor, block_size: int, vocab_size: int,
                     max_tokens: int = 4096) -> tuple:
    """Windows (N, T + 1) of held-out text, from the training data's val.bin or else the numerics text, and where
    they came from; ids beyond the model's vocabulary are an error line, as in train.py."""
    if data is None:
        return x, "the built-in text (no val.bin: GPT-2 weights, or the training data is gone)"
    tokens = len(token_file(data / "val.bin", at_least=block_size + 1))
    n = max(1, min(max_tokens // block_size, (tokens - 1) // (block_size + 1)))
    starts = np.linspace(0, tokens - block_size - 1, n).astype(np.int64).tolist()
    windows = read_windows(data / "val.bin", starts, block_size)  # (N, T + 1)
    if int(windows.max()) >= vocab_size:
        raise UserError(f"{data / 'val.bin'} holds token id {int(windows.max())}, beyond the checkpoint's "
                        f"{vocab_size}-token vocabulary: the data was prepared again with another one; prepare it as "
                        f"it was for training, or move it away (--compare then uses built-in text).")
    return windows.to(x.device), f"{data / 'val.bin'}: {n} windows of {block_size} tokens ({n * block_size:,} tokens)"


def held_out_loss(model: GPT, windows: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Mean next-token loss over the windows, and every position's greedy token (N, T)."""
    losses, greedy = [], []
    with torch.no_grad():
        for row in windows.split(8):  # (<= 8, T + 1)
            logits, loss = model(row[:, :-1], row[:, 1:])  # (b, T, V)
            losses.append(loss.item() * row.size(0))
            greedy.append(logits[..., :model.config.vocab_size].argmax(-1))
    return sum(losses) / windows.size(0), torch.cat(greedy)


def weights_study(model: GPT, comparison: Comparison, quantize: str, data: Optional[Path]) -> dict:
    """fp32, reduced-precision and int8 weights side by side: memory, greedy tokens/s, held-out loss, and agreement
    with fp32's greedy tokens."""
    windows, source = comparison.held_out  # the generation table's: one held-out loss for one set of weights
    greedy = dataclasses.replace(comparison.sampling, num_samples=1, temperature=0.0)
    rows, ref = {}, None
    for label, dtype, q in (("float32", "float32", ""), (comparison.reduced, comparison.reduced, ""),
                            (quantize, comparison.rt.dtype, quantize)):
        weights = for_inference(copy.deepcopy(model), comparison.rt.device, runtime.DTYPES[dtype], q)
        loss, tokens = held_out_loss(weights, windows)
        decoder = Decoder(weights, comparison.compile, dtype=runtime.DTYPES[dtype])
        sample, seconds, _ = draw_samples(decoder, comparison.prompt, Runtime(comparison.rt.device, dtype), greedy,
                                          True, full_warmup(weights, greedy))
        ref = ref or {"tokens": tokens, "sample": sample, "loss": loss}
        rows[label] = {"weight_bytes": weight_bytes(weights), "tokens_per_s": tokens_per_s(seconds, greedy),
                       "loss": loss, "perplexity": math.exp(loss), "loss_delta": loss - ref["loss"],
                       "top1_agreement": (tokens == ref["tokens"]).float().mean().item(),
                       "greedy_divergence": first_divergence(ref["sample"], sample)}
    return {"held_out": source, "held_out_tokens": windows[:, 1:].numel(), "rows": rows}


def print_weights_study(study: dict, comparison: Comparison) -> None:
    print(f"\n== weights: held-out loss on {study['held_out']}; agreement = "
          f"greedy token equal to fp32's, teacher-forced; greedy sample of {comparison.sampling.max_new_tokens} tokens")
    rows = [dict(r, weights=label, status="ok") for label, r in study["rows"].items()]
    print(format_table(rows, {
        "weights": lambda r: r["weights"], "MB": lambda r: f"{r['weight_bytes'] / 1e6:.2f}",
        "tok/s": lambda r: f"{r['tokens_per_s']:.1f}", "loss": lambda r: f"{r['loss']:.4f}",
        "d loss": lambda r: f"{r['loss_delta']:+.4f}", "ppl": lambda r: f"{r['perplexity']:.3f}",
        "agreement": lambda r: f"{r['top1_agreement']:.2%}", "greedy sample": lambda r: "= fp32"
        if r["greedy_divergence"] is None else f"differs at token {r['greedy_divergence']['token']}"}))


def compare(spec: str, model: GPT, tok: Tokenizer, rt: Runtime, sampling: Sampling, prompt: list[int],
            compile: bool, quantize: str = "", data: Optional[Path] = None) -> dict:
    """sample.py --compare=SPEC: every implementation asked for, then the summary tables; returns the numbers.
    With quantize, also the weights study, through the first implementation that ran."""
    comparison = Comparison(rt, reduced_dtype(rt), sampling, prompt, compile)
    names, skipped = resolve_compare(spec, comparison, model.config)
    report = run_compare(model, tok, comparison, names, skipped, data)
    print_comparison(comparison, report)
    if quantize:
        first = with_attn(model, next(iter(report["implementations"])), comparison.rt.torch_dtype)
        report["weights"] = weights_study(first, comparison, quantize, data)
        print_weights_study(report["weights"], comparison)
    return report
