"""train.py and configurator.py: DDP matches one process, resume is exact, metrics reach wandb, bad input is one line."""

import dataclasses
import glob
import io
import json
import re
import shlex
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from core import errors, runtime
from engine import metrics as train_metrics
from engine import startup
from engine import trainer
import train
from core.configurator import configure
from conftest import REPO, TINY, TWO_RANKS, ctrl_c_at_step, metrics, straight_and_resumed
from core.errors import UserError
from model import GPT, GPTConfig

# -- distributed --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_ranks_match_one_rank_with_the_same_global_batch_and_stay_identical(char_data, tmp_path, two_rank_runs):
    train.main(TWO_RANKS + [f"--data_dir={char_data}", f"--out_dir={tmp_path}"])
    one, two = metrics(tmp_path, "train/step_loss"), two_rank_runs.losses("ddp")
    assert sorted(one) == list(range(1, 7))
    for it, loss in one.items():
        assert abs(two[it] - loss) <= 1e-5, (it, loss, two[it])
    rank0, rank1 = two_rank_runs.report["runs"]["ddp"]["digests"]
    assert rank0 == rank1


def test_accumulation_not_divisible_by_world_size_is_refused(char_data, tmp_path, monkeypatch):
    # rank 0 of two, as torchrun would start it: the check comes before any collective
    monkeypatch.setattr(runtime, "init_distributed", lambda device, backend="auto": (0, 0, 2, device))
    with pytest.raises(UserError, match="gradient_accumulation_steps=3 is not divisible by the 2 ranks"):
        train.main(TINY + [f"--data_dir={char_data}", "--gradient_accumulation_steps=3", f"--out_dir={tmp_path}"])


@pytest.mark.slow  # two torchrun launches of two ranks
@pytest.mark.parametrize("setting, words", [
    (["--gradient_accumulation_steps=1"], "error: gradient_accumulation_steps=1 is not divisible by the 2 ranks"),
    (["--gradient_accumulation_steps=2", "--wandb_log=True"], "error: wandb_log=True, but wandb has no login here"),
], ids=["every rank decides", "rank 0 decides"])
def test_under_torchrun_a_bad_setting_is_one_error_line_from_rank_0(char_data, tmp_path, setting, words):
    """Whether every rank decides an error alike or rank 0 decides for all, one `error:` line is printed (rank 0's),
    then torchrun's own report."""
    from conftest import run_train
    env = {"WANDB_API_KEY": "", "WANDB_MODE": "online", "HOME": str(tmp_path)}  # no login: wandb refuses
    result = run_train(TINY + [f"--data_dir={char_data}", f"--out_dir={tmp_path / 'out'}", *setting], nproc=2,
                       env=env, check=False)
    output = result.stdout + result.stderr
    errors_said = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors_said) == 1 and errors_said[0].startswith(words), output[-3000:]
    assert result.returncode != 0 and "Root Cause" in output, output[-3000:]


# -- the whole split's loss -----------------------------------------------------------------------------

def test_eval_iters_0_is_the_loss_of_every_val_token_once_as_lm_eval_reads_the_text(char_data, tmp_path, capsys):
    """The printed val/loss is a sample (eval_iters batches); --eval_only=True --eval_iters=0 is the whole split's,
    read as lm-eval's rolling loglikelihood reads a text: windows of block_size targets, the last few targets scored
    in the last full window (the context a fresh short window would lack), summed in float64 and printed with the
    digits and the token count to hold the two against each other."""
    from core.dataset import Batches
    from tools.whole_split import whole_split, whole_split_batches
    val = np.fromfile(char_data / "val.bin", dtype=np.uint16)
    assert (len(val) - 1) % 32  # a last partial window to read
    batches = Batches(char_data, block_size=32, batch_size=3, seed=0)
    for rank_of_2 in (0, 1):
        pairs = list(whole_split(batches, "val", rank_of_2, 2))
        assert all(torch.equal(x[:, 1:], y[:, :-1]) | (y[:, :-1] == -1).any() for x, y in pairs)  # the next tokens
        assert whole_split_batches(batches, "val", rank_of_2, 2) == len(pairs)  # what the progress line counts
    pairs = list(whole_split(batches, "val"))
    scored = torch.cat([y.flatten() for _, y in pairs])
    assert torch.equal(scored[scored != -1], torch.from_numpy(val[1:].astype(np.int64)))  # every target once
    assert pairs[-1][0].size(1) == 32  # the last targets with a full window of context
    out = tmp_path / "run"
    assert train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--max_iters=2"]) == 0
    capsys.readouterr()
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--eval_only=True", "--eval_iters=0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if " nats a token over " in x)
    assert " tokens of val.bin in float32 (the sum: " in line  # a figure to compare: fp32 where no dtype is named
    printed, tokens = float(line.split()[1]), int(line.split(" over ")[1].split()[0].replace(",", ""))
    from engine.reader import build_model, load_checkpoint
    model = build_model(load_checkpoint(out / "ckpt.pt")).eval()
    total, T, N = torch.zeros((), dtype=torch.float64), 32, len(val)
    ids = torch.from_numpy(val.astype(np.int64))
    with torch.no_grad():  # lm-eval's rolling windows, written out: each target once, with up to T tokens before it
        for k in range(0, N - 1, T):
            last = min(k + T, N - 1)  # targets k + 1 .. last, read from inputs lo .. last - 1
            lo = max(0, last - T)
            logits, _ = model(ids[lo:last][None], all_positions=True)
            logp = torch.log_softmax(logits[0].double(), dim=-1)[-(last - k):]  # (targets not yet scored, V)
            total -= logp.gather(1, ids[k + 1:last + 1, None]).sum()
    assert tokens == len(val) - 1
    assert printed == pytest.approx(float(total) / tokens, rel=1e-6)


# -- resume ---------------------------------------------------------------------------------------------

def test_a_resume_without_the_config_runs_the_runs_own_settings_and_names_what_the_command_changes(
        char_data, tmp_path, capsys):
    """A resume typed as `--init_from=resume --out_dir=...` once trained with train.py's defaults (GPT-2's batch,
    warmup and learning rate, on openwebtext) under the checkpoint's weights, without a word."""
    out = tmp_path / "run"
    first = TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--max_iters=2", "--eval_interval=2",
                    "--learning_rate=2e-3", "--beta2=0.99", "--seed=7"]
    assert train.main(first) == 0
    capsys.readouterr()
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_iters=4", "--eval_interval=2"]) == 0
    err = capsys.readouterr().err
    assert ("note: resuming with the run's own settings, but for max_iters=4 from the command line (the run had 2)"
            in err.splitlines()), err
    saved = torch.load(out / "ckpt.pt", weights_only=True)
    assert saved["iter_num"] == 4 and saved["settings"]["data_dir"] == str(char_data)
    assert {k: saved["settings"][k] for k in ("learning_rate", "beta2", "seed", "batch_size", "compile")} == dict(
        learning_rate=2e-3, beta2=0.99, seed=7, batch_size=4, compile=False)
    assert metrics(out, "lr")[4] == pytest.approx(2e-3 * trainer.lr_multiplier(3, SimpleNamespace(
        **saved["settings"])))



def test_every_resume_says_where_it_resumed_and_one_at_max_iters_says_there_is_nothing_to_train(char_data, tmp_path,
                                                                                                capsys):
    out = tmp_path / "run"
    args = TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--eval_interval=3"]
    assert train.main(args + ["--max_iters=3"]) == 0
    capsys.readouterr()
    assert train.main(args + ["--max_iters=2", "--init_from=resume"]) == 0
    said = capsys.readouterr().out
    assert "resumed from iter 3 of " in said
    assert ("nothing to train: the checkpoint is already at iter 3 >= max_iters=2; to train further pass a larger "
            "--max_iters= (and --lr_decay_iters= to match).") in said
    assert train.main(args + ["--max_iters=6", "--init_from=resume"]) == 0
    assert "resumed from iter 3 of " in capsys.readouterr().out and "nothing to train" not in said.split("resumed")[0]


def test_train_time_continues_from_the_checkpoint_on_a_resume(char_data, tmp_path):
    out = tmp_path / "run"
    args = TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--eval_interval=3"]
    train.main(args + ["--max_iters=3"])
    before = metrics(out, "train_time_s")[3]
    train.main(args + ["--max_iters=6", "--init_from=resume"])
    assert before > 0 and metrics(out, "train_time_s")[6] > before


def test_ctrl_c_names_the_checkpoint_kept_and_the_command_that_continues(char_data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run dir"
    args = TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--eval_interval=2", "--max_iters=8"]
    ctrl_c_at_step(monkeypatch, 5)
    assert errors.exit_code(lambda: train.main(args)) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "interrupted"
    assert err[-2] == (f"stopped at iter 4; the checkpoint kept in {out} is iter 4; continue with: python train.py "
                       f"{shlex.join(args)} --init_from=resume")


def test_resume_continues_bit_for_bit(char_data, tmp_path):
    straight, stopped = straight_and_resumed(
        TINY + [f"--data_dir={char_data}", "--eval_interval=3", "--dropout=0.1", "--attn=manual"], tmp_path)
    assert [metrics(straight, "train/step_loss")[i] for i in range(4, 7)] == [metrics(stopped, "train/step_loss")[i]
                                                                          for i in range(4, 7)]
    assert metrics(straight, "val/loss")[6] == metrics(stopped, "val/loss")[6]


def test_checkpoint_loads_with_weights_only(char_data, tmp_path):
    train.main(TINY + [f"--data_dir={char_data}", "--max_iters=2", "--eval_interval=2", f"--out_dir={tmp_path}"])
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 2 and ckpt["meta"]["tokenizer"] == "char"
    assert ckpt["model_config"]["n_layer"] == 2 and not list(tmp_path.glob("*.tmp"))


def test_a_diverging_loss_stops_and_names_the_checkpoint_kept_only_where_one_was_saved(char_data, tmp_path):
    diverge = ["--learning_rate=1e30", "--warmup_iters=0", "--grad_clip=0.0"]
    fresh = tmp_path / "fresh"  # diverges before its first save: no checkpoint is named, the folder is reused
    with pytest.raises(UserError, match="training diverged .*; no checkpoint was saved.$"):
        train.main(TINY + [f"--data_dir={char_data}", "--max_iters=40", "--eval_interval=100", *diverge,
                           f"--out_dir={fresh}"])
    assert not (fresh / "ckpt.pt").exists()  # nothing to resume: the retry with a lower rate is not refused
    train.main(TINY + [f"--data_dir={char_data}", "--max_iters=2", "--eval_interval=2", f"--out_dir={fresh}"])

    train.main(TINY + [f"--data_dir={char_data}", "--max_iters=2", "--eval_interval=2", f"--out_dir={tmp_path}"])
    before = (tmp_path / "ckpt.pt").read_bytes()
    with pytest.raises(UserError, match=f"training diverged .*the checkpoint of iter 2 in {tmp_path} is kept"):
        train.main(TINY + [f"--data_dir={char_data}", "--max_iters=40", "--eval_interval=2", "--init_from=resume",
                           *diverge, f"--out_dir={tmp_path}"])
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_init_from_a_local_hf_directory_crops_to_a_shorter_block_size(char_data, tmp_path):
    transformers = pytest.importorskip("transformers")
    vocab = json.loads((char_data / "meta.json").read_text())["vocab_size"]
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    train.main(TINY + [f"--data_dir={char_data}", f"--init_from={tmp_path / 'hf'}", "--max_iters=2",
                       "--eval_interval=2", f"--out_dir={tmp_path / 'out'}"])
    config = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)["model_config"]
    assert (config["block_size"], config["gelu"], config["vocab_size"]) == (32, "tanh", vocab)


# -- measurement and logging --------------------------------------------------------------------------

class FakeWandb:
    """The part of wandb's API MetricsLog uses (init, then the run's log and finish), recording every call."""
    errors = SimpleNamespace(Error=RuntimeError)

    def __init__(self):
        self.configs, self.logged, self.finished = [], {}, 0

    @staticmethod
    def Settings(**settings):
        return settings

    def init(self, project, name, config, settings):
        self.configs.append(config)
        return self

    def log(self, metrics, step):
        self.logged.setdefault(step, {}).update(metrics)

    def finish(self):
        self.finished += 1


def json_rows_at(out_dir: Path, it: int) -> dict:
    """Every metrics.jsonl row of one iteration, merged."""
    merged = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["iter"] == it:
            merged.update(row)
    return merged


def test_metrics_reach_wandb_keyed_by_iteration(char_data, tmp_path, monkeypatch, datasheet_peak):
    """What train.py hands wandb, in process; the slow test below checks what a real offline wandb run records."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("WANDB_MODE", "offline")  # a run wandb can log (without it and a login: the test below)
    train.main(TINY + [f"--data_dir={char_data}", "--max_iters=4", "--eval_interval=2", "--wandb_log=True",
                       f"--out_dir={tmp_path}"])
    assert wandb.finished == 1 and len(wandb.configs) == 1
    assert wandb.configs[0]["resolved_attn"] == "sdpa" and wandb.configs[0]["world_size"] == 1
    assert {step for step, m in wandb.logged.items() if "ms_per_iter" in m} == {1, 2, 3, 4}
    assert {step for step, m in wandb.logged.items() if "val/loss" in m} == {0, 2, 4}
    for step, logged in wandb.logged.items():  # what metrics.jsonl holds, the iteration as wandb's step
        assert logged == json_rows_at(tmp_path, step), step  # nanoGPT's `iter` key too
    assert all("tokens_per_s" in wandb.logged[i] and "mfu" in wandb.logged[i] for i in (1, 2, 3, 4))


def test_wandb_without_a_login_is_one_sentence_before_anything_is_written(char_data, tmp_path, monkeypatch):
    """config/train_gpt2.py sets wandb_log=True: on a machine without a login wandb.init once ended the run with a
    25-line traceback and left an empty out_dir. No key, no ~/.netrc entry, no terminal to ask at."""
    pytest.importorskip("wandb")
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "netrc").write_text("machine example.com login me password secret\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"^wandb_log=True, but wandb has no login here \(no WANDB_API_KEY, no "
                                        r"api.wandb.ai entry in ~/.netrc, no terminal to ask at\): run `wandb login` "
                                        r"once, log offline with WANDB_MODE=offline .*or pass --wandb_log=False\.$"):
        train.main(TINY + [f"--data_dir={char_data}", "--max_iters=2", "--wandb_log=True", f"--out_dir={out}"])
    assert not out.exists()
    from tools.wandb_check import check_wandb
    for key, value in (("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled"), ("WANDB_API_KEY", "x" * 40)):
        with monkeypatch.context() as m:
            m.setenv(key, value)
            check_wandb("owt")  # wandb can log: offline, not at all, or with a key
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "x" * 40 + "\n")
    check_wandb("owt")  # `wandb login`'s entry


@pytest.mark.parametrize("project, why", [("runs/2026?", "it holds / ?"), ("", "0 characters, not 1 to 128")])
def test_a_wandb_project_name_wandb_refuses_is_one_line_before_anything_runs(char_data, tmp_path, monkeypatch,
                                                                               project, why):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "out"
    with pytest.raises(UserError) as refused:
        train.main(TINY + [f"--data_dir={char_data}", "--max_iters=2", "--wandb_log=True", f"--wandb_project={project}",
                           f"--out_dir={out}"])
    assert str(refused.value) == (f"wandb_project={project!r} is not a name wandb takes ({why}); pass "
                                  f"--wandb_project= a name without / \\ # ? % :.")
    assert not out.exists()


def test_wandb_without_its_server_is_one_line_in_bounded_time(char_data, tmp_path, monkeypatch):
    """WANDB_MODE=online with no network: wandb waits INIT_TIMEOUT_S (not its 90 s, retried), then one line."""
    wandb = pytest.importorskip("wandb")
    from tools import wandb_check
    asked = {}

    def unreachable(**kwargs):
        asked.update(kwargs)
        raise wandb.errors.CommError("Timed out while retrying: dial tcp: lookup api.wandb.ai: no such host")
    monkeypatch.setattr(wandb, "init", unreachable)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    with pytest.raises(UserError, match=r"^wandb could not start the run \(CommError: Timed out while retrying: dial "
                                        r"tcp: lookup api.wandb.ai: no such host\); check the network, log offline "
                                        r"with WANDB_MODE=offline \(wandb sync later\), or pass --wandb_log=False\.$"):
        train.main(TINY + [f"--data_dir={char_data}", "--max_iters=2", "--wandb_log=True", f"--out_dir={tmp_path}"])
    assert asked["settings"].init_timeout == wandb_check.INIT_TIMEOUT_S


def test_an_iterations_train_and_val_lines_show_the_same_learning_rate(char_data, tmp_path):
    """Both show the rate of the step that made that iteration's weights (they once disagreed mid-warmup)."""
    train.main(TINY + [f"--data_dir={char_data}", "--max_iters=6", "--eval_interval=2", "--warmup_iters=4",
                       f"--out_dir={tmp_path}"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_lr = {r["iter"]: r["lr"] for r in rows if "train/step_loss" in r}
    val_lr = {r["iter"]: r["lr"] for r in rows if "val/loss" in r}
    assert set(val_lr) == {0, 2, 4, 6} and len(set(train_lr.values())) > 3  # the rate moves: warmup, then decay
    assert all(val_lr[i] == train_lr[i] for i in (2, 4, 6)), (train_lr, val_lr)


@pytest.mark.slow  # wandb starts its own service process
def wandb_history(run_file: Path, timeout: float = 120.0) -> dict[int, dict]:
    """An offline run's history as wandb wrote it, {step: {key: value}}, read with wandb's own record type once its
    exit record is there: wandb.finish() can return before wandb's process has written the file (docs/training.md).
    The file is a LevelDB log (32 KiB blocks of chunks, each with a 7-byte header) after a 7-byte header of its own."""
    import struct
    from wandb.proto import wandb_internal_pb2 as pb
    deadline = time.monotonic() + timeout
    while True:
        data, pos, chunks, records = run_file.read_bytes(), 7, b"", []
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunks, pos = chunks + data[pos + 7:pos + 7 + n], pos + 7 + n
            if kind in (1, 4):  # a full record, or a record's last chunk
                records.append(pb.Record.FromString(chunks))
                chunks = b""
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history: dict[int, dict] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            history.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return history


def test_wandb_offline_run_holds_nanogpts_keys_with_nanogpts_meanings(char_data, tmp_path, monkeypatch,
                                                                      datasheet_peak):
    """A nanoGPT name means what nanoGPT logs: `iter`; `train/loss` and `val/loss` the evaluation's estimates (each
    recomputed here from the checkpoint); `mfu` in percent. One step's loss, ms/iter and tokens/s have names of
    their own. wandb holds every value of metrics.jsonl, at the iteration as its step."""
    pytest.importorskip("wandb")
    from engine.reader import build_model, load_checkpoint
    from core.dataset import Batches
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    train.main(TINY + [f"--data_dir={char_data}", "--max_iters=4", "--eval_interval=2", "--wandb_log=True",
                       f"--out_dir={out}"])
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    history = wandb_history(Path(runs[0]))
    jsonl: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        jsonl.setdefault(json.loads(line)["iter"], {}).update(json.loads(line))
    assert history == jsonl  # every value, at its iteration
    assert sorted(i for i in history if "train/loss" in history[i]) == [0, 2, 4]  # at evaluations only
    assert sorted(i for i in history if "val/loss" in history[i]) == [0, 2, 4]
    assert sorted(i for i in history if "train/step_loss" in history[i]) == [1, 2, 3, 4]
    assert sorted(i for i in history if "ms_per_iter" in history[i]) == [1, 2, 3, 4]
    model = build_model(load_checkpoint(out / "ckpt.pt")).eval()  # saved at iter 4
    with torch.no_grad():
        for split, key in (("train", "train/loss"), ("val", "val/loss")):  # estimate_loss's batches, again
            batches = Batches(char_data, 32, 4, seed=1337 + 1000).micro_batches(split, 2)
            estimate = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
            assert history[4][key] == pytest.approx(estimate, rel=1e-5), key
    for i in (1, 2, 3, 4):  # percent of the datasheet peak (1e12 here), as nanoGPT's
        row = history[i]
        assert row["mfu"] == pytest.approx(100 * model.flops_per_token() * row["tokens_per_s"] / 1e12)
        assert row["tokens_per_s"] == pytest.approx(4 * 32 / (row["ms_per_iter"] / 1000))


def test_max_seconds_stops_then_evaluates_and_saves(char_data, tmp_path):
    train.main(TINY + [f"--data_dir={char_data}", "--max_iters=100000", "--eval_interval=100000",
                       "--max_seconds=0.25", f"--out_dir={tmp_path}"])
    last = max(metrics(tmp_path, "val/loss"))
    assert 0 < last < 100000 and torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == last


class Stream:
    """CUDA's stream order, stood in for on the CPU: a training step is queued; reading a device tensor (item,
    tolist, float, ..., which is memcpy_and_sync on CUDA) or synchronizing waits for everything queued so far. Each
    wait is kept as the number of steps queued then."""

    def __init__(self):
        self.queued, self.waits = 0, []

    def wait(self) -> None:
        self.waits.append(self.queued)


@pytest.fixture()
def stream(monkeypatch):
    """train.py's runs on a Runtime whose stream behaves as CUDA's (Stream); the project's own reads of computed
    values counted as full waits (core/dataset.py reads host-side offsets, not device values)."""
    stream = Stream()

    @dataclasses.dataclass(frozen=True)
    class StreamRuntime(runtime.Runtime):
        def synchronize(self):
            stream.wait()
    monkeypatch.setattr(runtime, "resolve_runtime", lambda *args, **kwargs: StreamRuntime("cpu", "float32"))
    real_step = train.Trainer.step

    def queued_step(self, batches):
        stream.queued += 1
        return real_step(self, batches)
    monkeypatch.setattr(train.Trainer, "step", queued_step)
    project, host_data = str(REPO), str(REPO / "core" / "dataset.py")

    def counted(real):
        def read(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(project) and caller != host_data and "/tests/" not in caller:
                stream.wait()
            return real(tensor, *args, **kwargs)
        return read
    for name in ("item", "tolist", "__float__", "__bool__", "__int__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    return stream


def test_the_device_is_waited_for_only_where_a_line_is_logged_and_an_evaluation_starts(char_data, tmp_path, stream):
    """As nanoGPT's clock: a logged step waits for the device and reads its loss; no other step waits (the host keeps
    queueing work ahead of a GPU), and the clock starts with nothing queued (accumulation 2: micro-batches in play)."""
    assert train.main(TINY + [f"--data_dir={char_data}", "--max_iters=12", "--log_interval=4", "--eval_interval=100",
                              "--gradient_accumulation_steps=2", f"--out_dir={tmp_path}"]) == 0
    assert set(stream.waits) == {0, 1, 4, 8, 12}  # the start, each logged step (the first timed one too), the end
    assert sorted(metrics(tmp_path, "train/step_loss")) == [1, 4, 8, 12] and sorted(metrics(tmp_path, "ms_per_iter")) == [
        1, 4, 8, 12]  # a first line at once, whatever log_interval says


class StepClock:
    """The timer's clock, advanced by hand: each training step takes 1 s, each evaluation 50 s."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("log_interval, eval_interval, resume, compile", [
    (1, 5, False, False), (10, 40, False, False), (3, 4, False, False), (4, 6, True, False), (1, 2, True, False),
    pytest.param(2, 5, True, True, marks=pytest.mark.slow)])
def test_every_line_times_exactly_the_steps_it_counts(char_data, tmp_path, monkeypatch, log_interval, eval_interval,
                                                      resume, compile):
    """A step takes 1 s on the timer's clock and an evaluation 50 s: every line reads 1000 ms/iter, whatever the
    intervals, resumed or not, compiled (whose first step is not timed) or not."""
    clock = StepClock()
    monkeypatch.setattr(train, "time", clock)
    real_step, real_estimate = train.Trainer.step, train.estimate_loss

    def step(self, batches):
        clock.now += 1.0
        return real_step(self, batches)

    def estimate(*args, **kwargs):
        clock.now += 50.0
        return real_estimate(*args, **kwargs)
    monkeypatch.setattr(train.Trainer, "step", step)
    monkeypatch.setattr(train, "estimate_loss", estimate)
    args = TINY + [f"--data_dir={char_data}", f"--log_interval={log_interval}", f"--eval_interval={eval_interval}",
                   "--eval_iters=1", f"--compile={compile}", f"--out_dir={tmp_path}"]
    if resume:
        train.main(args + ["--max_iters=7"])
    train.main(args + ["--max_iters=45"] + (["--init_from=resume"] if resume else []))
    ms = metrics(tmp_path, "ms_per_iter")
    assert len(ms) >= 45 // log_interval - 1 and set(ms.values()) == {1000.0}, ms
    assert all(tps == 4 * 32 for tps in metrics(tmp_path, "tokens_per_s").values())


def test_eval_train_off_evaluates_val_alone_on_the_same_batches(char_data, tmp_path):
    both, val_only = tmp_path / "both", tmp_path / "val_only"
    common = TINY + [f"--data_dir={char_data}", "--max_iters=4", "--eval_interval=2"]
    train.main(common + [f"--out_dir={both}"])
    train.main(common + ["--eval_train=False", f"--out_dir={val_only}"])
    assert metrics(val_only, "val/loss") == metrics(both, "val/loss")  # same weights, same val batches
    assert sorted(metrics(both, "train/loss")) == [0, 2, 4] and metrics(val_only, "train/loss") == {}


@pytest.mark.slow
def test_quickstart_config_loss_falls_and_compile_trains_with_compilation_left_out_of_the_timing(char_data, tmp_path):
    train.main([str(REPO / "config" / "train_shakespeare_char_cpu.py"), f"--data_dir={char_data}", "--max_iters=30",
                "--eval_interval=30", "--eval_iters=5", "--compile=True", "--log_interval=1", f"--out_dir={tmp_path}"])
    val = metrics(tmp_path, "val/loss")
    assert val[30] < val[0] - 0.5
    # step 1 compiles: it trains (its loss is logged) but has no ms/iter, and the timed steps start after it
    assert sorted(metrics(tmp_path, "train/step_loss")) == list(range(1, 31))
    assert sorted(metrics(tmp_path, "ms_per_iter")) == list(range(2, 31))


# -- bad input --------------------------------------------------------------------------------------------

def test_a_missing_data_dir_is_refused_by_name_before_out_dir_is_made(tmp_path):
    with pytest.raises(UserError, match=f"data_dir {tmp_path / 'nothing'} does not exist"):
        train.main(TINY + ["--dataset=openwebtext", f"--data_dir={tmp_path / 'nothing'}",
                           f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


def test_vocab_mismatch_between_data_and_checkpoint_is_refused(char_data, tmp_path):
    train.main(TINY + [f"--data_dir={char_data}", "--max_iters=2", "--eval_interval=2", f"--out_dir={tmp_path}"])
    other = tmp_path / "other"
    other.mkdir()
    for name in ("train.bin", "val.bin"):
        (other / name).write_bytes((char_data / name).read_bytes())
    (other / "meta.json").write_text(json.dumps({"tokenizer": "char", "vocab_size": 3, "chars": ["a", "b", "c"]}))
    before = (tmp_path / "ckpt.pt").read_bytes()
    with pytest.raises(UserError, match=rf"^the checkpoint has vocab_size 25 but the data in {other} has 3 \(char, "
                                        rf"3 characters from 'abc'\); use the data the weights were trained on \(char, "
                                        rf"25 characters from .*\)\.$"):
        train.main(TINY + [f"--data_dir={other}", "--init_from=resume", f"--out_dir={tmp_path}"])
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_corrupt_checkpoint_is_one_sentence_and_stays_on_disk(char_data, tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="corrupt"):
        train.main(TINY + [f"--data_dir={char_data}", "--init_from=resume", f"--out_dir={tmp_path}"])
    assert (tmp_path / "ckpt.pt").read_bytes() == b"not a checkpoint"


def test_attention_the_device_cannot_run_fails_before_training(char_data, tmp_path):
    with pytest.raises(UserError, match="attn='efficient' cannot run"):
        train.main(TINY + [f"--data_dir={char_data}", "--attn=efficient", f"--out_dir={tmp_path}"])
    assert not (tmp_path / "metrics.jsonl").exists()


# -- document masks -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def doc_data(tmp_path_factory) -> Path:
    """Character data with documents: meta.json names '|' the end-of-text token, closing every few lines."""
    d = tmp_path_factory.mktemp("docs")
    text = "".join(f"line {i} of {i * 7 % 13}.\n" + ("|" if i % 3 == 2 else "") for i in range(3000))
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    ids[:int(0.9 * len(ids))].tofile(d / "train.bin")
    ids[int(0.9 * len(ids)):].tofile(d / "val.bin")
    meta = {"tokenizer": "char", "vocab_size": len(chars), "chars": chars, "eot_token": chars.index("|")}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def test_doc_mask_and_window_train_resume_and_reach_the_checkpoint(doc_data, tmp_path):
    args = TINY + [f"--data_dir={doc_data}", "--doc_mask=True", "--window=8", "--eval_interval=3", "--attn=sdpa"]
    straight, stopped = straight_and_resumed(args, tmp_path)
    assert metrics(straight, "val/loss")[6] == metrics(stopped, "val/loss")[6]
    config = torch.load(straight / "ckpt.pt", weights_only=True)["model_config"]
    assert config["doc_mask"] and config["window"] == 8 and config["eot_token"] == json.loads(
        (doc_data / "meta.json").read_text())["chars"].index("|")


def test_doc_mask_on_data_without_documents_is_refused_by_name(char_data, tmp_path):
    with pytest.raises(UserError, match="doc_mask needs the end-of-text token that separates documents.*use a dataset whose meta.json names one"):
        train.main(TINY + [f"--data_dir={char_data}", "--doc_mask=True", f"--out_dir={tmp_path}"])
    assert not list(tmp_path.iterdir())


def test_a_mask_the_implementation_cannot_take_fails_before_training(doc_data, tmp_path):
    with pytest.raises(UserError, match="attn='flex' cannot run for training on cpu in float32 with dropout=0.0, a "
                                        "document or window mask and head size 16: FlexAttention has no backward"):
        train.main(TINY + [f"--data_dir={doc_data}", "--attn=flex", "--window=4", f"--out_dir={tmp_path}"])


# -- configurator ---------------------------------------------------------------------------------------

def settings_namespace() -> dict:
    return {"learning_rate": 6e-4, "batch_size": 12, "attn": "sdpa", "compile": True, "wandb_run_name": None,
            "betas": (0.9, 0.95)}


def test_overrides_are_literals_and_bare_words_stay_strings():
    ns = settings_namespace()
    s = configure(ns, ["--batch_size=32", "--attn=flash", "--compile=False", "--wandb_run_name=lr=3e-4,bs=32"])
    assert (s.batch_size, s.attn, s.compile) == (32, "flash", False)
    assert s.wandb_run_name == "lr=3e-4,bs=32"  # a value may contain '='
    assert ns == settings_namespace()  # the script's own defaults are left alone: main() can run again


def test_an_int_is_accepted_where_a_float_is_expected():
    s = configure(settings_namespace(), ["--learning_rate=1"])
    assert s.learning_rate == 1.0 and isinstance(s.learning_rate, float)


def test_unknown_key_names_the_closest_valid_keys():
    with pytest.raises(UserError, match="unknown setting 'learning_rat'; did you mean learning_rate"):
        configure(settings_namespace(), ["--learning_rat=1e-3"])


def test_a_wrong_type_is_one_sentence_showing_the_value_so_far(tmp_path):
    with pytest.raises(UserError, match=r"batch_size expects an int \(like 12\), got 'big' \(str\)"):
        configure(settings_namespace(), ["--batch_size=big"])
    (tmp_path / "a.py").write_text("batch_size = 32\n")
    with pytest.raises(UserError, match=r"batch_size expects an int \(like 32\), got 'big' \(str\)"):
        configure(settings_namespace(), [str(tmp_path / "a.py"), "--batch_size=big"])
    with pytest.raises(UserError, match=r"unknown setting 'zzz'; --help lists the settings\."):
        configure(settings_namespace(), ["--zzz=1"])


def test_config_files_apply_in_order_and_are_checked_too(tmp_path):
    (tmp_path / "a.py").write_text("batch_size = 64\nattn = 'manual'\n")
    (tmp_path / "bad.py").write_text("batchsize = 64\n")
    s = configure(settings_namespace(), [str(tmp_path / "a.py"), "--attn=math"])
    assert (s.batch_size, s.attn) == (64, "math")
    with pytest.raises(UserError, match="did you mean batch_size"):
        configure(settings_namespace(), [str(tmp_path / "bad.py")])
    with pytest.raises(UserError) as missing:
        configure(settings_namespace(), ["nope.py"])
    assert str(missing.value).startswith("config file 'nope.py' not found; pass the path of an existing one "
                                         "(config/ holds eval_gpt2.py, ")  # the folder's config files, named
    with pytest.raises(UserError, match=r"^config file 'config/train_shakespeare_char_cp.py' not found; did you mean "
                                        r"config/train_shakespeare_char_cpu.py\?$"):  # the closest, not the GPU one
        configure(settings_namespace(), ["config/train_shakespeare_char_cp.py"])


def test_the_gpt2_recipe_pads_the_vocabulary_as_the_posts_fast_path():
    settings = configure(vars(train), [str(Path(train.__file__).parent / "config" / "train_gpt2.py")], train.LIMITS)
    assert settings.pad_vocab is True  # 50257 -> 50304: aligned lm_head tiles for the command it serves


def test_train_reports_a_mistyped_setting_with_the_closest_names():
    with pytest.raises(UserError, match="unknown setting 'batch_sise'; did you mean batch_size"):
        train.main(["--batch_sise=3"])


# -- learning-rate schedule ----------------------------------------------------------------------------------

def schedule(*args: str) -> list[float]:
    cfg = configure(vars(train), ["--learning_rate=1e-2", "--warmup_iters=10", "--lr_decay_iters=100",
                                  "--min_lr=1e-3", *args], train.LIMITS)
    return [cfg.learning_rate * train.lr_multiplier(it, cfg) for it in range(0, 111)]


def test_the_schedule_warms_up_linearly_then_follows_a_cosine_to_min_lr():
    lr = schedule()
    assert lr[0] == pytest.approx(1e-2 / 11) and lr[9] == pytest.approx(1e-2 * 10 / 11)
    assert lr[10] == pytest.approx(1e-2) and lr[55] == pytest.approx((1e-2 + 1e-3) / 2)  # the cosine's midpoint
    assert lr[100] == pytest.approx(1e-3) and lr[110] == 1e-3
    assert all(a >= b for a, b in zip(lr[10:101], lr[11:101]))


def test_an_early_decay_reaches_its_level_at_early_decay_iters_then_decays_on_to_min_lr():
    lr = schedule("--early_decay_iters=40", "--early_decay_to=0.3")
    assert lr[:11] == pytest.approx(schedule()[:11])  # the same warmup
    assert lr[25] == pytest.approx((1e-2 + 3e-3) / 2) and lr[40] == pytest.approx(3e-3)  # the first cosine
    assert lr[70] == pytest.approx((3e-3 + 1e-3) / 2) and lr[100] == pytest.approx(1e-3)  # the second
    assert all(a >= b for a, b in zip(lr[10:101], lr[11:101]))  # never rises again


def test_the_first_evaluation_says_what_it_does_at_once_and_how_long_it_takes_when_long(char_data, tmp_path,
                                                                                     monkeypatch, capsys):
    """A CPU's first evaluation of a real config runs for many minutes before the first log line: it is announced
    before its first batch, and once two batches have run the rest is estimated (any wait over Progress.AFTER_S)."""
    from engine.metrics import Progress
    monkeypatch.setattr(Progress, "AFTER_S", 0.0)  # every estimate counts as long here
    train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={tmp_path}", "--max_iters=2", "--eval_interval=2",
                       "--eval_iters=50"])
    out = capsys.readouterr().out.splitlines()
    first = out.index("evaluating train and val: 100 batches ...")
    assert re.fullmatch(r"evaluating train and val: about \d+ s more at [\d.]+ s a batch \(--eval_iters= sets how "
                        r"many\)", out[first + 1])
    assert out[first + 2].startswith("iter 0  train/loss")
    assert sum(line.endswith("batches ...") for line in out) == 1  # the later evaluation is not announced again


def test_the_banner_says_how_the_ranks_split_the_work(char_data):
    from types import SimpleNamespace
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=11))
    rt = SimpleNamespace(world_size=2, is_distributed=True, dtype="float32", name="CPU", muon_dtype="float32",
                         device_type="cpu")
    cfg = SimpleNamespace(optimizer="adamw", parallel="fsdp", gradient_accumulation_steps=2, batch_size=4,
                          block_size=8, dtype="float32")
    per_iter = train.tokens_per_iter(cfg)
    assert ", 2 ranks under FSDP2, 64 tokens per iteration" in train_metrics.banner(cfg, rt, model, per_iter)
    cfg.parallel = "ddp"
    assert ", 2 ranks under DDP, " in train_metrics.banner(cfg, rt, model, per_iter)
    rt.world_size, rt.is_distributed = 1, False
    assert ", world size 1, " in train_metrics.banner(cfg, rt, model, per_iter)


def test_omp_num_threads_past_what_the_cpus_run_is_refused_before_anything_is_made(char_data, tmp_path, monkeypatch):
    """OMP_NUM_THREADS=10000 once started 10,000 threads and hung: the cap --threads= has holds for it too."""
    monkeypatch.setenv("OMP_NUM_THREADS", "10000")
    threads = torch.get_num_threads()
    with pytest.raises(UserError, match=r"^OMP_NUM_THREADS=10000 is more threads than the \d+ CPU"):
        train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={tmp_path / 'out'}", "--max_iters=1"])
    assert not (tmp_path / "out").exists() and torch.get_num_threads() == threads


def test_the_log_line_writes_tokens_per_s_as_a_plain_number(tmp_path, capsys):
    from types import SimpleNamespace
    from engine.metrics import MetricsLog
    log = MetricsLog(SimpleNamespace(out_dir=str(tmp_path), wandb_log=False, init_from="scratch"), {}, enabled=True)
    log.log({"iter": 10, "train/step_loss": 1.5, "ms_per_iter": 114.85, "tokens_per_s": 17834.2, "mfu": 1.23})
    assert capsys.readouterr().out == ("iter 10  train/step_loss 1.5000  ms_per_iter 114.8  tokens_per_s 17,834  "
                                       "mfu 1.23%\n")
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["tokens_per_s"] == 17834.2  # the file: exact
    log.log({"iter": 20, "ms_per_iter": 11680.4, "lr": 6e-5})  # a busy CPU's step: a number people read
    assert capsys.readouterr().out == "iter 20  ms_per_iter 11680  lr 6e-05\n"


def test_every_start_up_problem_of_a_command_is_printed_at_once_with_the_cpu_recipe_for_a_gpu_sized_model(
        char_data, tmp_path):
    """README's GPT-2 command on a CPU met its problems one run at a time (wandb, then the data, ...): one line
    now names them all, and on a CPU a GPU-sized model's line names the command that runs here."""
    args = ["config/train_gpt2.py", "--wandb_log=False", "--async_save=True", "--device=cpu",
            f"--out_dir={tmp_path / 'out'}"]
    with pytest.raises(UserError) as refused:
        train.main(args)
    said = str(refused.value)
    assert said.startswith("2 problems: (1) async_save=True writes sharded checkpoints only; add "
                           "--checkpoint_format=sharded. (2) dataset 'openwebtext' is not prepared")
    assert said.endswith(f"(this is a GPU-sized model: on this CPU its first evaluation alone takes hours; the CPU "
                         f"recipe is {startup.CPU_COMMAND})")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=r"^async_save=True writes sharded checkpoints only; add "
                                        r"--checkpoint_format=sharded\.$"):  # one problem, a small model: as before
        train.main(TINY + ["--async_save=True", f"--data_dir={char_data}", f"--out_dir={tmp_path / 'out'}"])


def test_nanogpts_backend_flag_is_taken_and_the_banner_names_the_layers_nanogpt_builds_otherwise(char_data, tmp_path,
                                                                                                  capsys):
    """nanoGPT's config files leave bias and the GELU to its train.py (no biases, the exact GELU); here GPT-2's are
    the defaults, so the banner says which a run builds. --backend=gloo is nanoGPT's flag for the process group."""
    assert train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={tmp_path / 'a'}", "--max_iters=1",
                              "--backend=gloo"]) == 0
    assert "parameters (biases, tanh GELU; nanoGPT's train.py: --bias=False --gelu=none), attn=" in (
        capsys.readouterr().out)
    assert train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={tmp_path / 'b'}", "--max_iters=1",
                              "--bias=False", "--gelu=none"]) == 0
    assert "parameters (no biases, exact GELU), attn=" in capsys.readouterr().out
    assert train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={tmp_path / 'c'}", "--max_iters=1",
                              "--gelu=none", "--window=8"]) == 0  # one flag differs: that one is named
    banner = capsys.readouterr().out
    assert "parameters (biases, exact GELU; nanoGPT's train.py: --bias=False), attn=sdpa" in banner
    assert ", window 8, float32 on " in banner


@pytest.mark.parametrize("args, note", [
    (["--window=64"], "note: window=64 is not shorter than block_size=32, so every token sees its whole block"),
    (["--gradient_accumulation_steps=40"], "note: a model of about 24,576 block parameters takes 40 micro-steps "
                                           "(5,120 tokens) an iteration"),
    (["--dtype=float16"], "note: float16 on a CPU is emulated"),
    (["--block_size=10000", "--batch_size=1", "--eval_iters=1"], "note: block_size=10,000 on a CPU: every step and "
                                                                 "evaluation batch attends over 1 x 10,000 positions"),
])
def test_a_setting_that_does_not_do_what_it_seems_is_a_note_at_start(char_data, tmp_path, capsys, args, note):
    assert train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={tmp_path}", "--max_iters=0", *args]) == 0
    assert note in capsys.readouterr().err


def test_an_empty_out_dir_is_refused_before_anything_is_written(char_data, tmp_path, monkeypatch):
    """--out_dir=$UNSET trained into the current folder once."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^out_dir is empty \(an unset shell variable\?\); pass --out_dir= a folder"):
        train.main(TINY + [f"--data_dir={char_data}", "--out_dir=", "--max_iters=1"])
    assert list(tmp_path.iterdir()) == []


def test_every_line_reaches_a_log_file_at_once(tmp_path):
    """A script's output to a file or pipe is line-buffered (runtime.run_main): a line printed before minutes of work
    (the banner, then a long probe) is there at once, not when the buffer fills or the process ends."""
    script = "from core import runtime\nimport time\nruntime.run_main(lambda: print('the banner') or time.sleep(60))"
    run = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                           env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
                                "PYTHONPATH": str(REPO)})  # as a user's shell has it
    try:
        import select
        assert select.select([run.stdout], [], [], 20)[0], "nothing within 20 s"  # a full buffer: the whole minute
        assert run.stdout.readline() == "the banner\n"
    finally:
        run.kill()
        run.wait()


def test_a_prepare_into_a_running_trainings_data_folder_does_not_change_what_it_reads(char_data, tmp_path,
                                                                                      monkeypatch):
    """A prepare renames new train.bin and val.bin over the names while a run trains on them: the run reads the files
    it opened and checked, so its losses and evaluations are those of a run on the old files throughout."""
    import shutil
    from core.writing import staged_outputs
    folders = [shutil.copytree(char_data, tmp_path / name) for name in ("straight", "replaced")]
    args = TINY + ["--max_iters=4", "--eval_interval=2"]
    train.main(args + [f"--data_dir={folders[0]}", f"--out_dir={tmp_path / 'a'}"])
    real, steps = trainer.Trainer.step, []

    def step(self, micro_batches):
        if len(steps) == 1:  # a prepare's renames, between steps 1 and 2
            with staged_outputs(folders[1], ["train.bin", "val.bin"]) as tmp:
                for name in ("train.bin", "val.bin"):
                    ids = np.fromfile(folders[1] / name, dtype=np.uint16)
                    ids[::-1].tofile(tmp[name])  # the same ids, in another order: another text
        steps.append(1)
        return real(self, micro_batches)
    monkeypatch.setattr(trainer.Trainer, "step", step)
    train.main(args + [f"--data_dir={folders[1]}", f"--out_dir={tmp_path / 'b'}"])
    assert len(steps) == 4 and not np.array_equal(np.fromfile(folders[1] / "val.bin", dtype=np.uint16),
                                                   np.fromfile(folders[0] / "val.bin", dtype=np.uint16))
    for key in ("train/step_loss", "val/loss", "train/loss"):
        assert metrics(tmp_path / "b", key) == metrics(tmp_path / "a", key), key
