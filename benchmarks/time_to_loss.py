"""
Time to a validation loss: each recipe launched as a user would (python train.py ...), in turn, for several rounds;
wall time from launch to the first val/loss at or below the target. Ratios are taken within a round.

    python -m benchmarks.time_to_loss                        # nanoGPT's CPU recipe vs the quickstart
    python -m benchmarks.time_to_loss --compare=attn --full=False   # the quickstart through each attn, and auto
    python -m benchmarks.time_to_loss --compare=gpu          # on a GPU: nanoGPT's shakespeare_char vs the fast recipe
"""

if __name__ == "__main__":  # a Ctrl-C while the imports below load ends the process quietly (main handles its own)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from core import writing
from core import runtime
from benchmarks.bench_report import format_table
from core.configurator import PATH, configure, one_of
from core.errors import UserError
from model import IMPLEMENTATIONS

compare = "quickstart"        # which recipes (RECIPE_SETS): quickstart (nanoGPT's CPU recipe vs ours), doc_mask, attn,
                              # attn_masked, gpu (nanoGPT's shakespeare_char vs config/train_shakespeare_char_fast.py)
target = None                 # the validation loss to reach; None: the set's own (TARGETS; gpu: nanoGPT's best here)
runs = None                   # rounds, each running every recipe once; None: 3, or 2 for gpu (~10 min on an H100)
full = True                   # run each recipe to its end (for its final loss); False: stop it at the target
extra = ""                    # train.py settings added to every recipe, e.g. a scaled-down CPU run (docs/quickstart.md)
out_dir = "bench_results"     # time_to_loss.json goes here
LIMITS = {"target": "(0, inf)", "runs": "[1, inf) int", "out_dir": PATH,
          "compare": one_of("quickstart", "doc_mask", "attn", "attn_masked", "gpu")}

# The recipes, as command-line arguments to train.py. nanoGPT's is its README's CPU command, flag for flag, plus
# what nanoGPT's code fixes and this repo makes a setting: its exact-erf GELU and fp32 on a CPU.
RECIPES = {
    "nanoGPT CPU recipe": ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                           "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                           "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0",
                           "--gelu=none", "--dtype=float32"],
    "quickstart": ["config/train_shakespeare_char_cpu.py"],
}
# The same small GPT-2 BPE model on Shakespeare's scenes (one document each), the same steps and batches (one seed),
# with causal attention and with doc_mask: what masking documents does to the val loss at a fixed budget. fp32 on
# every CPU kind, so the losses compare across machines. ~2.5 s a step on 2 AVX2 threads: ~9 minutes a run.
SCENES = ["--dataset=shakespeare", "--device=cpu", "--compile=False", "--dtype=float32", "--n_layer=4", "--n_head=4",
          "--n_embd=128", "--block_size=512", "--batch_size=4", "--gradient_accumulation_steps=1", "--pad_vocab=True",
          "--dropout=0.0", "--max_iters=200", "--lr_decay_iters=200", "--warmup_iters=20", "--learning_rate=2e-3",
          "--min_lr=2e-4", "--eval_interval=50", "--eval_iters=20", "--log_interval=10"]
# The quickstart through each implementation a CPU trains with, and through attn=auto: measuring in the run
# (--attn_auto_refresh=True, what a first run spends), then with the decision that run cached (every later run).
CPU_TRAINABLE = [a for a, impl in IMPLEMENTATIONS.items()
                 if "cpu" in impl.devices.split() and "cpu" in impl.grad.split()]
ATTN = {**{a: ["config/train_shakespeare_char_cpu.py", f"--attn={a}"] for a in CPU_TRAINABLE},
        "auto, measuring": ["config/train_shakespeare_char_cpu.py", "--attn=auto", "--attn_auto_refresh=True"],
        "auto, cached": ["config/train_shakespeare_char_cpu.py", "--attn=auto"]}
# docs/masks.md's recipe (documents and a 128-token window on Shakespeare BPE, 40 steps) through the same choices.
MASKED = ["config/train_shakespeare_char_cpu.py", "--dataset=shakespeare", "--doc_mask=True", "--window=128",
          "--block_size=256", "--batch_size=8", "--max_iters=40", "--lr_decay_iters=40", "--early_decay_iters=0",
          "--eval_interval=20", "--log_interval=10"]
ATTN_MASKED = {name: MASKED + args[1:] for name, args in ATTN.items()}
# nanoGPT's best-known GPU recipe as its README launches it, with its model as nanoGPT's code builds it (no biases,
# exact-erf GELU, which this repo makes settings), and the fast one, evaluated as nanoGPT's is when the crossing is
# decided: the same 200 val batches (one seed, one batch shape), where its own 20 would carry the same lucky or
# unlucky offset at every evaluation and could "reach" the target early.
GPU = {"nanoGPT shakespeare_char": ["config/train_shakespeare_char.py", "--bias=False", "--gelu=none"],
       "fast": ["config/train_shakespeare_char_fast.py", "--eval_iters=200"]}
RECIPE_SETS = {"quickstart": RECIPES, "doc_mask": {"causal": SCENES, "doc_mask": SCENES + ["--doc_mask=True"]},
               "attn": ATTN, "attn_masked": ATTN_MASKED, "gpu": GPU}
# None (gpu): the best val loss the first recipe (nanoGPT's) reaches in the same round, on this data; nanoGPT's
# published 1.4697 is on tinyshakespeare (1M characters, 65 symbols), not this repo's corpus (4.3M, 76)
TARGETS = {"quickstart": 1.89, "attn": 1.89, "doc_mask": 6.5, "attn_masked": 6.5, "gpu": None}
ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.05  # how often a run's metrics.jsonl is read: the timing's resolution


def time_one(args: list[str], target_loss: Optional[float]) -> dict:
    """One launch of train.py with caches of its own (inductor's, Triton's: no recipe compiles warm on another's
    work): every logged val loss with the seconds since launch it was read at, and the wall time of the whole run;
    stopped at target_loss when one is given. The evaluations are read from the run's metrics.jsonl as they are
    written (every POLL_S), not from its console. A run that fails raises, naming it and its last line."""
    with tempfile.TemporaryDirectory() as out, open(Path(out) / "console.txt", "w+") as console:
        metrics = Path(out) / "run" / "metrics.jsonl"
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(out) / "inductor"),
               "TRITON_CACHE_DIR": str(Path(out) / "triton")}
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, f"--out_dir={Path(out) / 'run'}"],
                                   cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, env=env)
        evals, read = [], 0  # (seconds, iter, val loss); records of metrics.jsonl seen so far
        while True:
            finished = process.poll() is not None  # read what a finished run wrote once more, then stop
            records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
            now = time.perf_counter() - start
            evals += [(now, r["iter"], r["val/loss"]) for r in records[read:] if "val/loss" in r]
            read = len(records)
            if finished or (target_loss is not None and any(loss <= target_loss for _, _, loss in evals)):
                break
            time.sleep(POLL_S)
        stopped = process.poll() is None
        process.kill()
        process.wait()
        if not stopped and process.returncode != 0:
            console.seek(0)
            last = next((line for line in reversed(console.read().splitlines()) if line.strip()), "no output")
            raise UserError(f"train.py {' '.join(args)} failed (exit code {process.returncode}): {last}")
    return {"evals": evals, "wall_s": time.perf_counter() - start}


def reached(run: dict, target: float) -> dict:
    """Seconds and iter of the run's first val loss <= target (None if never); its last val loss and iter."""
    first = next(((s, it) for s, it, loss in run["evals"] if loss <= target), (None, None))
    last = run["evals"][-1] if run["evals"] else (None, None, None)
    return {"seconds": first[0], "iter": first[1], "final_iter": last[1], "final_loss": last[2], "target": target}


def prepare_data(recipes: dict) -> None:
    """Each recipe's dataset prepared now, before any clock starts."""
    import train  # its settings, to read each recipe's dataset as train.py will
    from core.dataset import dataset_dir, prepare_if_missing
    for args in recipes.values():
        cfg = configure(vars(train), [a if a.startswith("--") else str(ROOT / a) for a in args], train.LIMITS)
        prepare_if_missing(dataset_dir(cfg.data_dir, cfg.dataset), cfg.dataset)


def summary(values: list[Optional[float]], digits: int = 1) -> str:
    """Median (min-max) of the runs that got there; how many did, when not all."""
    found = [v for v in values if v is not None]
    if not found:
        return "not reached"
    spread = f" ({min(found):.{digits}f}-{max(found):.{digits}f})" if len(found) > 1 else ""
    missed = "" if len(found) == len(values) else f", {len(found)}/{len(values)}"
    return f"{np.median(found):.{digits}f}{spread}{missed}"


def main(argv: Optional[list[str]] = None) -> int:
    cfg = configure(globals(), sys.argv[1:] if argv is None else argv, LIMITS)
    cfg.target = TARGETS[cfg.compare] if cfg.target is None else cfg.target
    cfg.runs = (2 if cfg.compare == "gpu" else 3) if cfg.runs is None else cfg.runs
    try:
        extra = shlex.split(cfg.extra)
    except ValueError as e:
        raise UserError(f"--extra={cfg.extra!r} cannot be read as train.py settings ({e}); quote it as a whole, "
                        f"e.g. --extra='--device=cpu --max_iters=200'.") from None
    on_gpu = cfg.compare == "gpu" and torch.cuda.is_available()
    if cfg.compare == "gpu" and not on_gpu and not extra:
        raise UserError("--compare=gpu trains nanoGPT's GPU recipe (5,000 steps of a 6 x 384 model: hours on a CPU) "
                        "and needs a CUDA GPU; here, pass --extra= a scaled-down CPU run (docs/quickstart.md).")
    out = Path(cfg.out_dir)
    writing.check_writable_dir(out)
    recipes = {name: args + extra for name, args in RECIPE_SETS[cfg.compare].items()}
    prepare_data(recipes)
    machine = runtime.Runtime("cuda:0" if on_gpu else "cpu", "float32").name  # the GPU, or the CPU and its kind
    names, rounds, orders = list(recipes), [], []
    base = names[0]
    print(f"on {machine}: {cfg.runs} round(s) of {len(names)} recipes, "
          f"{'to ' + str(cfg.target) if cfg.target else 'the best val ' + base + ' reaches'}", flush=True)
    stop_at = cfg.target if not cfg.full else None
    for i in range(cfg.runs):
        order = names[i % len(names):] + names[:i % len(names)]  # who goes first alternates between rounds
        orders.append(order)
        runs = {name: time_one(recipes[name], stop_at) for name in order}
        target = cfg.target or min(loss for _, _, loss in runs[base]["evals"])
        rounds.append({name: {**reached(runs[name], target), "wall_s": runs[name]["wall_s"]} for name in names})
        print(f"round {i + 1}: " + "; ".join(f"{n} {r['seconds'] and round(r['seconds'], 1)} s" for n, r in
                                              rounds[-1].items()), flush=True)
    targets = sorted({round(r[base]["target"], 4) for r in rounds})
    print(f"\ntime to val/loss <= {', '.join(map(str, targets))}, launch to logged val/loss, {cfg.runs} round(s), "
          f"{machine}: median (min-max)")
    rows = []
    for name in names:
        ratios = [r[name]["seconds"] / r[base]["seconds"] for r in rounds if r[name]["seconds"] and r[base]["seconds"]]
        rows.append(dict(status="ok", recipe=name, seconds=summary([r[name]["seconds"] for r in rounds]),
                         ratio=f"{np.median(ratios):.2f}x" if ratios else "-",
                         iter=summary([r[name]["iter"] for r in rounds], 0),
                         final=summary([r[name]["final_loss"] for r in rounds], 3) if cfg.full else "-",
                         wall=summary([r[name]["wall_s"] for r in rounds])))
    print(format_table(rows, {"recipe": lambda r: r["recipe"], "seconds": lambda r: r["seconds"],
                              f"x {base}": lambda r: r["ratio"], "iter": lambda r: r["iter"],
                              "final val": lambda r: r["final"], "wall s": lambda r: r["wall"]}))
    path = out / "time_to_loss.json"
    writing.write_json(path, {"config": cfg.as_dict(), "machine": machine, "capability": runtime.cpu_capability(),
                            "recipes": recipes, "rounds": rounds, "orders": orders}, "out_dir")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    runtime.run_main(main)
