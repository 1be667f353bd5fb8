"""
Train a GPT on one CPU, one GPU, or many GPUs with DDP or FSDP2.

    python train.py config/train_shakespeare_char_cpu.py            # the CPU quickstart, a few minutes
    python train.py config/train_shakespeare_char.py --compile=False
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py --attn=flash  # more nodes: docs/training.md

Every setting below can be set in a config file or overridden with --key=value.
"""

if __name__ == "__main__":  # a Ctrl-C while the imports below load ends the process quietly (main handles its own)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from core import flops
from core import files
from core import runtime
from engine.checkpoint import Checkpoint, SingleFileSaver, rng_state
from core.configurator import PATH, SEED, Settings, one_of
from core.dataset import Batches
from core.errors import UserError
from engine import startup
from engine.metrics import MetricsLog, Progress, banner, resume_hint
from engine.trainer import Trainer, lr_multiplier, make_optimizers, set_learning_rates
from model import GPT, IMPLEMENTATIONS, SHAPE_RANGES, GPTConfig
from core.runtime import Runtime

# I/O
out_dir = "out"                   # checkpoint (ckpt.pt) and metrics.jsonl go here
eval_interval = 2000              # evaluate (and checkpoint) every this many iterations
log_interval = 1                  # log training metrics every this many iterations
eval_iters = 200                  # batches per split for each evaluation; 0: all of val.bin, every token once (the
                                  # whole split's loss, as lm-eval reads a text), train's split not evaluated
eval_train = True                 # evaluate train batches too (the overfitting check); False: val only, half the cost
eval_only = False                 # evaluate once (a resumed model at its step), write nothing, exit
always_save_checkpoint = True     # save at every eval, not only when val loss improves
init_from = "scratch"             # 'scratch', 'resume' (from out_dir), 'gpt2*', or a local Hugging Face directory
overwrite = False                 # a new run (init_from not 'resume') may replace another run's checkpoint in out_dir
max_seconds = 0.0                 # stop after this much training time (eval excluded), then evaluate and save; 0: off
checkpoint_format = "single"      # 'single': ckpt.pt, gathered on rank 0; 'sharded': each rank writes its own shards
                                  # into out_dir/step-N/ (torch.distributed.checkpoint), resumable on any world size
async_save = False                # sharded: write the checkpoint while training goes on
keep_checkpoints = 2              # sharded: how many of the newest steps out_dir keeps
# wandb logging (the mode comes from the environment: WANDB_MODE=offline or disabled work as usual)
wandb_log = False                 # log every line to wandb too (needs `wandb login`, or WANDB_MODE=offline)
wandb_project = "owt"             # the wandb project the run goes to
wandb_run_name = "gpt2"           # the run's name there
# data
dataset = "openwebtext"           # data/<dataset>/{train,val}.bin, from data/<dataset>/prepare.py
data_dir = ""                     # where train.bin/val.bin/meta.json are; empty: data/<dataset>
gradient_accumulation_steps = 40  # micro-steps per optimizer step, in total over all ranks
batch_size = 12                   # sequences per micro-step per rank
block_size = 1024                 # tokens per sequence: the model's context
# model
n_layer = 12                      # transformer blocks
n_head = 12                       # attention heads per block (n_embd must divide by it)
n_embd = 768                      # the width: embedding and hidden size
dropout = 0.0                     # 0 for pretraining, 0.1+ for finetuning
bias = True                       # biases in Linear and LayerNorm, as GPT-2
attn = "sdpa"                     # manual, sdpa, flash, flex, ... (docs/model.md); auto: measured on this run's shapes
attn_auto_budget = 20.0           # attn='auto': seconds to spend measuring (a cached or resumed decision takes none)
attn_auto_refresh = False         # attn='auto': measure again even when an earlier run decided this workload
pad_vocab = False                 # pad the vocabulary to a multiple of 64 (50257 -> 50304)
doc_mask = False                  # attend within a document only (the dataset's end-of-text token opens the next)
window = 0                        # attend to at most the last `window` tokens (sliding window); 0: the whole block
gelu = "tanh"                     # GPT-2's tanh GELU, or 'none': the exact (erf) one, PyTorch's approximate='none'
chunked_loss = True               # the loss over row chunks: the (B*T, V) logits never whole (nanoGPT's same loss)
# optimizer: AdamW for everything, or Muon for the blocks' weight matrices and AdamW for the rest
optimizer = "adamw"               # 'adamw' or 'muon'
muon_lr = None                    # Muon's peak learning rate (None: learning_rate; its update is scaled to AdamW's RMS)
muon_momentum = 0.95              # Muon's Nesterov momentum
muon_dtype = "auto"               # Newton-Schulz dtype: auto (bf16 where a bf16 step is faster: CUDA from Ampere,
                                  # a CPU with AMX from 256 wide; else fp32), float32, bfloat16
learning_rate = 6e-4              # AdamW's peak learning rate
max_iters = 600000                # optimizer steps in all (a resumed run stops here too)
weight_decay = 1e-1               # AdamW's, on 2-D weights only (and Muon's)
beta1 = 0.9                       # AdamW's first-moment decay
beta2 = 0.95                      # AdamW's second-moment decay
grad_clip = 1.0                   # clip gradients at this norm; 0: off
# learning rate schedule: linear warmup, then cosine decay to min_lr
decay_lr = True                   # False: learning_rate throughout
warmup_iters = 2000               # steps of linear warmup from ~0
lr_decay_iters = 600000           # ~= max_iters per Chinchilla
min_lr = 6e-5                     # ~= learning_rate / 10 per Chinchilla
early_decay_iters = 0             # > warmup_iters: the cosine first reaches early_decay_to x learning_rate here
early_decay_to = 0.3              # with early_decay_iters: the fraction of learning_rate reached there
# system
device = "auto"                   # auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps
dtype = "auto"                    # auto: bf16 where a bf16 step beats fp32 (CUDA from Ampere, a CPU with AMX), fp16
                                  # on older GPUs, else fp32; or float32, bfloat16, float16
compile = True                    # torch.compile the model (FSDP: each block)
threads = 0                       # CPU threads, set once at start; 0: OMP_NUM_THREADS if set, else torch's default
                                  # (one per physical core)
backend = "auto"                  # torchrun's process group: auto (NCCL on CUDA, gloo on CPU), nccl, gloo (nanoGPT's)
parallel = "ddp"                  # under torchrun: 'ddp' (full replica per rank) or 'fsdp' (FSDP2, sharded)
seed = 1337                       # weights, data order and dropout (each rank its own dropout stream)
# -----------------------------------------------------------------------------

# the allowed range of every numeric setting ("[1, inf)" is 1 or more) and the words of every choice, checked before
# anything runs
LIMITS = {
    "attn": one_of("auto", *IMPLEMENTATIONS), "gelu": one_of("tanh", "none"), "optimizer": one_of("adamw", "muon"),
    "muon_dtype": one_of("auto", "float32", "bfloat16"), "dtype": one_of("auto", *runtime.DTYPES),
    "parallel": one_of("ddp", "fsdp"), "backend": one_of("auto", "nccl", "gloo"),
    "checkpoint_format": one_of("single", "sharded"),
    "keep_checkpoints": "[1, inf)",
    "eval_interval": "[1, inf)", "log_interval": "[1, inf)", "eval_iters": "[0, inf) int", "max_seconds": "[0, inf)",
    "gradient_accumulation_steps": "[1, inf)", "batch_size": "[1, inf)", **SHAPE_RANGES,
    "learning_rate": "(0, inf)", "max_iters": "[0, inf)", "weight_decay": "[0, inf)", "beta1": "[0, 1)",
    "beta2": "[0, 1)", "grad_clip": "[0, inf)", "warmup_iters": "[0, inf)", "lr_decay_iters": "[0, inf)",
    "min_lr": "[0, inf)", "seed": SEED, "muon_lr": "(0, inf)", "muon_momentum": "[0, 1)",
    "early_decay_iters": "[0, inf)", "early_decay_to": "(0, 1]", "attn_auto_budget": "(0, inf)",
    "threads": "[0, inf) int", "out_dir": PATH, "data_dir": PATH, "init_from": PATH, "dataset": PATH,
}


# -- model, optimizer, checkpoint ------------------------------------------------------------------------

def build_model(cfg: Settings, meta: dict | None) -> GPT:
    """The model this run trains: new, of a resumed checkpoint's shape (cfg holds it), or GPT-2's; attention, its
    masks and dropout are this run's settings whatever the weights were trained with."""
    vocab_size = meta["vocab_size"] if meta else files.GPT2_VOCAB_SIZE
    run = dict(attn="sdpa" if cfg.attn == "auto" else cfg.attn,  # auto: set once measured, in train()
               dropout=cfg.dropout, doc_mask=cfg.doc_mask, window=cfg.window, eot_token=files.eot_token_of(meta),
               chunked_loss=cfg.chunked_loss)
    if cfg.init_from in ("scratch", "resume"):  # a resume's shape is in cfg (resumed_settings), its weights restore's
        shape = {"vocab_size": vocab_size, **cfg.as_dict()}
        model = GPT(GPTConfig.build(shape, run))
    else:
        model = GPT.from_pretrained(cfg.init_from, dict(pad_vocab=cfg.pad_vocab, **run))
    if model.config.vocab_size != vocab_size:  # a hub id's weights, known only now (startup checks the others)
        raise UserError(f"init_from={cfg.init_from!r} has vocab_size {model.config.vocab_size} but the data has "
                        f"{vocab_size}; use the data the weights were trained on.")
    if cfg.block_size != model.config.block_size:  # GPT-2's, shorter only: crop_block_size refuses a longer one
        model.crop_block_size(cfg.block_size)
    return model


def parallelize(model: GPT, cfg: Settings, rt: Runtime) -> torch.nn.Module:
    """The model compiled and, under torchrun, wrapped (core/distributed.py: DDP, or FSDP2 sharding it in place)."""
    if not rt.is_distributed:
        return torch.compile(model) if cfg.compile else model
    from core.distributed import wrap  # only a run of several ranks wraps its model
    return wrap(model, cfg.parallel, cfg.compile, rt)


@torch.no_grad()
def estimate_loss(model, cfg: Settings, data: Batches, rt: Runtime, first: bool = False) -> dict:
    """Mean loss over eval_iters batches per split (the same at every evaluation, different per rank), over all ranks:
    {"train/loss": ..., "val/loss": ...}, or val alone when eval_train is off. eval_iters=0: val alone, every
    token of val.bin once (tools/whole_split.py), the split's own loss that the sampled one estimates. The `first`
    evaluation says what it does before it starts, and any says how long it takes when that is long (a CPU's first
    can take half an hour)."""
    model.eval()
    whole = cfg.eval_iters == 0
    out, splits = {}, ("train", "val") if cfg.eval_train and not whole else ("val",)
    pairs, count = {}, 0  # each split's batches, read one at a time: this rank's own, seeded by rank, the same at
    if whole:
        from tools.whole_split import whole_split, whole_split_batches  # only --eval_iters=0 reads every token
    for split in splits:  # every evaluation
        batches = Batches(data.data_dir, cfg.block_size, cfg.batch_size, seed=cfg.seed + 1000 + rt.rank,
                          opened=data.opened)  # the training's own open files
        pairs[split] = whole_split(batches, split, rt.rank, rt.world_size) if whole else \
            batches.micro_batches(split, cfg.eval_iters, lazy=True)
        count += whole_split_batches(batches, split, rt.rank, rt.world_size) if whole else cfg.eval_iters
    # announced where it may be long: compiling, or many batches
    progress = Progress(f"evaluating {'all of val.bin' if whole else ' and '.join(splits)}", count, rt.is_master,
                        announce=first and (cfg.compile or count >= 100))
    wide = torch.float32 if rt.device_type == "mps" else torch.float64  # the sum over a whole split: no drift
    for split in splits:
        total, tokens = torch.zeros((), dtype=wide, device=rt.device), 0  # the loss summed over this rank's tokens
        for x, y in pairs[split]:
            with rt.autocast():
                _, loss = model(*rt.to_device(x, y))
            counted = int((y != -1).sum())  # y is on the host: targets already scored are -1
            total += loss.to(wide) * counted
            tokens += counted
            progress.tick(total)
        total, tokens = runtime.sum_across_ranks_(torch.stack([total, torch.full_like(total, tokens)])).tolist()
        out["val/loss" if split == "val" else "train/loss"] = total / tokens  # one read per split
        if whole:
            out["val/tokens"] = int(tokens)
    model.train()
    return out


# -- training ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainingRun:
    """What the loop works with: settings, runtime, the Trainer (model, optimizers, the step), data, log, progress."""
    cfg: Settings
    rt: Runtime
    trainer: Trainer
    batches: Batches                     # the token files, open for the run's life (evaluations read them too)
    meta: dict | None
    saver: object                        # checkpoint.SingleFileSaver or sharded.ShardedSaver
    log: MetricsLog | None = None        # made once attention is chosen (its first line names it)
    iter_num: int = 0
    best_val_loss: float = math.inf
    time_before: float = 0.0             # training seconds the resumed checkpoint had behind it
    attn_decision: dict | None = None    # attn=auto's table and pick (None: attn was named)
    saved_at: int | None = None          # the iter of the newest checkpoint in out_dir (the resumed one's at first)
    nanogpt_original: bool = False       # out_dir's ckpt.pt is nanoGPT's: copied aside before the first save over it

    def evaluate_and_save(self, lr: float, train_time_s: float) -> None:
        """Log the evaluation's loss (val, and train unless eval_train=False); stop on a NaN/inf; save when val
        improved (or always_save_checkpoint), never at iter 0."""
        losses = estimate_loss(self.trainer.wrapped, self.cfg, self.batches, self.rt, first=self.saved_at is None
                               and self.iter_num == 0)
        train_time_s += self.time_before  # this run's, continuing the resumed one's
        self.log.log({"iter": self.iter_num, **losses, "lr": lr, "train_time_s": train_time_s})
        val_loss = losses["val/loss"]
        self.stop_if_diverged("validation", val_loss, self.iter_num)
        if self.iter_num == 0 or not (val_loss < self.best_val_loss or self.cfg.always_save_checkpoint):
            return
        self.best_val_loss = min(self.best_val_loss, val_loss)
        rng = rng_state(self.batches.generator, self.rt)  # collective: each rank gathers every rank's RNG state
        if self.nanogpt_original:  # kept now, when it is replaced: a run stopped by an error before this wrote nothing
            from tools.nanogpt import keep_original
            runtime.on_master(lambda: keep_original(Path(self.cfg.out_dir) / "ckpt.pt"), self.rt.device)
            self.nanogpt_original = False
        model = self.trainer.model
        self.saver.save(model, self.trainer.optimizers, dict(
            model_config=dataclasses.asdict(model.config), iter_num=self.iter_num, best_val_loss=self.best_val_loss,
            train_time_s=train_time_s, rng=rng, settings=self.cfg.as_dict(), meta=self.meta,
            attn_decision=self.attn_decision))
        self.saved_at = self.iter_num


    def print_line(self, it: int, lr: float, loss: float, since: Optional[tuple[int, float]], now: float,
                   peak_flops: Optional[float]) -> None:
        """A logged step's line: its loss, and the speed over the steps since the clock's last reading `since`
        ((iter, time); None: the clock did not run, the step compiled)."""
        self.stop_if_diverged("training", loss, it)
        metrics = {"iter": it, "train/step_loss": loss, "lr": lr}
        if since is not None and it > since[0]:
            steps, seconds = it - since[0], now - since[1]
            tokens_per_s = tokens_per_iter(self.cfg) * steps / seconds
            metrics.update(ms_per_iter=1000 * seconds / steps, tokens_per_s=tokens_per_s)
            if peak_flops is not None:
                metrics["mfu"] = 100 * self.trainer.model.model_flops_utilization(tokens_per_s / self.rt.world_size,
                                                                           peak_flops, self.cfg.block_size)
        self.log.log({**metrics, **self.rt.memory_metrics()})

    def stop_if_diverged(self, which: str, loss: float, it: int) -> None:
        if math.isfinite(loss):
            return
        kept = f"the checkpoint of iter {self.saved_at} in {self.cfg.out_dir} is kept" if self.saved_at is not None \
            else "no checkpoint was saved"
        raise UserError(f"{which} loss is {loss} at iter {it}; training diverged (try a lower learning_rate, or "
                        f"grad_clip); {kept}.")


def tokens_per_iter(cfg: Settings) -> int:  # over all ranks
    return cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size


def train_loop(run: TrainingRun, resumed_at: int | None) -> None:
    """Step until max_iters or max_seconds, evaluating and saving every eval_interval steps and at the end (a resumed
    run not again at resumed_at). The clock, as nanoGPT's: a logged step waits for the device and reads its loss, and
    its line times the steps since the last reading; the compiling step and evaluations are left out."""
    cfg, rt = run.cfg, run.rt
    micro_steps = cfg.gradient_accumulation_steps // rt.world_size
    peak_flops = flops.peak_flops(rt)  # a GPU's datasheet figure; None on a CPU
    if rt.is_master:
        print(flops.peak_line(rt, peak_flops))
    trained, started = 0.0, 0.0  # seconds of training before the clock last started, and when it did
    since = None  # the clock's last reading, (iter, time); None while it is stopped
    steps_run, out_of_time = 0, False

    def evaluates(it: int) -> bool:  # at max_iters and every eval_interval; time running out evaluates too
        return it >= cfg.max_iters or it % cfg.eval_interval == 0
    try:
        while True:
            multiplier = lr_multiplier(run.iter_num, cfg)
            set_learning_rates(run.trainer.optimizers, multiplier)
            lr = cfg.learning_rate * multiplier  # the log's lr: AdamW's (Muon's is muon_lr times the same)
            done = run.iter_num >= cfg.max_iters or out_of_time
            if (evaluates(run.iter_num) or out_of_time) and run.iter_num != resumed_at:
                if since is not None:  # the clock stops (the step before was logged): evaluating is not training
                    trained, since = trained + time.perf_counter() - started, None
                # the lr both of iter N's lines show: the rate of the step that made iter N's weights
                run.evaluate_and_save(cfg.learning_rate * lr_multiplier(max(0, run.iter_num - 1), cfg), trained)
            if done:
                break
            # a compiled model compiles during its first step: it trains, but stays out of ms/iter and max_seconds
            compiling = cfg.compile and steps_run == 0
            if compiling and rt.is_master:
                print("compiling the training step: the first step takes a minute or more, left out of ms_per_iter",
                      flush=True)
            if since is None and not compiling:  # the clock starts with nothing queued
                rt.synchronize()
                started = time.perf_counter()
                since = (run.iter_num, started)
            loss = run.trainer.step(run.batches.micro_batches("train", micro_steps, rt.rank, rt.world_size))
            steps_run += 1
            run.iter_num += 1
            timed_out = cfg.max_seconds > 0 and since is not None and \
                trained + time.perf_counter() - started >= cfg.max_seconds
            if not rt.is_distributed:  # under torchrun the ranks stop together on the flag a logged step carries
                out_of_time = timed_out
            first_timed = steps_run == (2 if cfg.compile else 1)  # a first line at once, whatever log_interval says
            if run.iter_num % cfg.log_interval == 0 or evaluates(run.iter_num) or out_of_time or first_timed:
                values = runtime.sum_across_ranks_(torch.stack([loss.detach().float(), torch.full_like(
                    loss, float(rt.is_distributed and timed_out), dtype=torch.float32)]))
                rt.synchronize()
                now = time.perf_counter()
                loss_sum, flag = values.tolist()
                out_of_time |= flag > 0
                run.print_line(run.iter_num, lr, loss_sum / rt.world_size, since, now, peak_flops)
                since = (run.iter_num, now) if since is not None else None
    finally:
        run.saver.close()  # an asynchronous save still writing finishes first
        run.log.close()


def choose_attention(run: TrainingRun) -> None:
    """Set the attention this run trains with, before the first forward (compiling is lazy): the one named, or for
    attn=auto the resumed decision where this run's workload is the one it decided, else measured now on rank 0 for
    every rank (without moving the RNG streams a resume restored)."""
    cfg, rt, model = run.cfg, run.rt, run.trainer.model
    if cfg.attn != "auto":
        run.attn_decision = None
    else:
        from attention.attn_auto import choose_for_training
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if rt.is_cuda else []):
            run.attn_decision = choose_for_training(model, IMPLEMENTATIONS, cfg, rt, run.attn_decision)
    attn = run.attn_decision["attn_auto/pick"] if run.attn_decision else model.config.attn
    # checked where it runs, in the dtype it computes in
    model.set_attention(attn, training=not cfg.eval_only, dtype=rt.torch_dtype)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the settings, every start-up problem at once, the runtime, a resume's checkpoint, the data, out_dir locked
    cfg, rt, checkpoint, data_dir, meta, lock = startup.start(globals(), argv, LIMITS)
    try:
        train(cfg, rt, checkpoint, data_dir, meta, argv)
    finally:
        if lock is not None:
            lock.release()
    return 0


def train(cfg: Settings, rt: Runtime, checkpoint: Optional[Checkpoint], data_dir: Path, meta: Optional[dict],
          argv: list[str]) -> None:
    saver = SingleFileSaver(Path(cfg.out_dir), rt)
    if cfg.checkpoint_format == "sharded":  # each rank writes its own shards (DCP)
        from tools.sharded import ShardedSaver
        saver = ShardedSaver(Path(cfg.out_dir), cfg.keep_checkpoints, cfg.async_save, rt)
    # model: the same initial weights on every rank (FSDP shards each rank's own copy)
    torch.manual_seed(cfg.seed)
    raw_model = build_model(cfg, meta).to(rt.device)
    torch.manual_seed(cfg.seed + rt.rank)  # dropout differs per rank; the data generator does not
    model = parallelize(raw_model, cfg, rt)  # FSDP shards raw_model's parameters in place
    optimizers = [] if cfg.eval_only else make_optimizers(raw_model, cfg, rt)
    batches = Batches(data_dir, cfg.block_size, cfg.batch_size, seed=cfg.seed)
    trainer = Trainer(raw_model, optimizers, rt.grad_scaler(), rt, cfg.grad_clip, wrapped=model)
    run = TrainingRun(cfg, rt, trainer, batches, meta, saver)
    resumed_at = None
    if checkpoint is not None:
        from engine.resume import restore
        resumed_at = restore(run, checkpoint)
    choose_attention(run)
    run_config = {**cfg.as_dict(), "world_size": rt.world_size, "device_name": rt.name, "resolved_dtype": rt.dtype,
                  "resolved_muon_dtype": rt.muon_dtype if cfg.optimizer == "muon" else None,
                  "torch_version": torch.__version__, "resolved_attn": raw_model.config.attn,
                  "tokens_per_iter": tokens_per_iter(cfg), "num_params": raw_model.get_num_params(),
                  "attn_decision": run.attn_decision}
    run.log = MetricsLog(cfg, run_config, enabled=rt.is_master, to_file=not cfg.eval_only)
    if cfg.eval_only:  # the loss of the weights as they are, at their step; nothing is written
        losses = estimate_loss(model, cfg, batches, rt, first=True)
        run.log.log({"iter": run.iter_num, **losses})
        if "val/tokens" in losses and rt.is_master:  # the whole split: the digits to hold lm-eval's figure against
            print(f"val/loss {losses['val/loss']:.10f} nats a token over {losses['val/tokens']:,} tokens of "
                  f"val.bin in {rt.dtype} (the sum: {losses['val/loss'] * losses['val/tokens']:.6f} nats)")
        run.log.close()
        return
    if run.attn_decision:  # the whole table beside the run's metrics (wandb has it in the run's config)
        run.log.log({"iter": run.iter_num, **{k: v for k, v in run.attn_decision.items() if "workload" not in k}})
    if rt.is_master:
        print(banner(cfg, rt, raw_model, tokens_per_iter(cfg)))
        if resumed_at is not None:
            behind = "nanoGPT's checkpoint does not record its training time: train_time_s counts from 0" if \
                run.nanogpt_original else f"{run.time_before:.0f} s of training behind it"
            print(f"resumed from iter {resumed_at} of {cfg.out_dir} ({behind})")
        if resumed_at is not None and resumed_at >= cfg.max_iters:
            print(f"nothing to train: the checkpoint is already at iter {resumed_at} >= max_iters={cfg.max_iters}; "
                  f"to train further pass a larger --max_iters= (and --lr_decay_iters= to match).")
    try:
        train_loop(run, resumed_at)
    except BaseException as e:  # diverged, Ctrl-C, SIGTERM during a save: what is kept, and how to go on
        if rt.is_master and isinstance(e, KeyboardInterrupt):
            print(resume_hint(cfg, run, argv), file=sys.stderr)
        if rt.is_distributed and isinstance(e, RuntimeError):  # a rank lost mid-run: this rank's own line
            from core.distributed import lost_a_rank
            if lost_a_rank(e):
                reason = str(e).split("] ", 1)[-1].split(". ")[0]
                raise UserError(f"another rank stopped mid-run ({reason}); {resume_hint(cfg, run, argv)}",
                                own_rank=True) from None
        raise


if __name__ == "__main__":
    runtime.run_main(main)
