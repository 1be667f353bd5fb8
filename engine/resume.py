"""
What only a resume needs beyond reading its checkpoint (engine/reader.py): the settings it runs with, the check that
its data's ids mean what the checkpoint's meant, and `restore`, which applies the rest once the model is placed.
train.py imports it for --init_from=resume alone.

    cfg = resumed_settings(checkpoint, cfg, LIMITS, cfg.out_dir)   # in train.start, before the model is built
    resumed_at = restore(run, checkpoint)                          # in train.train, once it is placed
"""

import dataclasses
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

from core.configurator import Settings, check_limits, coerce
from core.errors import UserError, note
from core.runtime import Runtime
from engine.checkpoint import FULL_STATE, Checkpoint, describe_tokens
from model import RUN_FIELDS, GPT, GPTConfig

# the shape the weights determine, which a resume keeps: GPTConfig's fields but what a run chooses and the data's vocabulary
SHAPE_SETTINGS = tuple(f.name for f in dataclasses.fields(GPTConfig) if f.name not in (*RUN_FIELDS, "vocab_size"))
TOKENS = ("tokenizer", "chars")  # what a meta.json says its ids mean
RESUME_KEEPS = ("init_from", "out_dir", "overwrite", "eval_only")  # a resume's own: never the saved run's
# what a nanoGPT checkpoint's `config` holds that means here what it meant there: the batch and the schedule (its
# dtype, device and compile describe nanoGPT's process, not this one's)
NANOGPT_RUN = ("batch_size", "gradient_accumulation_steps", "learning_rate", "max_iters", "lr_decay_iters", "min_lr",
               "warmup_iters", "decay_lr", "beta1", "beta2", "grad_clip", "weight_decay", "eval_interval",
               "eval_iters", "log_interval", "always_save_checkpoint")


def with_saved(cfg: Settings, saved: dict, limits: dict) -> tuple[Settings, list[str]]:
    """`saved` (the run's own settings) for every setting this command left at its default, this command's where it
    set one (a flag or a config file), and RESUME_KEEPS always this command's. A saved value this version does not accept is
    left at the default. Returns them and the settings this command changed, in words."""
    values, set_by, changed = cfg.as_dict(), cfg.set_by, []
    for key, value in saved.items():
        if key not in values or key in RESUME_KEEPS:
            continue
        if key in set_by:
            if values[key] != value:
                changed.append(f"{key}={values[key]!r} from {set_by[key]} (the run had {value!r})")
            continue
        try:
            value = coerce(key, value, values[key], values[key])
            if check_limits({key: value}, {key: limits[key]} if key in limits else {}, {}):
                continue
        except UserError:
            continue  # an older version's value: this version's default stands
        values[key] = value
    return Settings(set_by, **values), changed


def resumed_settings(checkpoint: Checkpoint, cfg: Settings, limits: dict, where: str) -> Settings:
    """The settings a resume runs, decided once: the run's own (saved in the checkpoint) for every setting the command
    leaves at its default, the command's where it sets one (named in one note), and the weights' shape, vocab_size
    included. A shape setting given on the command line that differs, or another optimizer, is one error line; one
    from a config file gives way to the checkpoint, with a note (nanoGPT's habit). From a nanoGPT checkpoint only its
    batch and schedule are taken (NANOGPT_RUN), named in a note."""
    nanogpt = checkpoint.rng is None
    saved = {k: v for k, v in checkpoint.settings.items() if k in NANOGPT_RUN} if nanogpt else checkpoint.settings
    cfg, changed = with_saved(cfg, saved, limits)
    taken = [f"{k}={saved[k]!r}" for k in saved if k not in cfg.set_by and getattr(cfg, k) == saved[k]] if nanogpt \
        else []
    if taken:
        note(f"resuming nanoGPT's run with the batch and schedule it saved: {', '.join(taken)} (its other settings "
             f"are nanoGPT's; this run's are train.py's)")
    settings, set_by = cfg.as_dict(), cfg.set_by
    optimizer = checkpoint.settings.get("optimizer", "adamw")  # nanoGPT's: AdamW
    if optimizer != settings["optimizer"]:
        raise UserError(f"the checkpoint's optimizer state is {optimizer}'s; resume with --optimizer={optimizer}.")
    for key in SHAPE_SETTINGS:
        saved = checkpoint.model_config.get(key, settings[key])
        if settings[key] == saved or set_by.get(key) is None:
            continue
        if set_by[key] == "the command line":
            raise UserError(f"--{key}={settings[key]!r} differs from the checkpoint in {where} ({key}={saved!r}), "
                            f"and a resumed run keeps the checkpoint's shape; drop --{key}= (or pass "
                            f"--{key}={saved!r}), or start a new run in another --out_dir=.")
        note(f"{key}={settings[key]!r} from {set_by[key]} is not the checkpoint's ({key}={saved!r}); the resumed "
             f"run keeps the checkpoint's shape.")
        changed = [c for c in changed if not c.startswith(f"{key}=")]
    if changed:
        note(f"resuming with the run's own settings, but for {', '.join(changed)}")
    shape = {key: checkpoint.model_config[key] for key in (*SHAPE_SETTINGS, "vocab_size")
             if key in checkpoint.model_config}
    return Settings(set_by, **{**settings, **shape})


def check_tokens(checkpoint: Checkpoint, meta: dict | None, where: str) -> None:
    """A dataset whose vocabulary has the checkpoint's size may still map its ids to other text: one error line."""
    saved = checkpoint.meta
    same_size = saved and meta and saved.get("vocab_size") == meta.get("vocab_size")
    if same_size and [saved.get(k) for k in TOKENS] != [meta.get(k) for k in TOKENS]:
        raise UserError(f"this dataset's meta.json maps its ids to other text than the dataset the checkpoint in "
                        f"{where} was trained on ({describe_tokens(meta)} against {describe_tokens(saved)}); "
                        f"resume on that dataset, or start a new run in another --out_dir=.")


def restore(run, checkpoint: Checkpoint) -> int:  # run: train.TrainingRun
    """Everything a resumed run takes from its checkpoint, in one place, once the model and optimizers are placed:
    weights, optimizer state (not for eval_only), RNG streams (the data position among them), step, best val loss,
    training time and attn=auto's decision (reused by choose_attention where the workload is the same). Its settings
    were read before the model was built (resumed_settings, in start). Returns the step it resumes at."""
    model, optimizers = run.trainer.model, run.trainer.optimizers
    if checkpoint.shards is not None:  # sharded: DCP reads each rank's part in place (collective)
        from tools.sharded import load_into
        from engine.reader import check_finite
        load_optimizer_state(model, optimizers, load_into(model, optimizers, Path(checkpoint.shards)),
                             StateDictOptions())
        check_finite(model.state_dict(), checkpoint.shards, run.rt.device)
    else:  # every rank holds the whole state; FSDP2 keeps its own shard of it
        set_model_state_dict(model, checkpoint.model, options=FULL_STATE)
        if not run.cfg.eval_only:
            load_optimizer_state(model, optimizers, checkpoint.optimizer, FULL_STATE)
    if checkpoint.rng is not None:  # a nanoGPT checkpoint has none: the seeds already set stand
        restore_rng(checkpoint.rng, run.batches.generator, run.rt)
    run.nanogpt_original = checkpoint.rng is None and not run.cfg.eval_only
    run.iter_num, run.best_val_loss = checkpoint.iter_num, checkpoint.best_val_loss
    run.time_before, run.saved_at = checkpoint.train_time_s, checkpoint.iter_num
    run.attn_decision = checkpoint.attn_decision
    checkpoint.model = checkpoint.optimizer = None  # applied: its copy of the state is freed before training
    return checkpoint.iter_num


def load_optimizer_state(model: GPT, optimizers: list, state: dict, options: StateDictOptions) -> None:
    """A checkpoint's optimizer state; the peak rates stay this run's settings (a saved group's would win)."""
    peaks = [group["initial_lr"] for optimizer in optimizers for group in optimizer.param_groups]
    set_optimizer_state_dict(model, optimizers, state, options=options)
    for group, peak in zip((g for optimizer in optimizers for g in optimizer.param_groups), peaks):
        group["initial_lr"] = peak


def restore_rng(state: dict, data_generator: torch.Generator, rt: Runtime) -> None:
    data_generator.set_state(state["data"])
    if len(state["per_rank"]) != rt.world_size:
        return  # another world size: dropout streams cannot continue, the seeds already set stand
    saved, cpu_size = state["per_rank"][rt.rank], torch.get_rng_state().numel()
    torch.set_rng_state(saved[:cpu_size])
    if rt.is_cuda and saved.numel() > cpu_size:
        torch.cuda.set_rng_state(saved[cpu_size:])
