"""
What a checkpoint save costs training, per format: the pause (how long save() keeps the ranks from training; the
first save of a process and a later one), how long until the checkpoint is whole on disk, and each rank's peak
memory above its steady state while saving. Run under
torchrun, as train.py runs; the model trains one step first so that AdamW's state exists, then each format saves
the same state into its own folder (deleted afterwards).

    torchrun --standalone --nproc_per_node=2 -m benchmarks.checkpoint_cost                 # GPT-2 medium, FSDP2
    torchrun --standalone --nproc_per_node=2 -m benchmarks.checkpoint_cost --n_layer=2 --n_embd=128 --n_head=4
    for f in single sharded async; do
        torchrun --standalone --nproc_per_node=2 -m benchmarks.checkpoint_cost --formats=$f; done

The peak memory of the second and later formats in one launch reads low: the process keeps memory an earlier save
freed and reuses it. docs/training.md's figures come from one launch per format (the loop above). Prints one table
(rank 0) and writes it to <out_dir>/checkpoint_cost.json. GPT-2 medium: about 2 minutes a format on 2 CPU cores.
"""

import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from core import runtime
from engine.sharded import saver_for
from benchmarks.bench_report import format_table
from core.configurator import as_list, comma_list_of, configure, one_of
from model import GPT, GPTConfig

n_layer, n_head, n_embd = 24, 16, 1024   # GPT-2 medium (355M): the largest whose single-file save fits 24 GiB
parallel = "fsdp"                        # 'fsdp' (FSDP2) or 'ddp'
formats = "single,sharded,async"         # async: sharded with async_save
saves = 2                                # per format; the table shows the first's pause and the last's
out_dir = "bench_results/checkpoint_cost"
LIMITS = {"saves": "[1, inf)", "n_layer": "[1, inf)", "n_head": "[1, inf)", "n_embd": "[1, inf)",
          "parallel": one_of("ddp", "fsdp"), "formats": comma_list_of("single", "sharded", "async")}
PAGE = 4096


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def peak_rss_during(work: Callable[[], None]) -> tuple[float, int]:
    """Seconds `work` took and the most resident memory (bytes) while it ran, sampled every 5 ms."""
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.005)
    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    work()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return seconds, max(peak[0], rss_bytes())


def main(argv: Optional[list[str]] = None) -> int:
    cfg = configure(globals(), sys.argv[1:] if argv is None else argv, LIMITS)
    rt = runtime.resolve_runtime("cpu", "float32", distributed=True)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, attn="sdpa"))
    if rt.is_distributed:
        from engine import parallel as wrapping
        wrapped = wrapping.wrap(model, cfg.parallel, False, rt)
    else:
        wrapped = model
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), "cpu")
    x = torch.randint(0, 50257, (1, 64))
    wrapped(x, x)[1].backward()  # one step: AdamW's moments exist, as in a run
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    fields = dict(model_config={}, iter_num=1, best_val_loss=1.0, rng=None, settings={}, meta=None)
    rows = []
    for name in dict.fromkeys(as_list(cfg.formats)):
        out = Path(cfg.out_dir) / f"{name}_{rt.world_size}"
        saver = saver_for("single" if name == "single" else "sharded", out, 1, name == "async", rt)
        pauses, steady = [], rss_bytes()
        for save in range(cfg.saves):  # the first save of a process also pays for touching its buffers' pages
            pause, peak_saving = peak_rss_during(lambda: saver.save(model, [optimizer], {**fields, "iter_num": save}))
            whole, peak_writing = peak_rss_during(saver.close)  # async: the writer thread's part
            pauses.append(pause)
        peak = max(peak_saving, peak_writing) - steady
        written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if rt.is_master else 0
        gathered = [None] * rt.world_size
        if rt.is_distributed:
            torch.distributed.all_gather_object(gathered, peak)
        else:
            gathered = [peak]
        rows.append({"format": name, "first_pause_s": pauses[0], "pause_s": pause, "whole_s": pause + whole,
                     "peak_extra_gb_per_rank": [p / 1e9 for p in gathered], "written_gb": written / 1e9})
        runtime.on_master(lambda: shutil.rmtree(out), rt.device)
    if rt.is_master:
        params = sum(p.numel() for p in model.parameters())
        print(f"{params / 1e6:.0f}M parameters, {cfg.parallel if rt.is_distributed else 'one process'}, "
              f"{rt.world_size} rank(s) (gloo), {rt.name}")
        print(format_table([dict(r, status="ok") for r in rows], {
            "format": lambda r: r["format"], "1st pause s": lambda r: f"{r['first_pause_s']:.2f}",
            "pause s": lambda r: f"{r['pause_s']:.2f}", "whole s": lambda r: f"{r['whole_s']:.2f}",
            "peak extra GB per rank": lambda r: ", ".join(f"{p:.2f}" for p in r["peak_extra_gb_per_rank"]),
            "written GB": lambda r: f"{r['written_gb']:.2f}"}))
        path = Path(cfg.out_dir) / "checkpoint_cost.json"
        path.write_text(json.dumps({"config": cfg.as_dict(), "machine": rt.name, "parameters": params, "rows": rows},
                                   indent=1))
    return 0


if __name__ == "__main__":
    runtime.run_main(main)
