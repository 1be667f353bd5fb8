"""Faults of real use: two runs on one out_dir, SIGTERM and Ctrl-C during saves, torchrun's variables without
torchrun, None as a setting, and messages whose advice must be the fix. One sentence, exit 2 (143 and 130 for the
signals), and nothing on disk lost or left behind."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import sample
import train
from conftest import REPO, SHARDED, TINY
import torch

from core import errors
from core.configurator import configure
from core.errors import UserError
from engine.reader import load_checkpoint


def tiny(char_data, out, *args) -> list[str]:
    return TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--eval_interval=2", *args]


# -- one run per out_dir ----------------------------------------------------------------------------------

HOLD = textwrap.dedent("""
    import sys, time
    from core import writing
    lock = writing.OutDirLock(__import__("pathlib").Path(sys.argv[1]))
    print("held", flush=True)
    time.sleep(60)
""")


def test_a_second_run_on_a_trained_out_dir_is_refused_naming_the_holder_and_kill_9_frees_it(char_data, tmp_path,
                                                                                                  monkeypatch):
    """A resume takes the lock before it reads: the run holding out_dir may be removing the step it would read."""
    out = tmp_path / "run"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        with monkeypatch.context() as patch:
            patch.setattr("engine.reader.read", lambda *args, **kwargs: pytest.fail("read before the lock was held"))
            for args in (["--max_iters=4", "--init_from=resume"], ["--max_iters=2", "--overwrite=True"]):
                with pytest.raises(UserError, match=rf"{out} is in use by another run; wait"):
                    train.main(tiny(char_data, out, *args))
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing written
        _, tok, _, _ = sample.load_model("resume", str(out))  # readers read while a run holds it
    finally:
        holder.kill()  # SIGKILL: the OS drops the lock with the process
        holder.wait()
    assert train.main(tiny(char_data, out, "--max_iters=4", "--init_from=resume")) == 0
    assert load_checkpoint(out / "ckpt.pt").iter_num == 4


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK], ids=["ENOSYS", "EOPNOTSUPP",
                                                                                 "ENOLCK"])
def test_a_filesystem_without_file_locks_trains_unlocked_after_one_line(char_data, tmp_path, monkeypatch, capsys,
                                                                          code):
    """Lustre mounted without -o flock, some NFS: flock raises OSError, not BlockingIOError."""
    import fcntl

    def no_locks(file, operation):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "run"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "lock" in line]
    assert notes == [f"note: {out}'s filesystem has no file locks ({os.strerror(code)}); this run goes on unlocked, "
                     f"so start no other run on this out_dir until it ends."]
    assert (out / "ckpt.pt").exists()


def test_a_refused_run_leaves_no_out_dir_and_no_lock_behind(char_data, tmp_path):
    for args in (["--init_from=resume"], ["--attn=efficient"], ["--doc_mask=True"]):
        out = tmp_path / "nothing"
        with pytest.raises(UserError):
            train.main(tiny(char_data, out, *args))
        assert not out.exists(), args
    out = tmp_path / "trained"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(UserError):
        train.main(tiny(char_data, out, "--init_from=resume", "--attn=efficient"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# -- signals ---------------------------------------------------------------------------------------------

def signalled_during(monkeypatch, target, name: str, sig: int) -> None:
    """`target.name` sends this process `sig` when it is called for step 4, as a scheduler would mid-save."""
    real, sent = getattr(target, name), []

    def send(*args, **kwargs):  # once: a second signal ends the process, as it would a user's
        if not sent and ("000004" in str(args) or f"ckpt.pt.{os.getpid()}.tmp" in str(args)):
            sent.append(sig)
            os.kill(os.getpid(), sig)
        return real(*args, **kwargs)
    monkeypatch.setattr(target, name, send)


LONG_C_CALL = """
import sys, torch
from core import errors, files, writing
from pathlib import Path
def main():
    with writing.staged_outputs(Path(sys.argv[1]), ["ckpt.pt"]) as tmp:  # a save, whole before the long call
        tmp["ckpt.pt"].write_bytes(b"weights")
    a = torch.randn(6000, 6000, dtype=torch.float64)
    print("in the call", flush=True)
    a @ a  # seconds in one C call: a device wait behind a dead peer's collective, as a CPU can show it
    print("the call returned", flush=True)
sys.exit(errors.exit_code(main))
"""


def test_a_sigterm_outside_a_save_ends_the_process_at_once_even_in_a_long_c_call(tmp_path):
    """A Python handler runs only when the main thread returns to Python: outside a save, SIGTERM keeps its default
    action, so the process ends within half a second (not when the call returns), as the shell's 143, with nothing
    half-written."""
    run = subprocess.Popen([sys.executable, "-c", LONG_C_CALL, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                           text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.stdout.readline() == "in the call\n"
    time.sleep(0.3)  # well inside the matmul
    sent = time.perf_counter()
    run.send_signal(signal.SIGTERM)
    code = run.wait(timeout=60)
    assert time.perf_counter() - sent < 0.5 and code == -signal.SIGTERM  # a shell reports 128 + 15 = 143
    assert run.stdout.read() == ""  # the call never returned
    assert (tmp_path / "ckpt.pt").read_bytes() == b"weights" and not list(tmp_path.glob("*.tmp"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # and the test process's own is untouched


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_a_single_file_save_removes_the_temporary_file_and_keeps_the_checkpoint(
        char_data, tmp_path, monkeypatch, capsys, sig, code):
    out = tmp_path / "run"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0
    kept = (out / "ckpt.pt").read_bytes()
    signalled_during(monkeypatch, torch, "save", sig)  # torch.save writing ckpt.pt.tmp
    assert errors.exit_code(lambda: train.main(tiny(char_data, out, "--max_iters=4", "--init_from=resume"))) == code
    assert (out / "ckpt.pt").read_bytes() == kept and not list(out.glob("*.tmp"))
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("stopped by SIGTERM" if code == 143 else "interrupted")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or code == 130  # put back after the run


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_a_sharded_save_is_an_interruption_and_leaves_no_partial_step(
        char_data, tmp_path, monkeypatch, capsys, sig, code):
    from torch.distributed.checkpoint.filesystem import FileSystem
    out = tmp_path / "run"
    assert train.main(tiny(char_data, out, "--max_iters=2", *SHARDED)) == 0
    signalled_during(monkeypatch, FileSystem, "create_stream", sig)
    assert errors.exit_code(lambda: train.main(tiny(char_data, out, "--max_iters=4", "--init_from=resume",
                                                     *SHARDED))) == code
    err = capsys.readouterr().err
    assert "free disk space" not in err and "could not write" not in err
    assert sorted(p.name for p in out.glob("step-*")) == ["step-000002"] and (out / "latest").read_text() == \
        "step-000002"


# -- torchrun's variables without torchrun ---------------------------------------------------------------

@pytest.mark.parametrize("env, sentence", [
    (dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2"), "RANK and WORLD_SIZE=2 are set without MASTER_ADDR and "
                                                     "MASTER_PORT: the ranks have nowhere to meet; launch with torchrun"),
    (dict(RANK="0", WORLD_SIZE="1"), "RANK is set but LOCAL_RANK is not, as torchrun would set them"),
    (dict(RANK="0"), "RANK is set but LOCAL_RANK and WORLD_SIZE are not"),
    (dict(RANK="3", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="x", MASTER_PORT="1"), "cannot be one of torchrun's"),
    (dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="x", MASTER_PORT="abc"),
     r"MASTER_PORT='abc' is not a port number \(1-65535\); set it to a free port such as 29500"),
    (dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="x", MASTER_PORT="70000"), "not a port number"),
    (dict(RANK="zero", LOCAL_RANK="0", WORLD_SIZE="2"), "must be whole numbers"),
])
def test_torchruns_variables_without_torchrun_are_one_sentence_before_anything_is_written(char_data, tmp_path,
                                                                                          monkeypatch, env, sentence):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=sentence):
        train.main(tiny(char_data, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# -- None, and whole numbers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("script, arg", [(train, "--block_size=None"), (train, "--compile=None"),
                                         (train, "--out_dir=None"), (sample, "--num_samples=None")])
def test_none_is_refused_for_a_setting_it_means_nothing_for(script, arg):
    key = arg[2:].split("=")[0]
    with pytest.raises(UserError, match=rf"^{key} cannot be None; pass --{key}= an? \w+ like its default"):
        configure(vars(script), [arg], script.LIMITS)


def test_none_stays_allowed_where_it_means_something(tmp_path):
    assert configure(vars(sample), ["--top_k=None"], sample.LIMITS).top_k is None  # every token
    assert configure(vars(train), ["--muon_lr=None"], train.LIMITS).muon_lr is None  # learning_rate's
    config = tmp_path / "c.py"
    config.write_text("max_iters = None\n")
    with pytest.raises(UserError, match="max_iters cannot be None"):
        configure(vars(train), [str(config)], train.LIMITS)


def test_a_whole_number_setting_sized_by_the_script_refuses_a_fraction():
    from benchmarks import time_to_loss
    with pytest.raises(UserError, match=r"runs must be a whole number, got 1.5; pass --runs= an integer in \[1, inf\)"):
        configure(vars(time_to_loss), ["--runs=1.5"], time_to_loss.LIMITS)
    import bench
    with pytest.raises(UserError, match="n_layer must be a whole number"):
        configure(vars(bench), ["--n_layer=1.5"], bench.LIMITS)


# -- advice that is the fix ----------------------------------------------------------------------------------

def test_export_into_an_unwritable_folder_advises_hf_dir_not_out_dir(char_data, tmp_path, monkeypatch):
    import export_hf
    from core import writing
    out = tmp_path / "run"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0
    real = writing.tempfile.TemporaryFile

    def read_only(*args, dir=None, **kwargs):  # out_dir read-only, as a shared checkpoint folder is (root writes all)
        if dir is not None and str(dir).startswith(str(out)):
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kwargs)
    monkeypatch.setattr(writing.tempfile, "TemporaryFile", read_only)
    with pytest.raises(UserError, match=r"cannot be written to \(Permission denied\); pass --hf_dir= a writable"):
        export_hf.main([f"--out_dir={out}"])
    assert not (out / "hf").exists()


def test_an_embedded_dataset_that_cannot_be_prepared_in_place_is_one_sentence_advising_data_dir(tmp_path,
                                                                                              monkeypatch):
    from core import dataset
    monkeypatch.setattr(dataset, "DATA", tmp_path / "data")
    (tmp_path / "data" / "shakespeare_char").mkdir(parents=True)
    (tmp_path / "data" / "shakespeare_char" / "prepare.py").write_text("raise SystemExit('never run')")
    real_access = dataset.os.access  # data/shakespeare_char read-only, as for root it never is
    monkeypatch.setattr(dataset.os, "access", lambda path, mode: not str(path).endswith("shakespeare_char") and
                        real_access(path, mode))
    with pytest.raises(UserError, match=r"^dataset 'shakespeare_char' is not prepared and data/shakespeare_char/ "
                                        r"cannot be written to; prepare it elsewhere with .* --out_dir=DIR and pass "
                                        r"--data_dir=DIR\.$"):
        train.main(TINY + ["--dataset=shakespeare_char", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


def test_compares_held_out_data_prepared_again_with_a_larger_vocabulary_is_refused(char_data, tmp_path):
    import numpy as np
    import shutil
    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    out = tmp_path / "run"
    assert train.main(tiny(data, out, "--max_iters=2")) == 0
    np.full(4096, 300, dtype=np.uint16).tofile(data / "val.bin")  # re-prepared: ids past the 65-odd characters
    with pytest.raises(UserError, match=r"val.bin holds token id 300, beyond the checkpoint's \d+-token vocabulary"):
        sample.main([f"--out_dir={out}", "--compare=manual", "--num_samples=1", "--max_new_tokens=4",
                     "--device=cpu", "--dtype=float32"])


# -- torchrun --max-restarts ---------------------------------------------------------------------------------

DIES_ONCE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv.pop(1))
    from core import runtime
    from engine import trainer
    import train
    real, steps = trainer.Trainer.step, [0]
    def step(self, batches):  # rank 1 of the first attempt dies at its fifth step, as a lost node does
        steps[0] += 1
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1" and steps[0] == 5:
            os._exit(1)
        return real(self, batches)
    trainer.Trainer.step = step
    runtime.run_main(lambda: train.main(sys.argv[1:]))
""")


@pytest.mark.slow  # torchrun, two ranks, twice: ~15 s
def test_torchrun_restarts_the_ranks_after_one_dies_and_they_resume_to_the_end(char_data, tmp_path):
    """torchrun's store outlives a restart: without keys of each attempt's own the restarted gloo ranks read the
    dead ranks' addresses (1 of 5 restarts finished here, the others failed in connectFullMesh or hung)."""
    out = tmp_path / "run"
    args = TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--eval_interval=2", "--gradient_accumulation_steps=2"]
    assert train.main(args + ["--max_iters=2"]) == 0
    (tmp_path / "dies_once.py").write_text(DIES_ONCE)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "--max-restarts=1", str(tmp_path / "dies_once.py"), str(REPO), *args, "--max_iters=12",
                           "--init_from=resume"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert load_checkpoint(out / "ckpt.pt").iter_num == 12


# -- small untruths --------------------------------------------------------------------------------------------

def test_the_words_a_newcomer_meets_say_what_is_true(char_data, tmp_path, capsys):
    from model import GPTConfig
    with pytest.raises(UserError, match=r"attn='auto' is measured on a model, not stored in a config: .* "
                                        r"model.set_attention\('auto'\)"):
        GPTConfig(attn="auto")
    out = tmp_path / "run"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0
    with pytest.raises(UserError, match=rf"out_dir {out / 'ckpt.pt'} is a file; out_dir is the folder that holds "
                                        rf"ckpt.pt: pass --out_dir={out}\."):
        sample.main([f"--out_dir={out / 'ckpt.pt'}"])
    capsys.readouterr()
    assert errors.exit_code(lambda: (_ for _ in ()).throw(errors.StoppedWithRank0("rank 0 stopped"))) == 2
    assert capsys.readouterr().err == ""  # rank 0 prints the sentence; the others stop quietly


def test_the_retired_flashattention_builds_are_unknown_attn_words():
    for attn in ("flash3", "flash4", "flex_flash"):
        with pytest.raises(UserError, match=rf"attn must be one of 'auto', 'manual', .*got '{attn}'"):
            configure(vars(train), [f"--attn={attn}"], train.LIMITS)
