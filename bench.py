"""
Time, memory and a kernel audit of every attention implementation, with the vocab padded and not: the table of
PyTorch's "Accelerating Large Language Models with Accelerated Transformers" post, on your own hardware.

    python bench.py                                        # training steps, every attn x padding off/on
    python bench.py --attn=manual,flash --seq_len=512 --batch_size=4
    python bench.py --max_batch=True                       # also the largest batch each row fits
    python bench.py --loss=chunked,whole                   # the chunked loss against the whole logits: memory, time
    python bench.py --dropout=0.1                          # watch sdpa leave the fused kernel (flagged "!")
    python bench.py --mode=attention                       # the attention op alone, over sequence lengths
    python bench.py --mode=attention --mask=causal,doc,window  # what documents and a window cost each kernel
    python bench.py --profile=True                         # also a chrome trace of one step per row
    python bench.py --mode=generate                        # generation: cache, compiled cache, bf16, int8

Writes a table to stdout, and <out_dir>/<mode>-<run>.json (every number and the environment) and <mode>-<run>.png,
under a name of this run's own (its start time and process).
Settings left at None are sized for the device (SIZES). Ratios within one run are what count: every timed
iteration visits all rows in turn, so drift and noisy neighbours hit them alike.
"""

if __name__ == "__main__":  # a Ctrl-C while the imports below load ends the process quietly (main handles its own)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import functools
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from core import flops
from core import writing
from core import runtime
from benchmarks.measure import AUDIT, audited_row, free_memory, max_batch_size, measure_calls, paired_speedup, progress
from core.configurator import PATH, SEED, Settings, as_list, comma_list_of, configure, one_of
from core import errors
from core.errors import UserError, problems_of
from attention.kernels import AttnCall, attention_pass, attention_problem
from benchmarks.bench_generate import CACHES, WEIGHTS, generate_sweep
from benchmarks.bench_masks import MASKS, block_documents, boundaries_per_block, fractions, mask_settings, row_mask
from benchmarks.bench_train import auto_rows, build_trainer, fits
from benchmarks.compare import attention_names
from benchmarks.bench_report import (ATTENTION_COLUMNS, GENERATE_COLUMNS, TRAIN_COLUMNS, chart, format_table,
                                     padding_note, unreliable)
from core.runtime import Runtime
from model import IMPLEMENTATIONS, GPTConfig, compiled_flex

# mode
mode = "train"            # "train": real training steps of a GPT; "attention": the attention op alone;
                          # "generate": greedy generation (bench_generate.py)
attn = None               # comma-separated implementations, or "all" (None: all; generate: GENERATE_SIZES)
padding = None            # vocab padding to a multiple of 64 (50257 -> 50304): "off", "on" or "off,on" (None: off,on;
                          # generate: off)
# model (None: sized for the device, see SIZES)
n_layer = None            # transformer blocks
n_head = None             # attention heads per block
n_embd = None             # the width; n_embd / n_head is the head size
vocab_size = None         # tokens in the vocabulary; padding rounds it up to a multiple of 64
dropout = 0.0             # > 0 shows the blog post's silent fallback: on CPU, sdpa's fused kernel refuses dropout
bias = True               # biases in Linear and LayerNorm, as GPT-2
loss = "chunked"          # train mode: "chunked" (model.ChunkedLMHeadLoss: never the whole logits), "whole" (the
                          # (B*T, V) logits and F.cross_entropy, nanoGPT's) or "chunked,whole": a row of each
# masks (bench_masks.py): a row per attn x mask; causal alone by default
mask = "causal"           # comma list of causal, doc (document-causal), window, doc+window
window = 256              # the window rows' sliding window, in tokens
doc_data = "shakespeare"  # the doc rows' documents: real end-of-text boundaries of this prepared dataset (or folder)
doc_len = 0               # > 0: documents of exactly doc_len tokens instead
# batch
batch_size = None         # sequences per step
seq_len = None            # tokens per sequence, also the model's block_size
# timing
warmup = 2                # untimed steps per row first: allocator, lazy optimizer state, compilation
iters = None              # timed steps per row, taken round-robin across rows
compile = False           # torch.compile each model (compilation happens in the warm-up, untimed)
auto = True               # train mode: an 'auto' row per padding and mask naming what attn=auto picks (attn_auto.py);
                          # its timing is that pick's own row's, not a second measurement
attn_auto_budget = 10.0   # seconds attn=auto may spend measuring a workload (a cached decision takes none)
attn_auto_refresh = False # measure again even when an earlier run decided the same workload
# max batch size search (train mode)
max_batch = False         # also find the largest batch that fits, per row: slow
mem_budget_gb = 2.0       # CPU only: the bound on one step's peak tensor memory; CUDA's bound is the GPU itself
max_batch_limit = 256     # the search stops here
# attention-only mode: q, k, v of (attn_batch, attn_heads, T, hs) for T in attn_seq_lens, hs in attn_head_sizes
attn_batch = None         # sequences per call
attn_heads = None         # heads per sequence
attn_seq_lens = None      # e.g. 512,1024,2048; None: the device's own list (GPU 512-4096, CPU 256-2048)
attn_head_sizes = None    # e.g. 64,128; None: the device's own (GPU 64,128, CPU 32,64)
# generate mode: new_tokens greedy tokens after a prompt of prompt_len, gen_batch sequences at once
prompt_len = 1            # tokens of prompt before the timed ones (prefilled)
new_tokens = None         # tokens generated per row, timed
gen_batch = 1             # sequences generated together
weights = None            # the weights' dtype per row: float32,bfloat16,int8 (int8 weight-only, torchao); None: sized
                          # for the device (a CPU gets bf16 rows only where its matmuls run bf16 in hardware:
                          # AMX, AVX512-BF16)
cache = "none,cache,compiled"      # none (nanoGPT's generate), the static KV cache, and that compiled
# system
device = "auto"           # auto, cpu, cuda, cuda:N, mps
dtype = "auto"            # auto, float32, bfloat16, float16: autocast in train mode, q/k/v's dtype in attention mode
threads = 0               # CPU threads; 0: OMP_NUM_THREADS if set, else torch's default (one per physical core)
seed = 1337               # weights, data and prompts: the same seed gives the same rows
# output
out_dir = "bench_results" # each run writes <mode>-<start>-<process>.json and .png (and traces) here
profile = False           # also write a chrome trace (chrome://tracing, TensorBoard) of one step per row

# the allowed range of every numeric setting (None: sized for the device)
LIMITS = {"n_layer": "[1, inf) int", "n_head": "[1, inf) int", "n_embd": "[1, inf) int",
          "vocab_size": "[1, inf) int", "dropout": "[0, 1)", "batch_size": "[1, inf) int", "seq_len": "[1, inf) int",
          "warmup": "[0, inf)", "iters": "[1, inf) int", "mem_budget_gb": "(0, inf)", "max_batch_limit": "[1, inf)",
          "attn_batch": "[1, inf) int", "attn_heads": "[1, inf) int", "threads": "[0, inf) int", "seed": SEED,
          "prompt_len": "[1, inf)", "new_tokens": "[1, inf) int", "gen_batch": "[1, inf)",
          "mode": one_of("train", "attention", "generate"),
          "padding": comma_list_of("off", "on"), "loss": comma_list_of("chunked", "whole"),
          "cache": comma_list_of(*CACHES), "weights": comma_list_of(*WEIGHTS),
          "dtype": one_of("auto", *runtime.DTYPES), "mask": comma_list_of(*MASKS), "window": "[1, inf)",
          "doc_len": "[0, inf)", "attn": comma_list_of("all", *IMPLEMENTATIONS), "attn_auto_budget": "(0, inf)",
          "out_dir": PATH}

# GPU: GPT-2 124M at its full context, as in PyTorch's post. CPU: attention's cost grows with T^2 while the rest of
# the model grows with T*C^2, so a long sequence in a narrow model shows the kernels' difference, and a vocabulary
# of 8191 (one short of 2^13, so padding has work to do: -> 8192) keeps lm_head and the loss from drowning it
# (with GPT-2's 50257 at n_embd 128 they take ~80% of a step); small enough for a few minutes on 2 cores.
SIZES = {
    "cuda": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, batch_size=8, seq_len=1024, iters=20,
                 attn_batch=8, attn_heads=12, attn_seq_lens="512,1024,2048,4096", attn_head_sizes="64,128"),
    "cpu": dict(n_layer=4, n_head=4, n_embd=128, vocab_size=8191, batch_size=1, seq_len=1024, iters=7,
                attn_batch=1, attn_heads=4, attn_seq_lens="256,512,1024,2048", attn_head_sizes="32,64"),
}

# Generation at batch 1 is bound by reading the weights. CPU: the size of nanoGPT's shakespeare_char recipe (6 x 384,
# block 256); GPU: GPT-2 124M. Few default rows, since each compiled one compiles once (docs/bench.md, "Generation").
GENERATE_SIZES = {
    "cuda": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, seq_len=1024, new_tokens=127, iters=3,
                 attn="sdpa", weights="bfloat16"),
    "cpu": dict(n_layer=6, n_head=6, n_embd=384, vocab_size=65, seq_len=256, new_tokens=127, iters=2,
                attn="manual,sdpa", weights="float32,int8"),
}

# -- settings ------------------------------------------------------------------------------------------

def resolve(cfg: Settings, found: dict | None = None) -> tuple[Settings, Runtime]:
    """Settings left at None sized for the device, device/dtype picked, comma lists split and checked; every problem
    (`found`: those of the settings already) in one report."""
    problems, named = list((found or {}).values()), set(found or {})

    def readable(*keys: str) -> bool:  # a check that reads a setting already named is left out
        return not named & set(keys)
    rt = Runtime("cpu", "float32")  # without a device to check against, the rest is checked as on a CPU
    if readable("device", "dtype", "threads"):
        try:
            rt = runtime.resolve_runtime(cfg.device, cfg.dtype, threads=cfg.threads)
        except UserError as e:
            problems.append(e)
    cfg.device, cfg.dtype = rt.device, rt.dtype
    generating = cfg.mode == "generate"
    sizes = (GENERATE_SIZES if generating else SIZES)["cuda" if rt.is_cuda else "cpu"]
    if generating and rt.device_type == "cpu" and runtime.bf16_native("cpu"):
        sizes = {**sizes, "weights": "float32,bfloat16,int8"}
    for key, value in {**SIZES["cuda" if rt.is_cuda else "cpu"], **sizes}.items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    if readable("attn"):
        problems += problems_of(lambda: setattr(cfg, "attn", attention_names(cfg.attn or "all")))
    for baseline in ("manual", "sdpa") if generating else ("manual",):  # what speedups are measured against
        if isinstance(cfg.attn, list) and baseline not in cfg.attn:
            cfg.attn.insert(0, baseline)
    if generating:
        cfg.weights, cfg.cache = as_list(cfg.weights), as_list(cfg.cache)  # checked against LIMITS' words
        if readable("prompt_len", "seq_len") and cfg.prompt_len + 1 > cfg.seq_len:
            problems.append(UserError(f"prompt_len={cfg.prompt_len} leaves no room in block_size (seq_len) "
                                      f"{cfg.seq_len}; use a shorter prompt."))
    cfg.mask = list(dict.fromkeys(as_list(cfg.mask)))  # checked against LIMITS' words
    words = as_list(cfg.padding or ("off" if generating else "off,on"))  # checked against LIMITS' words
    cfg.padding = [w == "on" for w in dict.fromkeys(words)]
    cfg.loss = list(dict.fromkeys(as_list(cfg.loss)))  # checked against LIMITS' words
    lengths_ok = readable("attn_seq_lens", "attn_head_sizes")
    for key in [k for k in ("attn_seq_lens", "attn_head_sizes") if readable(k)]:
        try:
            setattr(cfg, key, as_list(getattr(cfg, key), int))
            if not getattr(cfg, key) or min(getattr(cfg, key)) < 1:
                raise UserError(f"{key} must be positive whole numbers, comma-separated; got {getattr(cfg, key)!r}.")
        except UserError as e:
            problems, lengths_ok = problems + [e], False
    if any("doc" in m for m in cfg.mask) and cfg.mode != "generate" and lengths_ok and readable(
            "doc_data", "doc_len", "seq_len", "seed"):
        problems += problems_of(lambda: block_documents(  # a bad --doc_data is named before any row runs
            cfg.doc_data, cfg.doc_len, 1, cfg.seq_len if cfg.mode == "train" else max(cfg.attn_seq_lens), cfg.seed))
    if not readable("out_dir"):
        pass
    elif not cfg.out_dir.strip():  # Path("") is the working folder
        problems.append(UserError("out_dir is empty (an unset shell variable?); pass --out_dir= a folder name."))
    else:
        problems += problems_of(lambda: writing.check_writable_dir(Path(cfg.out_dir)))  # before the sweep
    if cfg.compile:
        problems += problems_of(runtime.check_compile_cache)
    errors.refuse_all(problems)
    return cfg, rt


# -- rows ------------------------------------------------------------------------------------------------

def trace_prefix(cfg: Settings, name: str) -> Optional[str]:
    """Where --profile=True writes each row's chrome trace: out_dir/trace_<name>_<row>.json."""
    return str(Path(cfg.out_dir) / f"trace_{name}") if cfg.profile else None


def compiled(fn, cfg: Settings):
    """fn compiled when cfg asks for it, with a recompile count of its own (see runtime.compile_isolated)."""
    return runtime.compile_isolated(fn) if cfg.compile else fn


def eager_reference(attn: str, problem: Optional[str], cfg: Settings, rt: Runtime) -> bool:
    """True for a flex row that runs (no `problem`) PyTorch's unfused eager reference: not compiled, and not on
    CUDA (where model.flex_causal_attention always compiles it)."""
    return problem is None and not cfg.compile and rt.device_type in AUDIT[attn].eager_reference.split()


# -- train mode ------------------------------------------------------------------------------------------

def row_key(attn: str, pad_vocab: bool, mask: str, loss: str = "chunked") -> str:
    """A training row's name (its trace file's too): manual_unpadded, flex_padded_doc+window, sdpa_padded_whole..."""
    return (f"{attn}_{'padded' if pad_vocab else 'unpadded'}" + ("" if mask == "causal" else f"_{mask}") +
            ("" if loss == "chunked" else f"_{loss}"))


def train_sweep(cfg: Settings, rt: Runtime, save=lambda rows: None) -> list[dict]:
    """One row per attn x padding x mask x loss: timing, tokens/s, MFU, peak memory, speedup, audited kernel, the
    share of the score matrix computed, skip reason. `save(rows)`: what is measured so far, before the max-batch
    search and after each row's."""
    head_size, tokens = cfg.n_embd // cfg.n_head, cfg.batch_size * cfg.seq_len
    rows, trainers, calls, audits = {}, {}, {}, {}
    for a, m, pad, loss in ((a, m, pad, loss) for a in cfg.attn for m in cfg.mask for pad in cfg.padding
                            for loss in cfg.loss):
        problem = attention_problem(a, AttnCall(rt.device_type, rt.torch_dtype, head_size, needs_grad=True,
                                                dropout_p=cfg.dropout, seq_len=cfg.seq_len, masked=m != "causal"),
                                    IMPLEMENTATIONS[a])
        key = row_key(a, pad, m, loss)
        vocab = GPTConfig(vocab_size=cfg.vocab_size, pad_vocab=pad).padded_vocab_size  # skipped rows' too
        rows[key] = dict(attn=a, pad_vocab=pad, vocab=vocab, mask=m, loss=loss, status="skipped" if problem else "ok",
                         eager_reference=eager_reference(a, problem, cfg, rt), reason=problem)
        if problem is None:
            if (pad, m, loss) not in trainers:
                trainers[pad, m, loss] = build_trainer(cfg, rt, a, pad, cfg.batch_size, m, loss)
            trainer = trainers[pad, m, loss]
            rows[key].update(vocab=trainer.model.config.padded_vocab_size,
                             **fractions(a, trainer.docs, trainer.model.config.window, cfg.seq_len, rt.device))
            if trainer.docs is not None:
                rows[key]["boundaries_per_block"] = boundaries_per_block(trainer.docs)
            calls[key] = functools.partial(trainer.step, a)
            audits[key] = functools.partial(trainer.eager_pass, a)
    peak = flops.peak_flops(rt)
    print(flops.peak_line(rt, peak), file=sys.stderr)
    # disable=None: no bar where stderr is a file or a pipe (there a bar's redraws pile up into one long line)
    with progress(len(calls) * (cfg.warmup + 1 + cfg.iters), "bench") as bar:
        measured = measure_calls(calls, rt, bar, cfg.warmup, cfg.iters, trace_prefix(cfg, "train"),
                                 audits if cfg.compile else None)
    for key, m in measured.items():
        row = audited_row(rows[key], m, rows[key]["attn"], rt)
        if row["status"] == "ok":
            trainer = trainers[row["pad_vocab"], row["mask"], row["loss"]]
            row["mem/peak_gb"] = (trainer.resident_bytes() + row.pop("added_bytes")) / 1e9
            row["tokens_per_s"] = tokens / (row["ms_per_iter"] / 1e3)
            row["mfu"] = peak and trainer.model.model_flops_utilization(row["tokens_per_s"], peak, cfg.seq_len)
    for row in rows.values():
        base = rows.get(row_key("manual", row["pad_vocab"], row["mask"], row["loss"]), {})
        if row["status"] == "ok" and base.get("status") == "ok":
            row["speedup_vs_manual"] = None if unreliable(base) else paired_speedup(base, row)
    if cfg.auto:  # what attn=auto would pick, beside the fastest row measured here
        rows.update({f"auto_{r['pad_vocab']}_{r['mask']}_{r['loss']}": r for r in auto_rows(rows, trainers, cfg, rt)})
    calls.clear(), audits.clear(), trainers.clear()  # the max-batch search below needs the memory
    free_memory(rt)
    if cfg.max_batch:  # slow: the timed rows are kept first, then each row's search as it ends, printed in one line
        save(list(rows.values()))
        for row in [r for r in rows.values() if r["status"] == "ok" and r["attn"] != "auto"]:
            row["max_batch"] = max_batch_size(
                lambda b: fits(cfg, rt, row["attn"], row["pad_vocab"], b, row["mask"], row["loss"]),
                cfg.max_batch_limit)
            save(list(rows.values()))
            print(f"max batch: {row_key(row['attn'], row['pad_vocab'], row['mask'], row['loss'])} fits "
                  f"{row['max_batch']}", file=sys.stderr, flush=True)
    return list(rows.values())


# -- attention-only mode -----------------------------------------------------------------------------------

def attention_sweep(cfg: Settings, rt: Runtime) -> list[dict]:
    """One row per head size x sequence length x pass (fwd, fwd+bwd) x mask x attn: time, added memory, kernel, the
    share of the score matrix computed. Each row's mask is built before it is timed: this times the kernel."""
    cases = [(hs, T, bwd, m) for hs in cfg.attn_head_sizes for T in cfg.attn_seq_lens for bwd in (False, True)
             for m in cfg.mask]
    rows = []
    total = len(cases) * len(cfg.attn) * (cfg.warmup + 1 + cfg.iters)
    with progress(total, "attention") as bar:
        for hs, T, backward, mask in cases:
            shape = (cfg.attn_batch, cfg.attn_heads, T, hs)  # (B, nh, T, hs)
            q, k, v = (torch.randn(shape, device=rt.device, dtype=rt.torch_dtype, requires_grad=backward)
                       for _ in range(3))
            doc_mask, window = mask_settings(mask, cfg.window)
            docs = block_documents(cfg.doc_data, cfg.doc_len, cfg.attn_batch, T, cfg.seed) if doc_mask else None
            here, calls, audits = {}, {}, {}
            # every case compiles afresh, each attn apart, with a full recompile budget: one compiled callable over
            # every head size, length, pass and mask would pass its limit and run the later rows eagerly
            compiled_flex.cache_clear()
            functions = {a: compiled(IMPLEMENTATIONS[a].fn, cfg) for a in cfg.attn}
            for a in cfg.attn:
                problem = attention_problem(a, AttnCall(rt.device_type, rt.torch_dtype, hs, needs_grad=backward,
                                                        dropout_p=cfg.dropout, seq_len=T, masked=mask != "causal"),
                                            IMPLEMENTATIONS[a])
                here[a] = dict(attn=a, head_size=hs, seq_len=T, backward=backward, mask=mask,
                               eager_reference=eager_reference(a, problem, cfg, rt),
                               status="skipped" if problem else "ok", reason=problem)
                if problem is None:
                    here[a].update(fractions(a, docs, window, T, rt.device))
                    if docs is not None:
                        here[a]["boundaries_per_block"] = boundaries_per_block(docs)
                    masking = row_mask(a, docs, window, cfg.attn_batch, T, rt.device)  # None: causal
                    calls[a] = attention_pass(functions[a], q, k, v, masking, cfg.dropout, backward)
                    audits[a] = attention_pass(IMPLEMENTATIONS[a], q, k, v, masking, cfg.dropout, backward)
                else:
                    bar.update(cfg.warmup + 1 + cfg.iters)
            name = f"attention_hs{hs}_T{T}_{'fwdbwd' if backward else 'fwd'}" + ("" if mask == "causal" else f"_{mask}")
            measured = measure_calls(calls, rt, bar, cfg.warmup, cfg.iters, trace_prefix(cfg, name),
                                     audits if cfg.compile else None)
            for a, m in measured.items():
                audited_row(here[a], m, a, rt)
                if here[a]["status"] == "ok":
                    here[a]["mem/peak_gb"] = here[a].pop("added_bytes") / 1e9  # beyond q, k, v themselves
            for row in here.values():
                if row["status"] == "ok" and here["manual"]["status"] == "ok":
                    row["speedup_vs_manual"] = None if unreliable(here["manual"]) else paired_speedup(here["manual"],
                                                                                                        row)
            rows += list(here.values())
    return rows


# Seconds one compiled generate row spends compiling, as measured (docs/bench.md): the plan line multiplies it out.
GENERATE_COMPILE_S = {"cuda": (7, 60), "cpu": (20, 60)}


def sweep_plan(cfg: Settings, rt: Runtime) -> str:
    """One line on what the sweep will run, printed before it starts; for generation, how long its compiling takes."""
    if cfg.mode == "generate":
        rows = len(cfg.attn) * len(cfg.weights) * len(cfg.cache) * len(cfg.padding)
        compiled = rows // len(cfg.cache) if "compiled" in cfg.cache else 0
        low, high = GENERATE_COMPILE_S["cuda" if rt.is_cuda else "cpu"]
        where = "an H200 at GPT-2 124M" if rt.is_cuda else "2 CPU cores at 6 x 384, nanoGPT's shakespeare_char size"
        return (f"generate: {rows} rows, {compiled} of them compiled, {cfg.iters} timed rounds of {cfg.new_tokens} "
                f"tokens; each compiled row compiles once ({low}-{high} s on {where}), so compiling alone takes about "
                f"{compiled * low / 60:.1f}-{compiled * high / 60:.1f} min; rows are saved to {cfg.out_dir} as they "
                f"finish")
    rows = len(cfg.attn) * len(cfg.mask) * (len(cfg.padding) * len(cfg.loss) if cfg.mode == "train" else
                                            2 * len(cfg.attn_seq_lens) * len(cfg.attn_head_sizes))
    return (f"{cfg.mode}: {rows} rows; each that runs here takes {cfg.warmup} warm-up + 1 profiled + {cfg.iters} timed "
            f"runs (the progress counts them), the others are listed with the reason")


RUNS = itertools.count()  # runs of this process (main called in process more than once)


def environment(rt: Runtime, argv: list[str]) -> dict:
    return dict(device=rt.device, device_name=rt.name, torch=torch.__version__,
                cuda=torch.version.cuda if rt.is_cuda else None, dtype=rt.dtype,
                threads=torch.get_num_threads(), peak_flops=flops.peak_flops(rt),
                python=platform.python_version(), platform=platform.platform(),
                command=" ".join(["python", "bench.py", *argv]), time=time.strftime("%Y-%m-%d %H:%M:%S"),
                run=f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(RUNS)}")  # this run's own name


def settings(argv: list[str]) -> tuple[Settings, Runtime]:
    """This module's settings with config files and --key=value overrides applied, resolved for the device."""
    found: dict = {}
    return resolve(configure(globals(), argv, LIMITS, found), found)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg, rt = settings(argv)
    out = Path(cfg.out_dir)
    env = environment(rt, argv)
    path = out / f"{cfg.mode}-{env['run']}.json"  # this run's own name: runs into one folder each keep theirs

    def save(rows: list[dict], complete: bool = False) -> None:  # completely or not at all: an earlier save stays
        with writing.staged_outputs(out, [path.name], what=f"the results to {path}") as tmp:
            tmp[path.name].write_text(json.dumps(dict(environment=env, config=cfg.as_dict(), complete=complete,
                                                      rows=rows), indent=1))
    print(sweep_plan(cfg, rt), file=sys.stderr)
    try:
        if cfg.mode == "generate":
            rows = generate_sweep(cfg, rt, save)  # saved as rows finish: an interrupted sweep keeps them
        else:
            rows = train_sweep(cfg, rt, save) if cfg.mode == "train" else attention_sweep(cfg, rt)
    except KeyboardInterrupt:
        kept = f"; what was measured is in {path}" if path.exists() else ""
        print(f"interrupted{kept}", file=sys.stderr)
        return 130
    columns = {"train": TRAIN_COLUMNS, "attention": ATTENTION_COLUMNS, "generate": GENERATE_COLUMNS}[cfg.mode]
    if not cfg.max_batch:
        columns = {k: v for k, v in columns.items() if k != "max batch"}
    if cfg.mask == ["causal"]:  # the table as it was before masks
        columns = {k: v for k, v in columns.items() if k not in ("mask", "computed")}
    save(rows, complete=True)  # before anything is printed: a closed stdout (| head) loses nothing measured
    chart(path.with_suffix(".png"), rows, cfg, env)
    print(f"{env['device_name']}, torch {env['torch']}, {cfg.dtype}: {env['command']}")
    print(format_table(rows, columns))
    fallbacks = {(r["attn"], r["kernel"], ", ".join(r["kernel_ops"]) or "no SDPA op", " or ".join(r["kernel_expected"]))
                 for r in rows if r["status"] == "ok" and not r["kernel_ok"]}  # one line per message, not per row
    for attn, kernel, ops, expected in sorted(fallbacks):
        print(f"! {attn} ran {kernel} ({ops}), not {expected}: a fused kernel refused these settings and PyTorch fell "
              f"back without a word (dropout, a mask, the dtype or the head size)")
    if cfg.mode == "train" and len(cfg.padding) == 2:
        errors.note(padding_note(rows))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    runtime.run_main(main)
