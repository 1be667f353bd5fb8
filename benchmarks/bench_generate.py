"""
bench.py --mode=generate: implementation x cache (none, static, compiled) x weights (fp32, bf16, int8), the same
greedy tokens from the same prompt. The baseline is nanoGPT's generate: sdpa, no cache, fp32 weights.

    python bench.py --mode=generate --attn=all --weights=float32,int8 --cache=none,compiled
"""

import copy
import functools
import math
import time
from collections import Counter
from typing import Callable, Optional

import numpy as np
import torch

from attention.kernels import AttnCall, attention_problem
from core.errors import UserError
from engine.generate import Decoder, for_inference
from engine.generate import weight_bytes
from benchmarks.measure import audit as audit_kernel
from benchmarks.measure import (AUDIT, compile_health, counted, kernel_context, out_of_memory, paired_speedup,
                                profiled_run, summarize, time_round_robin)
from benchmarks.measure import progress as progress_bar
from attention.masks import decode_keys
from model import IMPLEMENTATIONS, GPT, GPTConfig
from core.runtime import Runtime
from core import files, runtime, writing

CACHES = {"none": "no cache", "cache": "cache", "compiled": "compiled cache"}
WEIGHTS = ("float32", "bfloat16", "int8")


def weights_dtype(weights: str, rt: Runtime) -> tuple[torch.dtype, str]:
    """The dtype a row's weights and activations have, and its quantization. int8 is weight-only: activations
    in fp32 on CPU (no bf16 matmul units here), bf16 on CUDA."""
    if weights == "int8":
        return (torch.bfloat16 if rt.is_cuda else torch.float32), "int8"
    return runtime.DTYPES[weights], ""


class Row:
    """One attn x weights x cache combination: its decoder and the calls that are timed."""

    def __init__(self, model: GPT, cache: str, prompt: torch.Tensor, new_tokens: int):
        self.model, self.cache, self.prompt, self.new_tokens = model, cache, prompt, new_tokens
        self.decoder = Decoder(model, compile=cache == "compiled")

    def generation(self, tokens: int) -> Callable[[], torch.Tensor]:
        return functools.partial(self.decoder.generate, self.prompt, tokens, 0.0, None, None, self.cache != "none")


def build_rows(cfg, rt: Runtime, pad: bool) -> tuple[dict[str, dict], dict[str, Row]]:
    """Row descriptions (skipped ones with the reason) and the runnable rows, keyed attn/weights/cache/padding."""
    torch.manual_seed(cfg.seed)
    base = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                         block_size=cfg.seq_len, pad_vocab=pad)).eval()
    prompt = torch.randint(0, cfg.vocab_size, (cfg.gen_batch, cfg.prompt_len),
                           generator=torch.Generator().manual_seed(cfg.seed)).to(rt.device)  # (B, prompt_len)
    described, runnable = {}, {}
    for attn in cfg.attn:
        for weights in cfg.weights:
            dtype, quantize = weights_dtype(weights, rt)
            call = AttnCall(rt.device_type, dtype, cfg.n_embd // cfg.n_head, seq_len=cfg.seq_len)
            problem = attention_problem(attn, call, IMPLEMENTATIONS[attn])
            model = None
            try:  # int8 without torchao: its rows are skipped with its error line, the others run
                model = None if problem else for_inference(copy.deepcopy(base).set_attention(attn, dtype=dtype),
                                                           rt.device, dtype, quantize)
            except UserError as e:
                problem = str(e)
            for cache in cfg.cache:
                key = f"{attn}/{weights}/{cache}/{'padded' if pad else 'unpadded'}"
                described[key] = dict(attn=attn, weights=weights, cache=cache, pad_vocab=pad,
                                      vocab=base.config.padded_vocab_size, status="ok", reason=None)
                try:
                    if problem:
                        raise UserError(problem)
                    runnable[key] = Row(model, cache, prompt, cfg.new_tokens)
                except UserError as e:  # the kernel cannot run here, or cannot decode compiled (no mask)
                    described[key].update(status="skipped", reason=str(e))
    return described, runnable


def first_calls(rows: dict[str, Row], described: dict[str, dict], rt: Runtime, bar, save,
                tallies: dict[str, Counter]) -> dict[str, float]:
    """Each row's first full generation (it compiles the compiled rows): its tokens and seconds, and what dynamo did
    (graphs, breaks, recompile-limit hits), recorded and saved as each row finishes."""
    seconds = {}
    for key, row in rows.items():
        try:
            tokens, seconds[key] = runtime.time_call(counted(row.generation(row.new_tokens), tallies[key]), rt)
            described[key].update(tokens=tokens[:, row.prompt.size(1):].tolist(), first_call_s=seconds[key],
                                  **compile_health(tallies[key]))
        except Exception as e:
            described[key].update(status="oom", reason=out_of_memory(e, rt))
        bar.update()
        save()
    return seconds


def audit_generation(rows: dict[str, Row], described: dict[str, dict], rt: Runtime, bar) -> None:
    """Memory added during one generation and the attention kernel that ran (compiled rows: their eager twin,
    the same model with the cache, since inductor generates or decomposes the kernel in compiled code)."""
    for key, row in rows.items():
        if described[key]["status"] != "ok":
            continue
        ran_ops, added = profiled_run(row.generation(row.new_tokens), rt)
        twin = Row(row.model, "cache", row.prompt, row.new_tokens) if row.cache == "compiled" else row
        ops, _ = profiled_run(twin.generation(min(8, row.new_tokens)), rt)
        d = described[key]
        # eager flex off CUDA is PyTorch's unfused reference, run as such; compiled or on CUDA it is a fallback
        d["eager_reference"] = (rt.device_type in AUDIT[d["attn"]].eager_reference.split()
                                and row.cache != "compiled")
        d.update(audit_kernel(ops, ran_ops, d["attn"], rt.device_type, d["eager_reference"],
                              d.get("recompile_limit_hits", 0), generation=True),
                 weight_bytes=weight_bytes(row.model), kv_cache_bytes=row.model.cache_bytes() if row.cache != "none"
                 else 0, kernel_audit="eager twin" if row.cache == "compiled" else "this run", **kernel_context(rt))
        d["mem/peak_gb"] = (d["weight_bytes"] + d["kv_cache_bytes"] + added) / 1e9
        d["bytes_per_step"] = d["weight_bytes"] + kv_read_per_step(row, d["kv_cache_bytes"])
        bar.update()
    # the read bandwidth at each row's footprint, largest first: a smaller one is never judged against less
    for d in sorted((d for d in described.values() if "bytes_per_step" in d), key=lambda d: -d["bytes_per_step"]):
        d["bandwidth_gb_s"] = (memory_bandwidth(rt, d["bytes_per_step"]) or float("nan")) / 1e9


def kv_read_per_step(row: Row, kv_cache_bytes: int) -> float:
    """Bytes of keys and values a decode step reads, on average over the row's steps: the whole cache when compiled
    (one shape), else the cache positions an eager step reads (attention/masks.py's decode_keys); none without a
    cache."""
    cfg = row.model.config
    if row.cache != "compiled" and kv_cache_bytes:
        ends = range(row.prompt.size(1) + 1, min(row.prompt.size(1) + row.new_tokens, cfg.block_size) + 1)
        read = [hi - lo for _, lo, hi in (decode_keys(end, cfg.window, cfg.block_size) for end in ends)]
        return kv_cache_bytes * sum(read) / max(1, len(read)) / cfg.block_size
    return kv_cache_bytes


def generate_sweep(cfg, rt: Runtime, save=lambda rows: None) -> list[dict]:
    """One row per attn x weights x cache (x padding): speed, memory, kernel, agreement with no cache and speed over
    nanoGPT's way. `save(rows)` is called whenever a row has something new, so an interrupted sweep keeps it."""
    out = []
    for pad in cfg.padding:
        described, rows = build_rows(cfg, rt, pad)
        progress = lambda: save(out + list(described.values()))  # noqa: E731
        calls, tallies = {}, {key: Counter() for key in rows}
        for key, row in rows.items():  # what dynamo does during a row's calls is counted: a fallback shows
            calls[key] = counted(row.generation(row.new_tokens), tallies[key])
            calls[key + "#prefill"] = counted(row.generation(1), tallies[key])  # the prompt, and one token drawn
        with progress_bar(len(rows) * 2 + len(calls) * cfg.iters, "generate") as bar:
            first = first_calls(rows, described, rt, bar, progress, tallies)
            audit_generation(rows, described, rt, bar)
            progress()
            failed = {k: d["reason"] for k, d in described.items() if d["status"] == "oom"}
            failed.update({k + "#prefill": r for k, r in failed.items()})

            def timed_round(ms: dict[str, list[float]]) -> None:
                add_timings(described, rows, ms, first, cfg)
                for key in rows:
                    described[key].update(compile_health(tallies[key]))
                mark_against_baselines(described, cfg, pad)
                progress()
            time_round_robin(calls, cfg.iters, rt, bar, failed, timed_round)
        out += list(described.values())
    return out


def add_timings(described: dict[str, dict], rows: dict[str, Row], ms: dict[str, list[float]], first: dict,
                cfg) -> None:
    """Each row's timing over the rounds timed so far."""
    for key, row in rows.items():
        d = described[key]
        if d["status"] != "ok" or not ms.get(key) or not ms.get(key + "#prefill"):
            continue
        total, prefill = summarize(ms[key]), summarize(ms[key + "#prefill"])
        d.update(ms_all=list(ms[key]), ms_per_call=total["median"], ms_p25=total["p25"], ms_p75=total["p75"],
                 prefill_ms=prefill["median"], rounds=len(ms[key]),
                 ms_per_token=(total["median"] - prefill["median"]) / max(1, cfg.new_tokens - 1),
                 tokens_per_s=cfg.gen_batch * cfg.new_tokens / (total["median"] / 1e3),
                 compile_s=first[key] - total["median"] / 1e3 if row.cache == "compiled" else None)
        if "bytes_per_step" in d:  # the roofline: every weight (and the keys seen) read once per decode step
            d["gb_per_s"] = d["bytes_per_step"] / d["ms_per_token"] / 1e6 if d["ms_per_token"] > 0 else float("nan")
            d["bandwidth_share"] = d["gb_per_s"] / d["bandwidth_gb_s"]


def mark_against_baselines(described: dict[str, dict], cfg, pad: bool) -> None:
    """Speed over nanoGPT's generate (sdpa, no cache, fp32 weights; the sweep's first weights when it has no fp32
    rows), and whether each row drew the tokens its own no-cache row (same attn, same weights) drew."""
    suffix = "padded" if pad else "unpadded"
    weights = "float32" if "float32" in cfg.weights else cfg.weights[0]
    base = described.get(f"sdpa/{weights}/none/{suffix}", {})
    for d in described.values():
        if d["status"] != "ok" or "ms_all" not in d:
            continue
        if base.get("status") == "ok" and "ms_all" in base:
            d["speedup_vs_nanogpt"] = paired_speedup(base, d)
        plain = described.get(f"{d['attn']}/{d['weights']}/none/{suffix}", {})
        d["same_tokens_as_no_cache"] = plain.get("tokens") == d["tokens"] if "tokens" in plain else None




def generate_chart(ax, rows: list[dict], cfg) -> str:
    """Tokens/s per attn x weights, one bar per cache mode, on a linear axis from zero (a bar's height is its speed)
    with each bar's value written on it; returns the title."""
    ok = [r for r in rows if r["status"] == "ok" and "tokens_per_s" in r and r["pad_vocab"] == cfg.padding[0]]
    groups = list(dict.fromkeys(f"{r['attn']}\n{r['weights']}" for r in ok))
    ax.figure.set_size_inches(max(6.0, 0.3 * len(groups) * len(cfg.cache)), 4)
    width = 0.8 / max(1, len(cfg.cache))
    for i, cache in enumerate(cfg.cache):
        by_group = {f"{r['attn']}\n{r['weights']}": r["tokens_per_s"] for r in ok if r["cache"] == cache}
        xs = np.arange(len(groups)) + (i - (len(cfg.cache) - 1) / 2) * width
        values = [by_group.get(g, np.nan) for g in groups]
        drawn = ax.bar(xs, values, width, label=CACHES[cache])
        ax.bar_label(drawn, labels=["" if v != v else f"{v:,.0f}" if v >= 10 else f"{v:.2g}" for v in values],
                     padding=2, fontsize=6, rotation=90)
    ax.set_xticks(np.arange(len(groups)), groups, fontsize=7)
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.3)  # headroom for the labels and the legend
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylabel("tokens/s (median; higher is better)")
    return (f"{cfg.n_layer} layers, n_embd {cfg.n_embd}, block {cfg.seq_len}: {cfg.new_tokens} new tokens after "
            f"{cfg.prompt_len}, batch {cfg.gen_batch}, greedy")


# -- memory bandwidth: the roofline of batch-1 decoding, which reads every weight once per token ------------------

# a reading counts only if this process had the cores to itself: its threads' CPU time at least this share of wall
# time x threads (another busy process on 2 cores leaves ~0.5)
CORES_TO_ITSELF = 0.9


def memory_bandwidth(rt: Runtime, nbytes: int, repeats: int = 5) -> Optional[float]:
    """Bytes/s this machine reads streaming over a buffer of about `nbytes` (a footprint the caches hold reads faster
    than one they do not): the best ever measured with the cores to itself, kept in the cache folder's
    bandwidth.json."""
    return measured_bandwidth(rt, 2 ** max(20, math.ceil(math.log2(max(nbytes, 1)))), repeats)  # 1 MiB at least


def bandwidth_key(rt: Runtime, size: int) -> str:
    return f"{rt.name}, {size >> 20} MiB, torch {torch.__version__}"


@functools.lru_cache(maxsize=None)
def measured_bandwidth(rt: Runtime, size: int, repeats: int) -> Optional[float]:
    """memory_bandwidth at a power-of-two size, measured once per process (a sweep's rows share it). Never below what
    a larger footprint was read at here: fewer bytes read no slower, so a lower reading is the measurement's own
    overhead or a busy moment, and every row's share is judged against the same ceiling or a higher one."""
    cache, key = files.cache_folder() / "bandwidth.json", bandwidth_key(rt, size)
    known = files.read_cache(cache, lambda v: isinstance(v, float) and math.isfinite(v) and v > 0, "a positive number")
    measured = best_read_rate(rt, size, repeats)
    if measured is not None and measured > known.get(key, 0.0):
        known[key] = measured
        writing.write_cache(cache, known)
    keys = [bandwidth_key(rt, size << i) for i in range(16)]  # this size and larger ones, up to 32,768 times it
    return max((known[k] for k in keys if k in known), default=None)


def cpu_share(cpu_seconds: float, wall_seconds: float) -> float:
    """The share of torch's threads' time this process ran: 1 with the cores to itself, ~0.5 beside one other busy
    process per core."""
    return cpu_seconds / (wall_seconds * torch.get_num_threads())


def best_read_rate(rt: Runtime, size: int, repeats: int) -> Optional[float]:
    """The best bytes/s of `repeats` rounds of reading `size` bytes, two ways (a sum, and the batch-1 matmul that
    decoding does), among the rounds run with the cores to itself; None if none was."""
    rows, passes = 4096, max(1, 2 ** 26 // size)  # a small buffer read again and again: a round of 64 MiB or more
    data = torch.ones(rows, size // 4 // rows, device=rt.device)  # fp32: (rows, size / rows / 4)
    x = torch.ones(1, rows, device=rt.device)
    rates = []
    for one in (lambda: data.sum(), lambda: x @ data):
        def read(one=one):
            for _ in range(passes):
                one()
        read()  # the first call includes setup
        for _ in range(repeats):
            cpu = time.process_time()
            _, seconds = runtime.time_call(read, rt)
            if rt.is_cuda or cpu_share(time.process_time() - cpu, seconds) >= CORES_TO_ITSELF:
                rates.append(size * passes / seconds)
    return max(rates, default=None)
