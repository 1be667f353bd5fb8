"""Shared fixtures: a tiny character dataset, tiny training runs, and every 2-rank run from one torchrun launch."""

import dataclasses
import gc
import json
import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
# inductor's compiled code in a folder of the tests' own (set before torch is imported, inherited by the processes
# the tests start): another process clearing the shared /tmp/torchinductor_<user> meanwhile fails compiled tests
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(Path(tempfile.gettempdir()) / f"nanogpt_attn_tests_inductor_{os.getuid()}"))
RANK_PROBE = REPO / "tests" / "rank_probe.py"
# a 2-layer model, fp32, eager, one micro-step: seconds per run
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4", "--compile=False",
        "--dtype=float32", "--device=cpu", "--gradient_accumulation_steps=1", "--eval_iters=2", "--log_interval=1",
        "--warmup_iters=2", "--lr_decay_iters=100", "--learning_rate=3e-3"]


def pytest_collection_finish(session):
    """The test modules have imported torch, transformers, datasets and the project (~450,000 objects): move them out
    of the garbage collector's sight (gc.freeze), so a full collection - Python's own every so often, bench's after
    every max-batch probe - walks only what the tests made: ~0.25 s each on these 2 cores, otherwise."""
    gc.collect()
    gc.freeze()


# Each script sets its threads once at start (runtime.set_threads); the suite runs them at one per CPU
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                              else os.cpu_count() or 1))


@pytest.fixture(autouse=True, scope="session")
def own_cache_folder(tmp_path_factory):
    """Measurements kept between runs (files.cache_folder) go to a folder of the test session's, in process and in every
    script a test launches, never to the user's ~/.cache."""
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved


@pytest.fixture()
def datasheet_peak(monkeypatch):
    """A CPU given a datasheet peak of 1 TFLOP/s, as a listed GPU has: for the tests of what carries MFU."""
    from core import flops
    monkeypatch.setattr(flops, "peak_flops", lambda rt: 1e12)


@pytest.fixture(scope="session")
def char_data_session(tmp_path_factory) -> Path:
    """A small character-level dataset: train.bin, val.bin (uint16) and meta.json."""
    d = tmp_path_factory.mktemp("chars")
    text = "\n".join(f"To be, or not to be: line {i} of {i * 7 % 13}." for i in range(3000))
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    split = int(0.9 * len(ids))
    ids[:split].tofile(d / "train.bin")
    ids[split:].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"tokenizer": "char", "vocab_size": len(chars), "chars": chars}))
    return d


@pytest.fixture(scope="module")
def char_data(char_data_session) -> Path:
    return char_data_session


def strict_recompile_limit():
    """Dynamo raises instead of silently running eagerly past a recompile limit. Through the config's own patch(),
    which restores the old value on the way out: pytest's monkeypatch deletes an attribute it could not read, and a
    deleted torch config key stays hidden for the rest of the session (ConfigModule.__delattr__)."""
    import torch
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def run_train(args: list[str], nproc: int = 1, env: dict | None = None, check: bool = True,
              script: Path = REPO / "train.py"):
    """train.py as a user runs it, alone or under torchrun; `script=RANK_PROBE` runs a plan of runs instead."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    result = subprocess.run(launcher + [str(script)] + args, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=600)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="session")
def trained_char_run(char_data_session, tmp_path_factory) -> Path:
    """The out_dir of a tiny char model trained for 150 steps on char_data (its checkpoint names that data): logits
    with real structure, so greedy tokens mean something. Trained once for test_generate.py and test_sample.py; read
    only."""
    import train
    out = tmp_path_factory.mktemp("trained_char_run")
    train.main(TINY + [f"--data_dir={char_data_session}", f"--out_dir={out}", "--max_iters=150",
                       "--eval_interval=150", "--n_embd=64", "--n_head=4"])
    return out


def straight_and_resumed(args: list[str], out: Path) -> tuple[Path, Path]:
    """Six steps in one run, and three steps then a resume to six: the two out_dirs, to compare their metrics."""
    import train
    train.main(args + ["--max_iters=6", f"--out_dir={out / 'straight'}"])
    train.main(args + ["--max_iters=3", f"--out_dir={out / 'stopped'}"])
    train.main(args + ["--max_iters=6", "--init_from=resume", f"--out_dir={out / 'stopped'}"])
    return out / "straight", out / "stopped"


def metrics(out_dir: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iter"]: r[key] for r in rows if key in r}


# two ranks, each taking one of the two micro-steps of every step: the runs the distributed tests hold to a single
# process and to each other
TWO_RANKS = TINY + ["--gradient_accumulation_steps=2", "--eval_interval=3", "--max_iters=6"]
SHARDED = ["--checkpoint_format=sharded"]


@dataclasses.dataclass
class TwoRankRuns:
    out: Path             # each run's out_dir is out / its name
    report: dict          # tests/rank_probe.py's: per run, digests and elements per rank; rank_0_fails

    def losses(self, name: str) -> dict[int, float]:
        return metrics(self.out / name, "train/step_loss")


@pytest.fixture(scope="session")
def two_rank_runs(char_data_session, tmp_path_factory) -> TwoRankRuns:
    """Every 2-rank check of the suite from one torchrun launch (tests/rank_probe.py): six steps of DDP, of DDP with
    Muon, of FSDP; FSDP stopped at step 3 (its out_dir also kept as fsdp_at_3) then resumed to 6; three steps of FSDP
    compiled per block; the sharded-checkpoint runs; and rank 0 failing inside runtime.on_master. About a minute and a
    half, most of it the compile."""
    out = tmp_path_factory.mktemp("two_ranks")
    data = TWO_RANKS + [f"--data_dir={char_data_session}"]
    fsdp = data + ["--parallel=fsdp"]
    runs = [("ddp", data, {}), ("muon", data + ["--optimizer=muon"], {}), ("fsdp", fsdp, {}),
            ("fsdp_resumed", fsdp + ["--max_iters=3"], {"keep": str(out / "fsdp_at_3")}),
            ("fsdp_resumed", fsdp + ["--init_from=resume"], {}),
            ("fsdp_compiled", fsdp + ["--max_iters=3", "--compile=True"], {}),
            # sharded checkpoints (test_sharded.py): DDP and FSDP2 (writing asynchronously) stopped at 3 and resumed;
            # FSDP2 with 6 micro-steps a step, the global batch a 1- or 3-rank resume can keep
            ("ddp_sharded", data + SHARDED + ["--max_iters=3"], {"keep": str(out / "ddp_sharded_at_3")}),
            ("ddp_sharded", data + SHARDED + ["--init_from=resume"], {}),
            ("fsdp_async", fsdp + SHARDED + ["--async_save=True", "--max_iters=3"],
             {"keep": str(out / "fsdp_async_at_3")}),
            ("fsdp_async", fsdp + SHARDED + ["--async_save=True", "--init_from=resume"], {}),
            ("fsdp6", fsdp + ["--gradient_accumulation_steps=6"], {}),
            ("fsdp6_sharded", fsdp + SHARDED + ["--gradient_accumulation_steps=6", "--max_iters=3"], {})]
    plan = {"runs": [{"name": name, "args": args, "out_dir": str(out / name), **extra} for name, args, extra in runs]}
    (out / "plan.json").write_text(json.dumps(plan))
    run_train([str(out / "plan.json"), str(out / "report.json")], nproc=2, script=RANK_PROBE)
    return TwoRankRuns(out, json.loads((out / "report.json").read_text()))


def checkpoint_of(model, **fields):
    """A Checkpoint of an unwrapped model's weights and config, with whatever else is given."""
    from engine.checkpoint import Checkpoint
    return Checkpoint(model=model.state_dict(), model_config=dataclasses.asdict(model.config), **fields)


def runnable_on_cpu(training: bool) -> list[str]:
    """The registry's implementations that run on this CPU in fp32 without dropout, for training or inference, as
    attention.kernels.attention_problem decides: what the tests parametrize over, so a new implementation is tested by
    adding it to IMPLEMENTATIONS. test_model.py states the expected set for torch 2.13."""
    import torch

    from model import IMPLEMENTATIONS
    from attention.kernels import AttnCall, attention_problem
    call = AttnCall("cpu", torch.float32, 16, needs_grad=training)
    return [a for a, fn in IMPLEMENTATIONS.items() if attention_problem(a, call, fn) is None]


def ctrl_c_at_step(monkeypatch, n: int) -> None:
    """train.py's n-th training step raises KeyboardInterrupt, as Ctrl-C between two steps does."""
    import train
    real_step, steps = train.Trainer.step, []

    def interrupted(self, batches):
        steps.append(1)
        if len(steps) == n:
            raise KeyboardInterrupt
        return real_step(self, batches)
    monkeypatch.setattr(train.Trainer, "step", interrupted)


class FullDisk:
    """A file whose every write fails as a full disk's does (the kernel's "No space left on device"): a stand-in for
    /dev/full that never touches a real /dev path."""

    def __init__(self, file):
        self.file = file

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):  # flush, fileno, tell ...: the real file's
        return getattr(self.file, name)


def bench_file(folder, name: str) -> Path:
    """The one bench run's file in `folder` for `name` ('train.json', 'attention.png'): <mode>-<run>.<suffix>."""
    mode, suffix = name.split(".")
    found = list(Path(folder).glob(f"{mode}-*.{suffix}"))
    assert len(found) == 1, found
    return found[0]
