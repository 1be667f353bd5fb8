"""
The training log (console, out_dir/metrics.jsonl, wandb) and the run's other lines: its banner, a long evaluation's
progress, and where an interrupted run stands. train.py's train_loop times the steps.
"""

import errno
import json
import os
import shlex
import stat
import time
from pathlib import Path

import torch

from core import runtime
from core.configurator import Settings
from core.errors import UserError
from core.writing import staged_outputs
from core.runtime import Runtime
from model import IMPLEMENTATIONS, GPT


class Progress:
    """A long stretch between log lines printed while it runs: what it is at once (`announce`), and once two items have
    run (the first may compile), about how long the rest takes when that is over `after_s`. Waits for the device on
    those two items only."""
    AFTER_S = 20.0

    def __init__(self, what: str, total: int, enabled: bool, announce: bool):
        self.what, self.total, self.enabled, self.done = what, total, enabled, 0
        if enabled and announce:
            print(f"{what}: {total} batches ...", flush=True)
        self.last = time.perf_counter()

    def tick(self, value: torch.Tensor) -> None:
        self.done += 1
        if not self.enabled or self.done > 2:
            return
        value.item()  # the item's own time: what the device queued for it is done
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        if self.done == 2 and seconds * (self.total - 2) > self.AFTER_S:
            print(f"{self.what}: about {seconds * (self.total - 2):.0f} s more at {seconds:.2f} s a batch "
                  f"(--eval_iters= sets how many)", flush=True)


class MetricsLog:
    """Console, out_dir/metrics.jsonl, and wandb when enabled. Only the master rank writes."""

    def __init__(self, cfg: Settings, run_config: dict, enabled: bool, to_file: bool = True):
        self.enabled, self.wandb = enabled, None
        self.path = Path(cfg.out_dir) / "metrics.jsonl" if to_file else None
        self.replace = True if cfg.init_from != "resume" else None  # a new run's first line replaces an old log at
        # once (--overwrite); a resume's first (None) drops a cut last record before it appends
        if enabled and cfg.wandb_log:
            from tools.wandb_check import start_wandb
            self.wandb = start_wandb(cfg.wandb_project, cfg.wandb_run_name, run_config)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        text = "  ".join(f"{k} {v:.2f}%" if k == "mfu" else f"{k} {v:,.0f}" if k == "tokens_per_s"
                         else f"{k} {v:.4f}" if k.endswith("loss") and isinstance(v, float)  # 2.6100, as nanoGPT
                         else f"{k} {v:.0f}" if isinstance(v, float) and abs(v) >= 1e4  # 11680, not 1.168e+04
                         else f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in metrics.items())  # mfu: a percent, as nanoGPT's (bench's JSON: a fraction)
        print(text, flush=True)
        if self.path is not None and self.replace:  # nothing of an old log goes before this run has a line
            with staged_outputs(self.path.parent, [self.path.name], what=str(self.path),
                                advice="free disk space or pass --out_dir= another folder") as tmp:
                tmp[self.path.name].write_text(json.dumps(metrics) + "\n")
            self.replace = False
        elif self.path is not None:
            try:  # a record is complete or absent: one cut short (a full disk) is taken back, and a resume drops
                with open(self.path, "ab", buffering=0) as f:  # the cut record a crash left before it appends (a
                    regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)  # file, not a device or FIFO: streams)
                    whole = f.tell() if regular else 0
                    if whole and self.replace is None:
                        whole = self.path.read_bytes().rfind(b"\n") + 1
                        f.truncate(whole)
                    self.replace = False
                    record = (json.dumps(metrics) + "\n").encode()
                    try:
                        if f.write(record) != len(record):  # unbuffered: a short write is the disk's refusal
                            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    except OSError:
                        if regular:
                            f.truncate(whole)
                        raise
            except OSError as e:  # a full disk: the line above was printed; the run stops with one error line
                raise UserError(f"could not append to {self.path} ({e.strerror or e}); the run stops, its "
                                f"checkpoint (if one was saved) kept - free disk space or pass --out_dir= another "
                                f"folder.") from None
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics["iter"])  # nanoGPT's `iter` key too

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


# -- the run's other lines: its banner, and where an interrupted run stands -----------------------------------

def banner(cfg: Settings, rt: Runtime, model: GPT, tokens_per_iter: int) -> str:
    """The run's first line: the model, attention, precision, device, and how the ranks split the work."""
    step_faster = runtime.bf16_native(rt.device_type, training=True)  # a bf16 step is faster than fp32 here
    why = {"float32": f"a bf16 step is faster on a CPU only from {runtime.MUON_BF16_WIDTH} wide" if step_faster else
           "a bf16 step is not faster than fp32 here" if runtime.bf16_native(rt.device_type) else
           "bf16 matmuls are not in this device's hardware", "bfloat16": "a bf16 step is faster here"}
    muon = f", Muon's Newton-Schulz in {rt.muon_dtype}" + (f" (auto: {why[rt.muon_dtype]})" if cfg.muon_dtype == "auto"
                                                          else "") if cfg.optimizer == "muon" else ""
    dtype = f"{rt.dtype}" + (f" (auto: {'a bf16 step is faster here' if rt.dtype == 'bfloat16' else why['float32']})"
                             if cfg.dtype == "auto" and rt.device_type == "cpu" else "")
    ranks = f"{rt.world_size} ranks under {'DDP' if cfg.parallel == 'ddp' else 'FSDP2'}" if rt.is_distributed else \
        "world size 1"
    kernels = IMPLEMENTATIONS[model.config.attn].kernels_on(model.transformer.wpe.weight.device)
    kernels = f" ({kernels})" if kernels else ""
    c = model.config
    differ = [flag for flag, differs in (("--bias=False", c.bias), ("--gelu=none", c.gelu == "tanh")) if differs]
    layers = f"{'biases' if c.bias else 'no biases'}, {'tanh' if c.gelu == 'tanh' else 'exact'} GELU" + (
        f"; nanoGPT's train.py: {' '.join(differ)}" if differ else "")
    masks = "".join([", documents masked (doc_mask)"] * c.doc_mask + [f", window {c.window}"] * (c.window > 0))
    return (f"{model.get_num_params() / 1e6:.2f}M parameters ({layers}), attn={c.attn}{kernels}{masks}, {dtype} on "
            f"{rt.name}{muon}, {ranks}, {tokens_per_iter:,} tokens per iteration")


def resume_hint(cfg: Settings, run, argv: list[str]) -> str:  # run: train.TrainingRun
    """Where an interrupted run stands: the newest checkpoint kept, and the command that goes on from it (the same
    launch: under torchrun, torchrun's)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", run.rt.world_size))
    launch = f"torchrun --nproc_per_node={ranks}" if run.rt.is_distributed else "python"
    if run.rt.is_distributed and ranks != run.rt.world_size:  # several nodes: their rendezvous options are not ours
        launch = "torchrun <your torchrun options>"
    kept = [a for a in argv if not a.startswith(("--init_from=", "--overwrite="))]
    command = f"{launch} {shlex.join(['train.py', *kept])}"
    if run.saved_at is None:
        return f"stopped at iter {run.iter_num}; no checkpoint was saved in {cfg.out_dir}; start again with: {command}"
    return (f"stopped at iter {run.iter_num}; the checkpoint kept in {cfg.out_dir} is iter {run.saved_at}; "
            f"continue with: {command} --init_from=resume")
