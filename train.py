"""
Train a GPT on one CPU, one GPU, or many GPUs with DDP.

    python train.py config/train_shakespeare_char_cpu.py            # the CPU quickstart, a few minutes
    python train.py config/train_shakespeare_char.py --compile=False
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py --attn=flash
    # two nodes: torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 train.py ...

Every setting below can be set in a config file or overridden with --key=value.
"""

import dataclasses
import hashlib
import inspect
import json
import math
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import runtime
from configurator import configure
from errors import UserError
from model import GPT, check_attention

# I/O
out_dir = "out"                   # checkpoint (ckpt.pt) and metrics.jsonl go here
eval_interval = 2000              # evaluate (and checkpoint) every this many iterations
log_interval = 1                  # log training metrics every this many iterations
eval_iters = 200                  # batches per split for each evaluation
eval_only = False                 # evaluate once (a resumed model at its step), write nothing, exit
always_save_checkpoint = True     # save at every eval, not only when val loss improves
init_from = "scratch"             # 'scratch', 'resume' (from out_dir), 'gpt2*', or a local Hugging Face directory
max_seconds = 0.0                 # stop after this much training time (eval excluded), then evaluate and save; 0: off
# wandb logging (the mode comes from the environment: WANDB_MODE=offline or disabled work as usual)
wandb_log = False
wandb_project = "owt"
wandb_run_name = "gpt2"
# data
dataset = "openwebtext"           # data/<dataset>/{train,val}.bin, from data/<dataset>/prepare.py
data_dir = ""                     # where train.bin/val.bin/meta.json are; empty: data/<dataset>
gradient_accumulation_steps = 40  # micro-steps per optimizer step, in total over all ranks
batch_size = 12                   # sequences per micro-step per rank
block_size = 1024
# model
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0                     # 0 for pretraining, 0.1+ for finetuning
bias = True                       # biases in Linear and LayerNorm, as GPT-2
attn = "sdpa"                     # manual, sdpa_mask, sdpa, flash, efficient, cudnn, math, flex (see README)
pad_vocab = False                 # pad the vocabulary to a multiple of 64 (50257 -> 50304)
gelu = "tanh"                     # GPT-2's tanh GELU, or 'none' for the exact one
# AdamW
learning_rate = 6e-4
max_iters = 600000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0                   # clip gradients at this norm; 0: off
# learning rate schedule: linear warmup, then cosine decay to min_lr
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000           # ~= max_iters per Chinchilla
min_lr = 6e-5                     # ~= learning_rate / 10 per Chinchilla
# system
device = "auto"                   # auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps
dtype = "auto"                    # auto (bf16 where supported, fp16 on older GPUs, else fp32), float32, bfloat16, float16
compile = True                    # torch.compile the model (FSDP: each block)
parallel = "ddp"                  # under torchrun: 'ddp' (full replica per rank) or 'fsdp' (FSDP2, sharded)
seed = 1337
# -----------------------------------------------------------------------------

# the allowed range of every numeric setting, checked before anything runs: "[1, inf)" is 1 or more
LIMITS = {
    "eval_interval": "[1, inf)", "log_interval": "[1, inf)", "eval_iters": "[1, inf)", "max_seconds": "[0, inf)",
    "gradient_accumulation_steps": "[1, inf)", "batch_size": "[1, inf)", "block_size": "[1, inf)",
    "n_layer": "[1, inf)", "n_head": "[1, inf)", "n_embd": "[1, inf)", "dropout": "[0, 1)",
    "learning_rate": "(0, inf)", "max_iters": "[0, inf)", "weight_decay": "[0, inf)", "beta1": "[0, 1)",
    "beta2": "[0, 1)", "grad_clip": "[0, inf)", "warmup_iters": "[0, inf)", "lr_decay_iters": "[0, inf)",
    "min_lr": "[0, inf)", "seed": "[0, inf)",
}
DATA = Path(__file__).resolve().parent / "data"
EMBEDDED_DATASETS = {"shakespeare_char", "shakespeare"}  # prepared offline from packaged text, automatically
DATA_FILES = ("train.bin", "val.bin", "meta.json")


def lr_at(it: int, s: dict) -> float:
    """Linear warmup for warmup_iters, cosine decay to min_lr until lr_decay_iters, then min_lr."""
    if not s["decay_lr"]:
        return s["learning_rate"]
    if it < s["warmup_iters"]:
        return s["learning_rate"] * (it + 1) / (s["warmup_iters"] + 1)
    if it > s["lr_decay_iters"]:
        return s["min_lr"]
    ratio = (it - s["warmup_iters"]) / max(1, s["lr_decay_iters"] - s["warmup_iters"])
    return s["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (s["learning_rate"] - s["min_lr"])


# -- data ---------------------------------------------------------------------------------------------

def dataset_dir(data_dir: str, name: str) -> Path:
    """The folder the run reads: data_dir when given (it must exist), else data/<name> of a known dataset."""
    if data_dir:
        if not Path(data_dir).is_dir():
            raise UserError(f"data_dir {data_dir} does not exist; pass --data_dir= the folder that holds "
                            f"train.bin and val.bin.")
        return Path(data_dir)
    if not (DATA / name / "prepare.py").exists() and not (DATA / name / "train.bin").exists():
        known = sorted(p.parent.name for p in DATA.glob("*/prepare.py"))
        raise UserError(f"unknown dataset '{name}' (no data/{name}/); use one of {', '.join(known)}, "
                        f"or --data_dir= a folder with train.bin and val.bin.")
    return DATA / name


def prepare_if_missing(data_dir: Path, name: str) -> None:
    """Prepare an embedded dataset into its own folder when that folder holds none of its files. Existing data
    (say a custom corpus prepared there with --input=) is never written over, and a data_dir is never prepared:
    check_token_files speaks for it."""
    missing = [f for f in ("train.bin", "val.bin") if not (data_dir / f).exists()]
    if not missing or data_dir != DATA / name:
        return
    if name not in EMBEDDED_DATASETS or any((data_dir / f).exists() for f in DATA_FILES):
        raise UserError(f"dataset '{name}' is not prepared (data/{name}/{missing[0]} is missing); "
                        f"run: python data/{name}/prepare.py")
    print(f"preparing {name} (data/{name}/prepare.py) ...")
    if subprocess.run([sys.executable, str(data_dir / "prepare.py"), f"--out_dir={data_dir}"]).returncode != 0:
        raise UserError(f"preparing dataset '{name}' failed; run python data/{name}/prepare.py to see why.")


def max_token_id(path: Path, chunk: int = 1 << 26) -> int:
    """The largest id in a token file, read in chunks (128 MB each) so no split is ever held whole in memory."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    return max((int(data[i:i + chunk].max()) for i in range(0, len(data), chunk)), default=-1)


def check_token_files(data_dir: Path, vocab_size: int, block_size: int) -> None:
    """Once, when the data is opened: both splits exist, hold whole uint16 tokens, more than block_size of them,
    and only ids the model has embeddings for."""
    for split in ("train", "val"):
        path = data_dir / f"{split}.bin"
        if not path.is_file():
            raise UserError(f"{path} is missing; a dataset folder needs train.bin and val.bin "
                            f"(python data/<name>/prepare.py writes both).")
        size = path.stat().st_size
        if size % 2:
            raise UserError(f"{path} is {size:,} bytes, not a whole number of uint16 tokens; it is truncated or "
                            f"not a token file - prepare the dataset again.")
        if size // 2 <= block_size:
            raise UserError(f"{path} has {size // 2:,} tokens, fewer than block_size+1={block_size + 1}; "
                            f"use a smaller block_size or more data.")
        top = max_token_id(path)
        if top >= vocab_size:
            raise UserError(f"{path} holds token id {top} but the model's vocabulary has {vocab_size} ids "
                            f"(0-{vocab_size - 1}); the data was tokenized for another vocabulary - check "
                            f"{data_dir / 'meta.json'} or prepare the data again.")


def read_meta(data_dir: Path) -> dict | None:
    from tokenizer import read_meta as read
    return read(data_dir / "meta.json") if (data_dir / "meta.json").exists() else None


class Batches:
    """Random windows of a token file. One generator, seeded alike on every rank, draws the offsets of the
    whole global batch; each rank takes its own micro-batches of it. So N ranks see exactly the data one
    process with N times the accumulation sees, and the generator's state is all a resume needs."""

    def __init__(self, data_dir: Path, block_size: int, batch_size: int, seed: int):
        self.data_dir, self.block_size, self.batch_size = data_dir, block_size, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def _windows(self, split: str, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # a fresh memmap per batch: a long-lived one grows resident memory (numpy keeps pages)
        data = np.memmap(self.data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
        windows = torch.stack([torch.from_numpy(data[i:i + 1 + self.block_size].astype(np.int64))
                               for i in offsets.tolist()])  # (B, T + 1): inputs and targets in one read
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T) each, targets shifted by one

    def num_tokens(self, split: str) -> int:
        return os.path.getsize(self.data_dir / f"{split}.bin") // 2

    def global_step(self, split: str, micro_steps: int, rank: int, world_size: int):
        """This rank's micro-batches of one optimizer step: a list of (x, y), each (B, T)."""
        high = self.num_tokens(split) - self.block_size  # >= 1: check_token_files made sure
        offsets = torch.randint(high, (micro_steps * world_size, self.batch_size), generator=self.generator)
        mine = offsets[rank * micro_steps:(rank + 1) * micro_steps]  # (micro_steps, B)
        return [self._windows(split, row) for row in mine]


# -- model, optimizer, checkpoint ------------------------------------------------------------------------

def build_model(s: dict, vocab_size: int, checkpoint: dict | None) -> GPT:
    if checkpoint is not None:  # resume: the weights decide the shape; attn and dropout are this run's
        model = runtime.model_from_checkpoint(checkpoint, attn=s["attn"], dropout=s["dropout"])
        if model.config.vocab_size != vocab_size:
            raise UserError(f"the checkpoint's vocab_size is {model.config.vocab_size} but dataset "
                            f"'{s['dataset']}' has {vocab_size}; resume with the dataset it was trained on.")
    elif s["init_from"] == "scratch":
        model = GPT(runtime.model_config_from({**s, "vocab_size": vocab_size}))
    else:
        model = GPT.from_pretrained(s["init_from"], attn=s["attn"], pad_vocab=s["pad_vocab"], dropout=s["dropout"])
        if model.config.vocab_size != vocab_size:
            raise UserError(f"{s['init_from']} has vocab_size {model.config.vocab_size} but dataset "
                            f"'{s['dataset']}' has {vocab_size}; use a GPT-2 tokenized dataset.")
    if s["block_size"] > model.config.block_size:
        raise UserError(f"block_size={s['block_size']} is larger than the model's {model.config.block_size}; "
                        f"use --block_size={model.config.block_size} or less.")
    if s["block_size"] < model.config.block_size:
        model.crop_block_size(s["block_size"])
    return model


def rng_state(batches: Batches, d: runtime.Dist) -> dict:
    """Every rank's dropout RNG (collective: all ranks call it) and the shared data generator."""
    mine = torch.cat([torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if d.device.startswith("cuda") else []))
    per_rank = [mine]
    if d.enabled:
        per_rank = [None] * d.world_size
        torch.distributed.all_gather_object(per_rank, mine)
    return {"per_rank": per_rank, "data": batches.generator.get_state()}


def restore_rng(state: dict, batches: Batches, d: runtime.Dist) -> None:
    batches.generator.set_state(state["data"])
    if len(state["per_rank"]) != d.world_size:
        return  # another world size: dropout streams cannot continue, the seeds set in main() stand
    saved, cpu_size = state["per_rank"][d.rank], torch.get_rng_state().numel()
    torch.set_rng_state(saved[:cpu_size])
    if d.device.startswith("cuda") and saved.numel() > cpu_size:
        torch.cuda.set_rng_state(saved[cpu_size:])


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank stores: its shard of an FSDP parameter, or all of a replicated one."""
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def parameter_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal on all ranks if DDP kept them in step."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def parallelize(model: GPT, s: dict, d: runtime.Dist, rt: runtime.Runtime) -> torch.nn.Module:
    """Compile and wrap for the world we run in. FSDP2: each block is a unit (gathered for its forward and
    backward, then freed), then the root holds the embeddings, final norm and tied lm_head."""
    if d.enabled and s["parallel"] == "fsdp":
        mp = MixedPrecisionPolicy(param_dtype=rt.torch_dtype, reduce_dtype=torch.float32)
        for block in model.transformer.h:
            if s["compile"]:
                block.compile()  # per block: whole-model compile would trace through FSDP's hooks
            fully_shard(block, mp_policy=mp)
        return fully_shard(model, mp_policy=mp)
    compiled = torch.compile(model) if s["compile"] else model
    return wrap_ddp(compiled, rt, d.local_rank) if d.enabled else compiled


def wrap_ddp(model: torch.nn.Module, rt: runtime.Runtime, local_rank: int) -> DDP:
    # the only buffers (causal masks, the padded-vocab bias) are derived and alike on every rank: DDP's default
    # would broadcast them from rank 0 before every forward (~13 MB at GPT-2 size). torch 2.13 renamed the switch.
    new_name = "forward_sync_buffers" in inspect.signature(DDP).parameters
    no_sync = {"forward_sync_buffers" if new_name else "broadcast_buffers": False}
    return DDP(model, device_ids=[local_rank] if rt.is_cuda else None, **no_sync)


def gradient_sync(model: torch.nn.Module, sync: bool):
    """Gradient accumulation: reduce gradients across ranks only on the last micro-step."""
    if isinstance(model, DDP):
        return nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return nullcontext()


FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(model: GPT, optimizer) -> tuple[dict, dict]:
    """Unsharded model and optimizer state (collective: every rank calls it), keyed by parameter name, so
    a checkpoint loads the same under one process, DDP or FSDP."""
    return get_model_state_dict(model, options=FULL_STATE), get_optimizer_state_dict(model, optimizer, options=FULL_STATE)


# -- logging -------------------------------------------------------------------------------------------

class MetricsLog:
    """Console, out_dir/metrics.jsonl, and wandb when enabled. Only the master rank writes."""

    def __init__(self, s: dict, run_config: dict, enabled: bool, to_file: bool = True):
        self.enabled, self.wandb = enabled, None
        self.path = Path(s["out_dir"]) / "metrics.jsonl" if to_file else None
        if enabled and s["wandb_log"]:
            import wandb  # mode (online/offline/disabled) comes from WANDB_MODE, never hard-coded
            self.wandb = wandb.init(project=s["wandb_project"], name=s["wandb_run_name"], config=run_config)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        text = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        print(text, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if k != "iter"}, step=metrics["iter"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


@torch.no_grad()
def estimate_loss(model, s: dict, data_dir: Path, ctx, d: runtime.Dist) -> dict:
    """Mean loss over eval_iters batches per split, the same batches at every evaluation (a fixed seed),
    different ones per rank, averaged over ranks."""
    model.eval()
    out = {}
    for split in ("train", "val"):
        batches = Batches(data_dir, s["block_size"], s["batch_size"], seed=s["seed"] + 1000 + d.rank)
        losses = []
        for x, y in batches.global_step(split, s["eval_iters"], 0, 1):
            with ctx:
                _, loss = model(x.to(d.device), y.to(d.device))
            losses.append(loss.item())
        out[split] = runtime.mean_across_ranks(sum(losses) / len(losses), d.device)
    model.train()
    return out


# -- training ------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    s = configure(globals(), sys.argv[1:] if argv is None else argv, LIMITS)
    if s["parallel"] not in ("ddp", "fsdp"):
        raise UserError(f"parallel must be 'ddp' or 'fsdp', got '{s['parallel']}'.")
    d = runtime.init_distributed(runtime.pick_device(s["device"]))
    rt = runtime.resolve_runtime(d.device, s["dtype"])
    if s["gradient_accumulation_steps"] % d.world_size:
        raise UserError(f"gradient_accumulation_steps={s['gradient_accumulation_steps']} is not divisible by "
                        f"the {d.world_size} ranks; make it a multiple of the world size.")
    micro_steps = s["gradient_accumulation_steps"] // d.world_size
    torch.manual_seed(s["seed"])  # the same initial weights on every rank (FSDP shards each rank's own copy)
    out = Path(s["out_dir"])
    ckpt_path = out / "ckpt.pt"
    if not s["eval_only"]:  # evaluation writes nothing; training must be able to write its log and checkpoint
        runtime.on_master(lambda: runtime.check_writable_dir(out), d.device)

    data_dir = dataset_dir(s["data_dir"], s["dataset"])
    runtime.on_master(lambda: prepare_if_missing(data_dir, s["dataset"]), d.device)
    meta = read_meta(data_dir)
    vocab_size = meta["vocab_size"] if meta else 50257

    resuming = s["init_from"] == "resume"
    checkpoint = runtime.load_checkpoint(ckpt_path, for_training=not s["eval_only"]) if resuming else None
    model = build_model(s, vocab_size, checkpoint).to(d.device)
    check_token_files(data_dir, model.config.vocab_size, s["block_size"])
    check_attention(model.config.attn, rt.device_type, rt.torch_dtype, model.config.dropout,
                    model.config.head_size, not s["eval_only"], s["block_size"])  # now, not after compiling
    torch.manual_seed(s["seed"] + d.rank)  # dropout differs per rank; the data generator does not
    raw_model = model
    model = parallelize(raw_model, s, d, rt)  # FSDP shards raw_model's parameters in place
    iter_num = checkpoint["iter_num"] if resuming else 0
    ctx = rt.autocast()
    if s["eval_only"]:  # the loss of the weights as they are, at their step; nothing is written
        losses = estimate_loss(model, s, data_dir, ctx, d)
        log = MetricsLog(s, s, enabled=d.is_master, to_file=False)
        log.log({"iter": iter_num, "train/eval_loss": losses["train"], "val/loss": losses["val"]})
        log.close()
        return 0
    optimizer = raw_model.configure_optimizers(s["weight_decay"], s["learning_rate"], (s["beta1"], s["beta2"]),
                                               rt.device_type)
    scaler = rt.grad_scaler()
    batches = Batches(data_dir, s["block_size"], s["batch_size"], seed=s["seed"])
    best_val_loss = float("inf")
    if checkpoint is not None:
        set_optimizer_state_dict(raw_model, optimizer, checkpoint["optimizer"], options=FULL_STATE)
        restore_rng(checkpoint["rng"], batches, d)
        best_val_loss = checkpoint["best_val_loss"]
        checkpoint = None  # free the memory
    if d.enabled:
        local = [None] * d.world_size
        torch.distributed.all_gather_object(local, sum(local_numel(p) for p in raw_model.parameters()))
        if d.is_master:
            print(f"parameter elements per rank ({s['parallel']}): {' '.join(map(str, local))} "
                  f"of {sum(p.numel() for p in raw_model.parameters())}")

    tokens_per_iter = s["gradient_accumulation_steps"] * s["batch_size"] * s["block_size"]  # over all ranks
    run_config = {**s, "world_size": d.world_size, "device_name": rt.name,
                  "resolved_dtype": rt.dtype, "torch_version": torch.__version__, "resolved_attn": raw_model.config.attn,
                  "tokens_per_iter": tokens_per_iter, "num_params": raw_model.get_num_params()}
    log = MetricsLog(s, run_config, enabled=d.is_master)
    if d.is_master:
        print(f"{raw_model.get_num_params() / 1e6:.2f}M parameters, attn={raw_model.config.attn}, {rt.dtype} on "
              f"{rt.name}, world size {d.world_size}, {tokens_per_iter:,} tokens per iteration")
    peak_flops = rt.peak_flops  # measured on CPU and unlisted GPUs: before the clock starts
    timer = runtime.StepTimer(rt)
    steps_run = 0  # optimizer steps taken by this process
    # a resumed run was evaluated (and saved) at this very step before it stopped: do not repeat it
    resumed_at = iter_num if resuming else None
    try:
        while True:
            lr = lr_at(iter_num, s)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # every rank must stop at the same step, so one rank's clock running out stops them all
            out_of_time = s["max_seconds"] > 0 and runtime.mean_across_ranks(
                float(timer.total >= s["max_seconds"]), d.device) > 0
            done = iter_num >= s["max_iters"] or out_of_time
            if (iter_num % s["eval_interval"] == 0 or done) and iter_num != resumed_at:
                timer.pause()
                losses = estimate_loss(model, s, data_dir, ctx, d)
                log.log({"iter": iter_num, "train/eval_loss": losses["train"], "val/loss": losses["val"], "lr": lr,
                         "train_time_s": timer.total})
                if not math.isfinite(losses["val"]):
                    raise UserError(f"validation loss is {losses['val']} at iter {iter_num}; training diverged "
                                    f"(try a lower learning_rate); the last good checkpoint in {out} is kept.")
                if iter_num > 0 and (losses["val"] < best_val_loss or s["always_save_checkpoint"]):
                    best_val_loss = min(best_val_loss, losses["val"])
                    rng = rng_state(batches, d)
                    model_state, optimizer_state = full_state(raw_model, optimizer)
                    if d.is_master:
                        runtime.save_checkpoint({
                            "model": model_state, "model_config": dataclasses.asdict(raw_model.config),
                            "optimizer": optimizer_state, "iter_num": iter_num,
                            "best_val_loss": best_val_loss, "settings": s, "meta": meta, "rng": rng,
                        }, ckpt_path)
            if done:
                break

            # a compiled model compiles during its first step: it trains, but stays out of ms/iter and max_seconds
            timed = not (s["compile"] and steps_run == 0)
            if timed and not timer.running:
                timer.start()
            loss_sum = torch.zeros((), device=d.device)
            micro_batches = batches.global_step("train", micro_steps, d.rank, d.world_size)
            for micro, (x, y) in enumerate(micro_batches):
                with gradient_sync(model, sync=micro == micro_steps - 1):
                    if rt.is_cuda:  # pinned memory lets the copy overlap with compute
                        x, y = x.pin_memory(), y.pin_memory()
                    with ctx:
                        _, loss = model(x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True))
                    scaler.scale(loss / micro_steps).backward()
                loss_sum += loss.detach()
            if s["grad_clip"] > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if timed:
                timer.step()
            steps_run += 1
            iter_num += 1

            if iter_num % s["log_interval"] == 0:
                seconds, steps = timer.read_and_reset()
                loss = runtime.mean_across_ranks(loss_sum.item() / micro_steps, d.device)
                if not math.isfinite(loss):
                    raise UserError(f"training loss is {loss} at iter {iter_num}; training diverged (try a lower "
                                    f"learning_rate or grad_clip); the last good checkpoint in {out} is kept.")
                metrics = {"iter": iter_num, "train/loss": loss, "lr": lr}
                if steps:  # none when the only step since the last log was the compiling one
                    tokens_per_s = tokens_per_iter * steps / seconds
                    metrics.update(ms_per_iter=1000 * seconds / steps, tokens_per_s=tokens_per_s,
                                   mfu=raw_model.estimate_mfu(tokens_per_s / d.world_size, peak_flops, s["block_size"]))
                log.log({**metrics, "mem/peak_gb": rt.peak_memory_gb()})
        if d.enabled and s["parallel"] == "ddp":
            digests = [None] * d.world_size
            torch.distributed.all_gather_object(digests, parameter_digest(raw_model))
            if d.is_master:
                print(f"parameter digest per rank: {' '.join(digests)}")
            if len(set(digests)) != 1:
                raise RuntimeError("ranks hold different parameters after training: DDP fell out of step")
    finally:
        log.close()
    return 0


if __name__ == "__main__":
    runtime.run_main(main)
