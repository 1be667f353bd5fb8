"""
Time, memory and a kernel audit of every attention implementation, with the vocab padded and not: the table of
PyTorch's "Accelerating Large Language Models with Accelerated Transformers" post, on your own hardware.

    python bench.py                                        # training steps, every attn x padding off/on
    python bench.py --attn=manual,flash --seq_len=512 --batch_size=4
    python bench.py --max_batch=True                       # also the largest batch each row fits
    python bench.py --dropout=0.1                          # watch sdpa leave the fused kernel (flagged "!")
    python bench.py --mode=attention                       # the attention op alone, over sequence lengths
    python bench.py --profile=True                         # also a chrome trace of one step per row

Writes a table to stdout, and <out_dir>/<mode>.json (every number and the environment) and <mode>.png.
Settings left at None are sized for the device (SIZES). Ratios within one run are what count: every timed
iteration visits all rows in turn, so drift and noisy neighbours hit them alike.
"""

import gc
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import profiler
from torch.autograd import DeviceType
from tqdm import tqdm

import configurator
import runtime
from model import ATTENTION, GPT, GPTConfig, UserError, attention_names, attention_problem

# mode
mode = "train"            # "train": real training steps of a GPT; "attention": the attention op alone
attn = "all"              # comma-separated keys of model.ATTENTION, or "all"
padding = "off,on"        # vocab padding to a multiple of 64 (50257 -> 50304): "off", "on" or "off,on"
# model (None: sized for the device, see SIZES)
n_layer = None
n_head = None
n_embd = None
vocab_size = None         # tokens in the vocabulary; padding rounds it up to a multiple of 64
dropout = 0.0             # > 0 shows the post's silent fallback: on CPU, sdpa's fused kernel refuses dropout
bias = True
# batch
batch_size = None         # sequences per step
seq_len = None            # tokens per sequence, also the model's block_size
# timing
warmup = 2                # untimed steps per row first: allocator, lazy optimizer state, compilation
iters = None              # timed steps per row, taken round-robin across rows
compile = False           # torch.compile each model (compilation happens in the warm-up, untimed)
# max batch size search (train mode)
max_batch = False         # also find the largest batch that fits, per row: slow
mem_budget_gb = 2.0       # CPU only: the bound on one step's peak tensor memory; CUDA's bound is the GPU itself
max_batch_limit = 256     # the search stops here
# attention-only mode: q, k, v of (attn_batch, attn_heads, T, hs) for T in attn_seq_lens, hs in attn_head_sizes
attn_batch = None
attn_heads = None
attn_seq_lens = None      # e.g. 512,1024,2048
attn_head_sizes = None    # e.g. 64,128
# system
device = "auto"           # auto, cpu, cuda, cuda:N, mps
dtype = "auto"            # auto, float32, bfloat16, float16: autocast in train mode, q/k/v's dtype in attention mode
threads = 0               # CPU threads for PyTorch; 0 keeps its default (one per core). On a shared machine, 1
                          # stops threads waiting on a descheduled sibling at every op
seed = 1337
# output
out_dir = "bench_results"
profile = False           # also write a chrome trace (chrome://tracing, TensorBoard) of one step per row

# the allowed range of every numeric setting (None: sized for the device)
LIMITS = {"n_layer": "[1, inf)", "n_head": "[1, inf)", "n_embd": "[1, inf)", "vocab_size": "[1, inf)",
          "dropout": "[0, 1)", "batch_size": "[1, inf)", "seq_len": "[1, inf)", "warmup": "[0, inf)",
          "iters": "[1, inf)", "mem_budget_gb": "(0, inf)", "max_batch_limit": "[1, inf)", "attn_batch": "[1, inf)",
          "attn_heads": "[1, inf)", "threads": "[0, inf)", "seed": "[0, inf)"}

# GPU: GPT-2 124M at its full context, as in the post. CPU: attention's cost grows with T^2 while the rest of
# the model grows with T*C^2, so a long sequence in a narrow model shows the kernels' difference, and a vocabulary
# of 8191 (one short of 2^13, so padding has work to do: -> 8192) keeps lm_head and the loss from drowning it
# (with GPT-2's 50257 at n_embd 128 they take ~80% of a step); small enough for a few minutes on 2 cores.
SIZES = {
    "cuda": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, batch_size=8, seq_len=1024, iters=20,
                 attn_batch=8, attn_heads=12, attn_seq_lens="512,1024,2048,4096", attn_head_sizes="64,128"),
    "cpu": dict(n_layer=4, n_head=4, n_embd=128, vocab_size=8191, batch_size=1, seq_len=1024, iters=7,
                attn_batch=1, attn_heads=4, attn_seq_lens="256,512,1024,2048", attn_head_sizes="32,64"),
}

# The op that names the kernel SDPA dispatched to (forward; the backward ops mirror them), and flex's autograd op.
KERNEL_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math",
    "FlexAttentionAutogradOp": "flex",
}
FUSED = {"flash", "efficient", "cudnn"}


def expected_kernels(attn: str, device_type: str) -> set[str]:
    """The kernels an honest run of `attn` may show in the audit; anything else is a silent fallback."""
    if attn == "manual":
        return {"none"}  # no SDPA op at all: bmm, masked_fill, softmax
    if attn == "sdpa_mask":
        return FUSED | {"math"}  # the generic row: the mask leaves the choice to PyTorch
    if attn == "sdpa":  # PyTorch picks by priority; on CPU the only fused kernel is flash
        return FUSED if device_type == "cuda" else {"flash"}
    return {attn}  # flash, efficient, cudnn, math, flex: forced


def audit(op_names: set[str]) -> tuple[str, list[str]]:
    """The attention kernel among the ops that ran: a label ('none' if no SDPA/flex op ran) and the op names."""
    ops = sorted(name for name in op_names if name in KERNEL_OPS)
    return "+".join(sorted({KERNEL_OPS[op] for op in ops})) or "none", ops


# -- settings ------------------------------------------------------------------------------------------

def as_list(value, cast=str) -> list:
    """A comma list from the command line: 'a,b', (512, 1024) (what --x=512,1024 parses to) or one value."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    try:
        return [cast(str(item).strip()) for item in items if str(item).strip()]
    except ValueError:
        raise UserError(f"cannot read {value!r} as a comma-separated list of {cast.__name__}.") from None


def resolve(cfg: dict) -> dict:
    """Settings left at None sized for the device, device/dtype picked, comma lists split and checked."""
    cfg = dict(cfg)
    cfg["device"] = runtime.pick_device(cfg["device"])
    cfg["dtype"] = runtime.pick_dtype(cfg["dtype"], cfg["device"])
    for key, value in SIZES["cuda" if cfg["device"].startswith("cuda") else "cpu"].items():
        cfg[key] = value if cfg[key] is None else cfg[key]
        if isinstance(value, int) and type(cfg[key]) is not int:  # LIMITS checked the range already
            raise UserError(f"{key} must be a whole number, got {cfg[key]!r}.")
    if cfg["mode"] not in ("train", "attention"):
        raise UserError(f"mode must be 'train' or 'attention', got '{cfg['mode']}'.")
    cfg["attn"] = attention_names(cfg["attn"])
    if "manual" not in cfg["attn"]:
        cfg["attn"].insert(0, "manual")  # the baseline every speedup is measured against
    words = as_list(cfg["padding"])
    if not words or set(words) - {"off", "on"}:
        raise UserError(f"padding must be off, on or off,on; got '{cfg['padding']}'.")
    cfg["padding"] = [w == "on" for w in dict.fromkeys(words)]
    for key in ("attn_seq_lens", "attn_head_sizes"):
        cfg[key] = as_list(cfg[key], int)
        if not cfg[key] or min(cfg[key]) < 1:
            raise UserError(f"{key} must be positive whole numbers, comma-separated; got {cfg[key]!r}.")
    return cfg


# -- measuring -----------------------------------------------------------------------------------------

def cpu_peak_bytes(prof: profiler.profile) -> int:
    """The most tensor bytes live at once during a profiled region, beyond those live when it began.
    With profile_memory=True the profiler records every allocation (+bytes) and free (-bytes); their running
    sum in time order is the live tensor memory, the CPU twin of CUDA's max_memory_allocated. The process's
    peak RSS would not do: it only grows, and it counts the allocator's caches, Python and the libraries.
    (Frees of blocks allocated before the region are not recorded, so this can only err upwards.)"""
    records = [e for e in prof.profiler.kineto_results.events()  # the raw records; prof.events() merges them
               if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    live = peak = 0
    for record in sorted(records, key=lambda e: e.start_ns()):
        live += record.nbytes()
        peak = max(peak, live)
    return peak


def profiled_run(call: Callable[[], None], device: str, trace: Optional[Path] = None) -> tuple[set[str], int]:
    """Run `call` once under torch.profiler: (names of the ops it ran, the most tensor bytes it added)."""
    cuda = device.startswith("cuda")
    activities = [profiler.ProfilerActivity.CPU] + ([profiler.ProfilerActivity.CUDA] if cuda else [])
    runtime.synchronize(device)
    runtime.reset_peak_memory(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    with profiler.profile(activities=activities, profile_memory=not cuda) as prof:
        call()
        runtime.synchronize(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    added = round(runtime.peak_memory_gb(device) * 1e9) - before if cuda else cpu_peak_bytes(prof)
    return {e.name() for e in prof.profiler.kineto_results.events()}, added


def time_round_robin(calls: dict, iters: int, device: str, bar: tqdm) -> dict[str, list[float]]:
    """Milliseconds of each call, `iters` times: every iteration runs all calls in turn (starting one further
    along each time), so drift and neighbours' load hit them alike. The device is synchronized around each."""
    keys, ms = list(calls), {key: [] for key in calls}
    for i in range(iters):
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            runtime.synchronize(device)
            t0 = time.perf_counter()
            calls[key]()
            runtime.synchronize(device)
            ms[key].append((time.perf_counter() - t0) * 1e3)
            bar.update()
    return ms


def measure(calls: dict, cfg: dict, bar: tqdm, name: str) -> dict[str, dict]:
    """Warm each call up, profile one run of each (ops, memory, optional trace), then time them round-robin."""
    out = {}
    for key, call in calls.items():
        for _ in range(cfg["warmup"]):
            call()
            bar.update()
        trace = Path(cfg["out_dir"]) / f"trace_{name}_{key}.json" if cfg["profile"] else None
        ops, added = profiled_run(call, cfg["device"], trace)
        bar.update()
        out[key] = dict(ops=ops, added_bytes=added, trace=str(trace) if trace else None)
    for key, ms in time_round_robin(calls, cfg["iters"], cfg["device"], bar).items():
        p25, p50, p75 = np.percentile(ms, [25, 50, 75])
        out[key].update(ms_per_iter=p50, ms_p25=p25, ms_p75=p75, ms_min=min(ms), ms_max=max(ms), ms_all=ms)
    return out


def paired_speedup(base: dict, row: dict) -> float:
    """The median over timed iterations of base time / row time. One iteration runs every row back to back, so
    the ratio within it cancels drift that hits all rows (a neighbour's load, clocks), which the ratio of two
    medians taken over different moments would keep."""
    return float(np.median(np.array(base["ms_all"]) / np.array(row["ms_all"])))


def audited_row(row: dict, measured: dict, attn: str, device: str) -> dict:
    """A row with its timing, memory and audited kernel; kernel_ok is False on a silent fallback."""
    kernel, ops = audit(measured.pop("ops"))
    expected = expected_kernels(attn, device.split(":")[0])
    row.update(measured, kernel=kernel, kernel_ops=ops, kernel_expected=sorted(expected), kernel_ok=kernel in expected)
    return row


# -- train mode ------------------------------------------------------------------------------------------

@dataclass
class Trainer:
    model: GPT
    step: Callable[[], None]             # one training step: forward, backward, optimizer step
    resident_bytes: Callable[[], int]    # tensors that live across steps: weights, optimizer state, the batch


def build_trainer(cfg: dict, attn: str, pad_vocab: bool, batch_size: int) -> Trainer:
    device, dtype = cfg["device"], cfg["dtype"]
    runtime.seed_everything(cfg["seed"])  # the same weights for every attn
    config = GPTConfig(block_size=cfg["seq_len"], vocab_size=cfg["vocab_size"], n_layer=cfg["n_layer"],
                       n_head=cfg["n_head"], n_embd=cfg["n_embd"], dropout=cfg["dropout"], bias=cfg["bias"],
                       attn=attn, pad_vocab=pad_vocab)
    model = GPT(config).to(device)
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device.split(":")[0])
    scaler = runtime.grad_scaler(device, dtype)
    tokens = torch.randint(cfg["vocab_size"], (2, batch_size, cfg["seq_len"]),
                           generator=torch.Generator().manual_seed(cfg["seed"])).to(device)
    x, y = tokens  # (B, T) each: random ids cost the same as text
    forward = torch.compile(model) if cfg["compile"] else model

    def step() -> None:
        with runtime.autocast(device, dtype):
            _, loss = forward(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)  # gradients die with the step, so they count as step memory

    def resident_bytes() -> int:
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers(), *state, tokens])

    return Trainer(model, step, resident_bytes)


def fits(cfg: dict, attn: str, pad_vocab: bool, batch_size: int) -> bool:
    """Whether a training step at this batch size fits: on CUDA, no out-of-memory error; on CPU, resident
    plus peak step tensor memory (as measured for the table) within mem_budget_gb."""
    cuda, trainer = cfg["device"].startswith("cuda"), None
    try:
        trainer = build_trainer(cfg, attn, pad_vocab, batch_size)
        trainer.step()  # creates the optimizer state, so the step measured next carries it like any later one
        if cuda:
            return True
        _, added = profiled_run(trainer.step, cfg["device"])
        return trainer.resident_bytes() + added <= cfg["mem_budget_gb"] * 1e9
    except torch.OutOfMemoryError:
        return False
    finally:
        del trainer  # the model and its memory go before the next probe
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def max_batch_size(fits_batch: Callable[[int], bool], limit: int) -> int:
    """The largest batch size in [1, limit] that fits (0 if none): double until one fails, then bisect."""
    good, bad, b = 0, limit + 1, 1
    while b <= limit:
        if not fits_batch(b):
            bad = b
            break
        good, b = b, b * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits_batch(mid) else (good, mid)
    return good


def train_sweep(cfg: dict) -> list[dict]:
    """One row per attn x padding: timing, tokens/s, MFU, peak memory, speedup, audited kernel, skip reason."""
    device, dtype = cfg["device"], cfg["dtype"]
    head_size, tokens = cfg["n_embd"] // cfg["n_head"], cfg["batch_size"] * cfg["seq_len"]
    rows, trainers = {}, {}
    for a in cfg["attn"]:
        problem = attention_problem(a, device.split(":")[0], runtime.DTYPES[dtype], cfg["dropout"], head_size, True)
        for pad in cfg["padding"]:
            key = f"{a}_{'padded' if pad else 'unpadded'}"
            rows[key] = dict(attn=a, pad_vocab=pad, status="skipped" if problem else "ok", reason=problem)
            if problem is None:
                trainers[key] = build_trainer(cfg, a, pad, cfg["batch_size"])
                rows[key]["vocab"] = trainers[key].model.config.padded_vocab_size
    peak = runtime.peak_flops(device, dtype)
    with tqdm(total=len(trainers) * (cfg["warmup"] + 1 + cfg["iters"]), desc="bench", file=sys.stderr) as bar:
        measured = measure({key: t.step for key, t in trainers.items()}, cfg, bar, "train")
    for key, m in measured.items():
        row = audited_row(rows[key], m, rows[key]["attn"], device)
        row["mem/peak_gb"] = (trainers[key].resident_bytes() + row.pop("added_bytes")) / 1e9
        row["tokens_per_s"] = tokens / (row["ms_per_iter"] / 1e3)
        row["mfu"] = trainers[key].model.estimate_mfu(row["tokens_per_s"], peak, cfg["seq_len"])
    for row in rows.values():
        base = rows.get(f"manual_{'padded' if row['pad_vocab'] else 'unpadded'}", {})
        if row["status"] == "ok" and base.get("status") == "ok":
            row["speedup_vs_manual"] = paired_speedup(base, row)
    trainers.clear()  # the max-batch search below needs the memory
    gc.collect()
    if cfg["max_batch"]:
        for row in tqdm([r for r in rows.values() if r["status"] == "ok"], desc="max batch", file=sys.stderr):
            row["max_batch"] = max_batch_size(lambda b: fits(cfg, row["attn"], row["pad_vocab"], b),
                                              cfg["max_batch_limit"])
    return list(rows.values())


# -- attention-only mode -----------------------------------------------------------------------------------

def attention_call(fn, q, k, v, mask, dropout_p: float, backward: bool) -> Callable[[], None]:
    def call() -> None:
        if not backward:
            with torch.no_grad():
                fn(q, k, v, mask, dropout_p)
            return
        fn(q, k, v, mask, dropout_p).backward(q.detach())  # q doubles as the incoming gradient: any values do
        q.grad = k.grad = v.grad = None
    return call


def attention_sweep(cfg: dict) -> list[dict]:
    """One row per head size x sequence length x pass (fwd, fwd+bwd) x attn: time, added memory, kernel."""
    device, torch_dtype = cfg["device"], runtime.DTYPES[cfg["dtype"]]
    cases = [(hs, T, bwd) for hs in cfg["attn_head_sizes"] for T in cfg["attn_seq_lens"] for bwd in (False, True)]
    rows = []
    total = len(cases) * len(cfg["attn"]) * (cfg["warmup"] + 1 + cfg["iters"])
    with tqdm(total=total, desc="attention", file=sys.stderr) as bar:
        for hs, T, backward in cases:
            shape = (cfg["attn_batch"], cfg["attn_heads"], T, hs)  # (B, nh, T, hs)
            q, k, v = (torch.randn(shape, device=device, dtype=torch_dtype, requires_grad=backward) for _ in range(3))
            mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T), True where allowed
            here, calls = {}, {}
            for a in cfg["attn"]:
                problem = attention_problem(a, device.split(":")[0], torch_dtype, cfg["dropout"], hs, backward)
                here[a] = dict(attn=a, head_size=hs, seq_len=T, backward=backward,
                               status="skipped" if problem else "ok", reason=problem)
                if problem is None:
                    calls[a] = attention_call(ATTENTION[a], q, k, v, mask, cfg["dropout"], backward)
                else:
                    bar.update(cfg["warmup"] + 1 + cfg["iters"])
            for a, m in measure(calls, cfg, bar, f"attention_hs{hs}_T{T}_{'fwdbwd' if backward else 'fwd'}").items():
                audited_row(here[a], m, a, device)
                here[a]["mem/peak_gb"] = here[a].pop("added_bytes") / 1e9  # beyond q, k, v themselves
            for row in here.values():
                if row["status"] == "ok" and here["manual"]["status"] == "ok":
                    row["speedup_vs_manual"] = paired_speedup(here["manual"], row)
            rows += list(here.values())
    return rows


# -- output ------------------------------------------------------------------------------------------------

def format_table(rows: list[dict], columns: dict[str, Callable[[dict], str]]) -> str:
    """A plain-text table; a skipped row shows its reason in place of the numbers."""
    formats = list(columns.values())
    cells = [[f(row) for f in formats] if row["status"] == "ok"
             else [f(row) for f in formats[:2]] + [f"skipped: {row['reason']}"] for row in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells if len(c) == len(formats) or i < 2])
              for i, h in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()
    return "\n".join([line(list(columns)), line(["-" * w for w in widths])] + [line(c) for c in cells])


def kernel_cell(row: dict) -> str:
    return row["kernel"] + ("" if row["kernel_ok"] else f"  ! expected {'/'.join(row['kernel_expected'])}")


TRAIN_COLUMNS = {
    "attn": lambda r: r["attn"],
    "vocab": lambda r: str(r.get("vocab", "padded" if r["pad_vocab"] else "unpadded")),
    "ms/iter": lambda r: f"{r['ms_per_iter']:.1f}",
    "IQR ms": lambda r: f"{r['ms_p75'] - r['ms_p25']:.1f}",
    "tokens/s": lambda r: f"{r['tokens_per_s']:,.0f}",
    "MFU": lambda r: f"{100 * r['mfu']:.1f}%",
    "peak GB": lambda r: f"{r['mem/peak_gb']:.3f}",
    "speedup": lambda r: f"{r.get('speedup_vs_manual', float('nan')):.2f}x",
    "max batch": lambda r: str(r.get("max_batch", "-")),
    "kernel": kernel_cell,
}
ATTENTION_COLUMNS = {
    "attn": lambda r: r["attn"],
    "case": lambda r: f"hs={r['head_size']} T={r['seq_len']} {'fwd+bwd' if r['backward'] else 'fwd'}",
    "ms": lambda r: f"{r['ms_per_iter']:.2f}",
    "IQR ms": lambda r: f"{r['ms_p75'] - r['ms_p25']:.2f}",
    "added GB": lambda r: f"{r['mem/peak_gb']:.3f}",
    "speedup": lambda r: f"{r.get('speedup_vs_manual', float('nan')):.2f}x",
    "kernel": kernel_cell,
}


def chart(path: Path, rows: list[dict], cfg: dict, env: dict) -> None:
    """The post's figure: ms per training step per attn, unpadded and padded side by side, IQR whiskers
    (attention mode: forward+backward per attn, one bar per sequence length, at the first head size)."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    if cfg["mode"] == "train":
        series = {f"vocab {'padded' if p else 'unpadded'}": {"pad_vocab": p} for p in cfg["padding"]}
        title = (f"{env['device_name']}, {cfg['dtype']}\n{cfg['n_layer']} layers, n_embd {cfg['n_embd']}, "
                 f"B={cfg['batch_size']}, T={cfg['seq_len']}: ms per training step (lower is better)")
    else:
        hs = cfg["attn_head_sizes"][0]
        series = {f"T={T}": {"seq_len": T, "head_size": hs, "backward": True} for T in cfg["attn_seq_lens"]}
        title = f"{env['device_name']}, {cfg['dtype']}\nattention forward+backward, hs={hs} (lower is better)"
    ok = [r for r in rows if r["status"] == "ok"]
    bars = {label: {r["attn"]: r for r in ok if all(r[k] == v for k, v in match.items())}
            for label, match in series.items()}
    groups = [a for a in cfg["attn"] if any(a in by_attn for by_attn in bars.values())]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.4 * len(groups) * len(bars)), 4))
    width = 0.8 / len(bars)
    for i, (label, by_attn) in enumerate(bars.items()):
        found = [by_attn.get(a) for a in groups]  # None: skipped, a gap in the chart
        ms = [r["ms_per_iter"] if r else np.nan for r in found]
        whiskers = [(r["ms_per_iter"] - r["ms_p25"], r["ms_p75"] - r["ms_per_iter"]) if r else (0, 0) for r in found]
        xs = np.arange(len(groups)) + (i - (len(bars) - 1) / 2) * width
        ax.bar(xs, ms, width, yerr=np.array(whiskers, dtype=float).T, capsize=2, label=label)
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_ylabel("ms (median, IQR whiskers)")
    ax.set_title(title, fontsize=9)
    ax.set_yscale("log" if cfg["mode"] == "attention" else "linear")  # sequence lengths span orders of magnitude
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(cfg: dict, argv: list[str]) -> dict:
    device = cfg["device"]
    return dict(device=device, device_name=runtime.device_name(device), torch=torch.__version__,
                cuda=torch.version.cuda if device.startswith("cuda") else None, dtype=cfg["dtype"],
                threads=torch.get_num_threads(), peak_flops=runtime.peak_flops(device, cfg["dtype"]),
                python=platform.python_version(), platform=platform.platform(),
                command=" ".join(["python", "bench.py", *argv]), time=time.strftime("%Y-%m-%d %H:%M:%S"))


def settings(argv: list[str]) -> dict:
    """This module's settings with config files and --key=value overrides applied, resolved for the device."""
    return resolve(configurator.configure(globals(), argv, LIMITS))


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = settings(argv)
    if cfg["threads"] > 0:
        torch.set_num_threads(cfg["threads"])
    out = Path(cfg["out_dir"])
    runtime.check_writable_dir(out)  # before the sweep, not after it
    env = environment(cfg, argv)
    rows = train_sweep(cfg) if cfg["mode"] == "train" else attention_sweep(cfg)
    columns = TRAIN_COLUMNS if cfg["mode"] == "train" else ATTENTION_COLUMNS
    if not cfg["max_batch"]:
        columns = {k: v for k, v in columns.items() if k != "max batch"}
    print(f"{env['device_name']}, torch {env['torch']}, {cfg['dtype']}: {env['command']}")
    print(format_table(rows, columns))
    for row in rows:
        if row["status"] == "ok" and not row["kernel_ok"]:
            print(f"! {row['attn']} ran {row['kernel']} ({', '.join(row['kernel_ops']) or 'no SDPA op'}), not "
                  f"{' or '.join(row['kernel_expected'])}: a fused kernel refused these settings and PyTorch fell "
                  f"back without a word (dropout, a mask, the dtype or the head size)")
    (out / f"{cfg['mode']}.json").write_text(json.dumps(dict(environment=env, config=cfg, rows=rows), indent=1))
    chart(out / f"{cfg['mode']}.png", rows, cfg, env)
    print(f"wrote {out / (cfg['mode'] + '.json')} and {out / (cfg['mode'] + '.png')}")
    return 0


if __name__ == "__main__":
    runtime.run_main(main)
