"""
What train.py does before it builds a model, in two checks that each print every problem they find at once: the
command (its settings, the rules between them, the folders and services it needs) before anything is written, then,
once the data is prepared, the data itself. A new start-up rule is a row of RULES or an entry of environment().

    cfg, rt, checkpoint, data_dir, meta, lock = start(globals(), argv, LIMITS)
"""

from pathlib import Path
from typing import Optional

from core import errors, files, runtime, writing
from core.configurator import Settings, configure
from core.dataset import NO_END_OF_TEXT, check_token_files, dataset_dir, prepare_if_missing
from core.errors import UserError, problems_of
from core.runtime import Runtime
from engine.checkpoint import Checkpoint, describe_tokens

RUNTIME_SETTINGS = ("device", "dtype", "muon_dtype", "threads", "backend")
CPU_COMMAND = ("torchrun --standalone --nproc_per_node=2 train.py config/train_shakespeare_char_cpu.py "
               "--gradient_accumulation_steps=2 --batch_size=16 --out_dir=out-ddp-cpu")

# The rules between settings: (error, note, or hint: a note printed with the errors too; the settings it reads; whether
# it applies; what it says). A rule that reads a setting already out of range is skipped (its own problem is named).
RULES = [
    ("error", "optimizer parallel", lambda c, rt: c.optimizer == "muon" and rt.is_distributed and
     c.parallel == "fsdp", lambda c, rt: "optimizer='muon' does not run under --parallel=fsdp: Muon orthogonalizes "
     "each whole weight matrix and FSDP2 gives every rank a shard of it; use --parallel=ddp."),
    ("error", "async_save checkpoint_format", lambda c, rt: c.async_save and c.checkpoint_format == "single",
     lambda c, rt: "async_save=True writes sharded checkpoints only; add --checkpoint_format=sharded."),
    ("error", "gradient_accumulation_steps", lambda c, rt: c.gradient_accumulation_steps % rt.world_size,
     lambda c, rt: f"gradient_accumulation_steps={c.gradient_accumulation_steps} is not divisible by the "
                   f"{rt.world_size} ranks; make it a multiple of the world size."),
    ("error", "doc_mask dataset data_dir", lambda c, rt: c.doc_mask and not c.data_dir and c.dataset in
     NO_END_OF_TEXT, lambda c, rt: f"doc_mask needs the end-of-text token that separates documents, and "
     f"{c.dataset}'s characters have none; use --dataset=shakespeare (GPT-2 BPE, one document a scene) or "
     f"doc_mask=False."),
    ("note", "window block_size", lambda c, rt: c.window >= c.block_size, lambda c, rt:
     f"window={c.window} is not shorter than block_size={c.block_size}, so every token sees its whole block: no "
     f"sliding window (pass --window= below {c.block_size}, or 0)"),
    ("note", "decay_lr warmup_iters lr_decay_iters eval_only", lambda c, rt: c.decay_lr and not c.eval_only and
     c.warmup_iters > c.lr_decay_iters, lambda c, rt: f"warmup_iters={c.warmup_iters} is past lr_decay_iters="
     f"{c.lr_decay_iters}: the rate climbs for {c.warmup_iters} steps, then drops to min_lr at once; set "
     f"lr_decay_iters above it (often max_iters)"),
    ("note", "decay_lr min_lr learning_rate eval_only", lambda c, rt: c.decay_lr and not c.eval_only and
     c.min_lr > c.learning_rate, lambda c, rt: f"min_lr={c.min_lr:g} is above learning_rate={c.learning_rate:g}: the "
     f"decay raises the rate; set min_lr below it (often learning_rate / 10)"),
    ("note", "decay_lr early_decay_iters warmup_iters lr_decay_iters eval_only", lambda c, rt: c.decay_lr and
     not c.eval_only and c.early_decay_iters and not c.warmup_iters < c.early_decay_iters < c.lr_decay_iters,
     lambda c, rt: f"early_decay_iters={c.early_decay_iters} is not between warmup_iters={c.warmup_iters} and "
                   f"lr_decay_iters={c.lr_decay_iters}, so there is no early decay"),
    ("note", "n_layer n_embd gradient_accumulation_steps batch_size block_size eval_only", lambda c, rt: not
     c.eval_only and 12 * c.n_layer * c.n_embd ** 2 < 10e6 and c.gradient_accumulation_steps >= 8, lambda c, rt: f"a model of about "
     f"{12 * c.n_layer * c.n_embd ** 2:,} block parameters takes {c.gradient_accumulation_steps} micro-steps "
     f"({c.gradient_accumulation_steps * c.batch_size * c.block_size:,} tokens) an iteration, GPT-2's batch; a model "
     f"this small usually learns faster per second with --gradient_accumulation_steps=1"),
    ("note", "block_size batch_size device", lambda c, rt: rt.device_type == "cpu" and c.block_size > 8192, lambda c, rt:
     f"block_size={c.block_size:,} on a CPU: every step and evaluation batch attends over {c.batch_size} x "
     f"{c.block_size:,} positions, which can take minutes a batch here before any line is printed (a typo? GPT-2's is "
     f"1024)"),
    ("note", "dtype device", lambda c, rt: rt.device_type == "cpu" and rt.dtype == "float16", lambda c, rt: "float16 on a "
     "CPU is emulated, several times slower than float32; --dtype=float32 (or bfloat16 where the CPU has it)"),
    ("hint", "n_layer n_embd device eval_only", lambda c, rt: rt.device_type == "cpu" and not c.eval_only and
     12 * c.n_layer * c.n_embd ** 2 > 50e6,
     lambda c, rt: f"this is a GPU-sized model: on this CPU its first evaluation alone takes hours; the CPU recipe "
                   f"is {CPU_COMMAND}"),
]


def start(namespace: dict, argv: list[str], limits: dict) -> tuple[Settings, Runtime, Optional[Checkpoint], Path,
                                                                   Optional[dict], Optional[writing.OutDirLock]]:
    """Settings, runtime, the checkpoint a resume continues (None for a new run), the data's folder (prepared if it is
    an embedded dataset) and its meta.json, and rank 0's lock on out_dir. Nothing is written before the command's
    problems are known; a resume locks out_dir before it reads its checkpoint (a run training there may be removing
    old steps) and runs with its checkpoint's settings (resumed_settings), so every check is the resumed run's."""
    out_of_range: dict = {}
    cfg = configure(namespace, argv, limits, out_of_range)
    if cfg.eval_only and cfg.eval_iters == 0 and "dtype" not in cfg.set_by:  # a figure to compare: fp32 unless named
        cfg = Settings({**cfg.set_by, "dtype": "--eval_iters=0"}, **{**cfg.as_dict(), "dtype": "float32"})
    rt = None
    if not out_of_range.keys() & set(RUNTIME_SETTINGS):
        try:
            rt = runtime.resolve_runtime(cfg.device, cfg.dtype, cfg.muon_dtype, distributed=True, threads=cfg.threads,
                                         backend=cfg.backend, width=cfg.n_embd)
        except UserError as e:
            out_of_range["device"] = e
    problems = list(out_of_range.values())
    if rt is None:  # no device to check against: the checks that read one are left out, the rest still run
        out_of_range.update(dict.fromkeys(set(RUNTIME_SETTINGS) - out_of_range.keys()))
        rt = runtime.Runtime("cpu", "float32")
    checkpoint, lock = None, None
    if cfg.init_from == "resume":
        cfg, rt, checkpoint, lock = read_resumed(cfg, rt, limits, problems, runtime_ok="device" not in out_of_range)
    said = [(kind, say(cfg, rt)) for kind, keys, applies, say in RULES
            if not out_of_range.keys() & set(keys.split()) and applies(cfg, rt)]
    problems += [UserError(text) for kind, text in said if kind == "error"]
    for check in environment(cfg, rt, out_of_range):
        problems += problems_of(check)
    # every rank's settings and problems compared in the first collective: ranks given other settings would
    # otherwise call different ones; a node's own problem stops every rank here
    if rt.is_distributed:
        from core.distributed import agree
        problems = agree(cfg.as_dict(), problems)
    try:
        errors.refuse_all(problems, "; ".join(text for kind, text in said if kind == "hint"))
        for kind, text in said:
            if kind == "note":
                errors.note(f"{text}.")
        data_dir = dataset_dir(cfg.data_dir, cfg.dataset)
        # rank 0 prepares an embedded dataset (the other ranks wait at a barrier); then the data's own problems
        runtime.on_master(lambda: prepare_if_missing(data_dir, cfg.dataset), rt.device)
        meta = check_data(cfg, rt, data_dir, checkpoint)
        if cfg.init_from != "resume" and not cfg.eval_only:  # a new run's out_dir, made and locked only now
            lock = runtime.on_master(lambda: writing.lock_out_dir(cfg.out_dir, cfg.overwrite, describe_run),
                                     rt.device)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return cfg, rt, checkpoint, data_dir, meta, lock


def read_resumed(cfg: Settings, rt: Runtime, limits: dict, problems: list, runtime_ok: bool) -> tuple:
    """A resume's settings, runtime (decided again where its settings differ, unless the command's had a problem),
    checkpoint and lock (rank 0's, taken before anything is read, where a checkpoint is); what went wrong is added to
    `problems`, and the command's settings stand for the rest of the checks."""
    from engine.reader import load_checkpoint
    from engine.resume import resumed_settings
    lock, out = None, Path(cfg.out_dir)
    try:
        if not cfg.eval_only and ((out / "ckpt.pt").exists() or (out / "latest").is_file()):  # eval: no lock
            lock = writing.OutDirLock(out) if rt.is_master else None  # no collective before the ranks agree
        checkpoint = load_checkpoint(out / "ckpt.pt", for_training=not cfg.eval_only,
                                     data_dir=Path(cfg.data_dir) if cfg.data_dir else None)
        command, cfg = cfg, resumed_settings(checkpoint, cfg, limits, cfg.out_dir)
    except UserError as e:
        problems.append(e)
        return cfg, rt, None, lock
    if runtime_ok and any(getattr(cfg, k) != getattr(command, k) for k in (*RUNTIME_SETTINGS, "n_embd")):
        try:
            rt = runtime.resolve_runtime(cfg.device, cfg.dtype, cfg.muon_dtype, threads=cfg.threads, joined=rt,
                                         width=cfg.n_embd)
        except UserError as e:
            problems.append(e)
    return cfg, rt, checkpoint, lock


def environment(cfg: Settings, rt: Runtime, out_of_range: dict) -> list:
    """What the command needs beyond its settings' ranges, each a check raising its UserError (one that reads a
    setting out of range is left out): the model its settings describe, out_dir, the data folder (its preparation
    possible, not done yet), torch.compile's cache folder, wandb."""
    checks = []
    if not out_of_range.keys() & {*MODEL_SETTINGS, "init_from", "attn", "dropout", "window"}:
        sizes_ok = not out_of_range.keys() & {"batch_size", "gradient_accumulation_steps", "eval_iters"}
        checks.append(lambda: check_model(cfg, None if "device" in out_of_range else rt, meta=False,
                                          memory=sizes_ok))
    if not out_of_range.keys() & {"data_dir", "dataset"}:
        checks.append(lambda: prepare_if_missing(dataset_dir(cfg.data_dir, cfg.dataset), cfg.dataset,
                                                 check_only=True))
    if not cfg.eval_only and cfg.init_from != "resume" and "out_dir" not in out_of_range:
        checks.append(lambda: writing.check_out_dir(cfg.out_dir, cfg.overwrite, describe_run))
    if cfg.compile:
        checks.append(runtime.check_compile_cache)
    if cfg.wandb_log:
        from tools.wandb_check import check_wandb
        checks += [lambda: check_wandb(cfg.wandb_project)] if rt.is_master else []  # rank 0's: agree() spreads it
    return checks


MODEL_SETTINGS = ("n_layer", "n_head", "n_embd", "block_size")


def check_model(cfg: Settings, rt: Optional[Runtime], meta: Optional[dict] = None, memory: bool = False) -> None:
    """The model the settings describe, as GPTConfig checks it, whether it fits in memory and its attention runs on
    this device in this dtype (rt None: no device to check against); the data's vocabulary and end-of-text token once
    it is prepared (`meta`, False before: doc_mask needs it; `memory`: the batch's settings are in range, so the
    memory check counts the batch too).
    GPT-2's weights (init_from) are checked by their config: a typo, a block_size past theirs, a vocabulary other than
    the data's; they are read later."""
    gpt2 = cfg.init_from not in ("scratch", "resume")
    if gpt2:
        from core.hf import gpt2_shape
        shape = gpt2_shape(cfg.init_from)
    problems = problems_of(lambda: check_memory(cfg, rt, shape if gpt2 else {}, memory)) if meta is False and rt \
        else []
    if gpt2:
        if cfg.block_size > shape.get("block_size", cfg.block_size):
            problems.append(UserError(f"block_size={cfg.block_size} is longer than the {shape['block_size']} "
                                      f"positions of init_from={cfg.init_from!r}; pass --block_size="
                                      f"{shape['block_size']} or less."))
        if meta is not False and "vocab_size" in shape:
            problems += problems_of(lambda: check_vocab(f"init_from={cfg.init_from!r}", shape["vocab_size"], cfg,
                                                        meta, " (GPT-2 BPE)"))
        return errors.refuse_all(problems)
    from model import GPTConfig
    try:
        config = GPTConfig.build({**cfg.as_dict(), "vocab_size": meta["vocab_size"] if meta else
                                  files.GPT2_VOCAB_SIZE}, dict(attn="sdpa" if cfg.attn == "auto" else cfg.attn,
                                                               dropout=cfg.dropout, window=cfg.window,
                                                               doc_mask=cfg.doc_mask and bool(meta),
                                                               eot_token=files.eot_token_of(meta or None)))
        if rt is not None and not problems:  # the probe runs a layer's attention: only where the run fits
            config.check_attention(rt.device_type, rt.torch_dtype, not cfg.eval_only, cfg.block_size,
                                   decoding=False)
    except UserError as e:
        problems.append(e)
    errors.refuse_all(problems)


def check_memory(cfg: Settings, rt: Runtime, shape: dict, batch: bool = True) -> None:
    """What the run needs at least, from its settings (weights, their gradients and AdamW's two moments in fp32; one
    micro-step's activations, 16 numbers a position a layer; the offsets of a step's and an evaluation's batches),
    against the device's memory, before anything is built. `shape`: GPT-2 weights' n_layer and n_embd, where known;
    `batch`: False where a batch setting is out of range (the weights are checked alone)."""
    L, C, T = shape.get("n_layer", cfg.n_layer), shape.get("n_embd", cfg.n_embd), cfg.block_size
    B, steps = (cfg.batch_size, max(cfg.gradient_accumulation_steps // rt.world_size, cfg.eval_iters)) if batch else \
        (0, 0)  # a micro-step's sequences, and the most batches drawn at once (a step's or an evaluation's)
    weights = 4 * (12 * L * C * C + (files.GPT2_VOCAB_SIZE + T) * C)
    weights /= rt.world_size if cfg.parallel == "fsdp" else 1  # FSDP2: each rank holds its shard
    element = 2 if rt.dtype in ("bfloat16", "float16") else 4
    training = not cfg.eval_only
    runtime.check_memory_need({
        "weights": (weights, "n_layer or n_embd"),
        "gradients and optimizer state": (3 * weights * training, "n_layer or n_embd"),
        "activations": (16 * L * B * T * C * element * training, "batch_size, block_size, n_layer or n_embd"),
        "batch offsets": (8 * B * steps, "gradient_accumulation_steps, eval_iters or batch_size")}, rt)


def check_data(cfg: Settings, rt: Runtime, data_dir: Path, checkpoint: Optional[Checkpoint]) -> Optional[dict]:
    """The prepared data's own problems, all at once: its meta.json, a resume's tokenizer, and token files that hold
    more than block_size tokens and only ids the model has (each node's local rank 0 reads its own copy once, and
    under torchrun every node's problems reach every rank). Returns the meta."""
    meta, problems = None, []
    try:
        meta = files.read_meta(data_dir)
        if meta is None and (data_dir / "meta.pkl").exists():  # a nanoGPT data folder: its character vocabulary
            from tools.nanogpt import read_nanogpt_meta
            meta = read_nanogpt_meta(data_dir / "meta.pkl")
    except UserError as e:
        problems.append(e)
    if checkpoint is not None:
        from engine.resume import check_tokens
        problems += problems_of(lambda: check_tokens(checkpoint, meta, cfg.out_dir))
        problems += problems_of(lambda: check_vocab("the checkpoint", checkpoint.model_config["vocab_size"], cfg, meta,
                                                    f" ({describe_tokens(checkpoint.meta)})" if checkpoint.meta else ""))
    if (cfg.doc_mask and meta is not None) or cfg.init_from not in ("scratch", "resume"):
        problems += problems_of(lambda: check_model(cfg, rt, meta))
    vocab_size = checkpoint.model_config["vocab_size"] if checkpoint is not None else \
        meta["vocab_size"] if meta else files.GPT2_VOCAB_SIZE
    def check_files() -> None:  # each node's own copy, read by its local rank 0 (the ranks of a node share it)
        if rt.local_rank == 0:
            check_token_files(data_dir, vocab_size, cfg.block_size, remember=not problems,
                              recorded=(meta or {}).get("max_token_ids"))
    problems += problems_of(check_files)
    if rt.is_distributed:  # every node's problems, named with their rank, on every rank
        from core.distributed import agree
        problems = agree({}, problems)
    errors.refuse_all(problems)
    return meta


def check_vocab(source: str, vocab_size: int, cfg: Settings, meta: Optional[dict], trained_on: str) -> None:
    """The weights' vocabulary (`source`'s) against the data's: the same, or one line naming both."""
    have = meta["vocab_size"] if meta else files.GPT2_VOCAB_SIZE
    if vocab_size != have:
        data = f"the data in {cfg.data_dir}" if cfg.data_dir else f"dataset '{cfg.dataset}'"
        holds = f"{have} ({describe_tokens(meta)})" if meta else f"{have} (no meta.json: GPT-2 BPE)"
        raise UserError(f"{source} has vocab_size {vocab_size} but {data} has {holds}; use the data the weights were "
                        f"trained on{trained_on}.")


def describe_run(ckpt: Path) -> str:  # a few words on the checkpoint in an out_dir a new run may not use
    from engine.reader import describe_checkpoint
    return describe_checkpoint(ckpt)
