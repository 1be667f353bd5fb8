"""Faults as a careful user and a cluster operator meet them: a signal at any byte of a save, a resume that would
train another shape or other text, token files cut short, outputs named wrong, refusals under torchrun, and what a
shared filesystem or a MIG slice does. Each ends in one `error:` line (exit 2) or a run that says in one `note:` what
it did instead; nothing on disk is lost and every next command named works."""

import json
import numpy as np
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import sample
import train
from engine import metrics as train_metrics
from conftest import REPO, TINY, ctrl_c_at_step
from core import errors, writing
from core.errors import UserError
from engine.reader import load_checkpoint


def tiny(char_data, out, *args) -> list[str]:
    return TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--eval_interval=2", *args]


# -- signals and saves ---------------------------------------------------------------------------------------

def signalled_around_save(monkeypatch, when: str, sig: int) -> None:
    """torch.save of ckpt.pt's temporary file sends this process `sig` as it starts or once it has written the last
    byte (before the rename), as Ctrl-C or a scheduler's SIGTERM lands during a save."""
    real = torch.save

    def save(contents, path):
        if when == "start":
            os.kill(os.getpid(), sig)
        real(contents, path)
        if when == "end":
            os.kill(os.getpid(), sig)
    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "stopped by SIGTERM")], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("when", ["start", "end"])
def test_a_signal_during_a_save_keeps_the_old_checkpoint_and_says_one_line(char_data, tmp_path, monkeypatch, capfd,
                                                                           sig, code, said, when):
    """The write runs to its end, then the temporary file goes and the old checkpoint stays: one line, no traceback,
    the test process's own handlers put back."""
    out = tmp_path / "run"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0
    kept = (out / "ckpt.pt").read_bytes()
    capfd.readouterr()
    signalled_around_save(monkeypatch, when, sig)
    assert errors.exit_code(lambda: train.main(tiny(char_data, out, "--max_iters=4", "--init_from=resume"))) == code
    assert (out / "ckpt.pt").read_bytes() == kept and not list(out.glob("*.tmp"))
    err = capfd.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and "unexpected pos" not in "\n".join(err)
    assert err[-2].startswith("stopped at iter 4; the checkpoint kept in") and err[-1] == said
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the test process's own, put back
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


SECOND_CTRL_C = textwrap.dedent("""
    import atexit, os, signal, sys, time
    from core import runtime
    def late():
        if sys.argv[1] == "at-exit":
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while exiting (atexit callbacks: wandb, compile workers)
            time.sleep(1)
            print("atexit went on", flush=True)
    atexit.register(late)
    def main():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        finally:  # the clean-up, a slow one (an upload, a wait for a save)
            if sys.argv[1] == "during-clean-up":
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            print("cleaned up", flush=True)
    runtime.run_main(main)
""")


@pytest.mark.parametrize("when, out, err", [("during-clean-up", "", ""), ("at-exit", "cleaned up\n", "interrupted\n")])
def test_a_second_ctrl_c_ends_the_process_at_once_without_a_second_traceback(when, out, err):
    """The first Ctrl-C stops the work and its clean-up runs; a second, during that clean-up or during Python's exit,
    ends the process at once (a hung clean-up can always be ended), not with a traceback or 'Exception ignored'."""
    done = subprocess.run([sys.executable, "-c", SECOND_CTRL_C, when], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert (done.stdout, done.stderr) == (out, err)
    assert done.returncode == -signal.SIGINT  # the shell's 130, said by the signal itself


def test_removing_a_half_written_file_is_never_cut_short(tmp_path):
    """The one moment a second signal waits for: the temporary file's removal after the first."""
    real_unlink = Path.unlink

    def unlink(path, missing_ok=False):
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C just as the removal starts
        return real_unlink(path, missing_ok=missing_ok)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(Path, "unlink", unlink)
            with pytest.raises(KeyboardInterrupt):
                with writing.staged_outputs(tmp_path, ["ckpt.pt"]) as tmp:
                    tmp["ckpt.pt"].write_bytes(b"half")
                    raise KeyboardInterrupt
        assert not list(tmp_path.iterdir())  # removed all the same
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # and a third ends the process at once
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # pytest's own, for the tests after this one


def test_ctrl_c_before_the_first_checkpoint_names_the_same_command_which_starts_again(char_data, tmp_path,
                                                                                      monkeypatch, capsys):
    """A folder holding only the log (and lock) of a run stopped before its first checkpoint has nothing to resume:
    the same command reuses it, so the hint names no --overwrite=True (copied by habit later, it would replace a
    real run)."""
    out = tmp_path / "run"
    args = tiny(char_data, out, "--max_iters=4", "--eval_interval=4")
    for step in (1, 2):  # before any log line, and after one
        ctrl_c_at_step(monkeypatch, step)
        assert errors.exit_code(lambda: train.main(args)) == 130
        hint = capsys.readouterr().err.strip().splitlines()[-2]
        assert hint == (f"stopped at iter {step - 1}; no checkpoint was saved in {out}; start again with: "
                        f"python train.py {shlex.join(args)}")
        assert (out / ".lock").exists() and not (out / "ckpt.pt").exists()
        monkeypatch.undo()
    assert train.main(args) == 0  # the command as the hint names it


def test_under_torchrun_the_resume_hint_is_a_torchrun_command(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    run = SimpleNamespace(rt=SimpleNamespace(is_distributed=True, world_size=2), saved_at=4, iter_num=5)
    hint = train_metrics.resume_hint(SimpleNamespace(out_dir="out"), run, ["config/x.py", "--init_from=scratch"])
    assert hint.endswith("continue with: torchrun --nproc_per_node=2 train.py config/x.py --init_from=resume")
    run.rt.world_size = 16  # two nodes of 8: their rendezvous options are the user's
    assert "continue with: torchrun <your torchrun options> train.py config/x.py" in train_metrics.resume_hint(
        SimpleNamespace(out_dir="out"), run, ["config/x.py"])


def test_the_new_checkpoint_reaches_the_disk_before_it_replaces_the_old(tmp_path, monkeypatch):
    order = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(writing.os, "fsync", lambda fd: order.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(writing.os, "replace", lambda a, b: order.append(("replace", str(a))) or real_replace(a, b))
    with writing.staged_outputs(tmp_path, ["ckpt.pt"]) as tmp:
        tmp["ckpt.pt"].write_bytes(b"weights")
    staged = str(tmp_path / f"ckpt.pt.{os.getpid()}.tmp")  # this process's own: two writers never share one
    assert order == [("fsync", staged), ("replace", staged),
                     ("fsync", str(tmp_path))]  # the file's bytes, then the rename itself


def test_the_lock_stays_after_a_run_stopped_with_checkpoints_saved(char_data, tmp_path, monkeypatch):
    """A .lock unlinked by a run that ends would let a second run lock a new file while a third still holds the old
    one: it stays, whatever way the run ends."""
    out = tmp_path / "run"
    ctrl_c_at_step(monkeypatch, 4)  # after the saves of iters 1, 2 and 3
    assert errors.exit_code(lambda: train.main(tiny(char_data, out, "--max_iters=8", "--eval_interval=1"))) == 130
    assert load_checkpoint(out / "ckpt.pt").iter_num == 3 and (out / "metrics.jsonl").exists()
    assert (out / ".lock").exists()


SLOW_DEFERRED_BLOCK = """
import sys, time
from core import errors
with errors.deferred_signals():
    print("in the block", flush=True)
    time.sleep(3)
    print("ran to its end", flush=True)
"""


def test_a_second_signal_inside_a_deferred_write_ends_the_process_at_once():
    """A write that must end whole holds the first Ctrl-C; a second one, 0.2 s later, ends the process then."""
    run = subprocess.Popen([sys.executable, "-c", SLOW_DEFERRED_BLOCK], cwd=REPO, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.stdout.readline() == "in the block\n"
    run.send_signal(signal.SIGINT)
    time.sleep(0.2)
    sent = time.perf_counter()
    run.send_signal(signal.SIGINT)
    assert run.wait(timeout=60) == -signal.SIGINT and time.perf_counter() - sent < 1.0
    assert run.stdout.read() == ""  # the block did not run on


# -- a resume that would train another shape, or other text ---------------------------------------------------

def test_a_resume_refuses_a_shape_typed_otherwise_and_saves_the_shape_it_trains(char_data, tmp_path):
    out = tmp_path / "run"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0  # TINY: 2 layers, width 32
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for typed, saved in (("--n_layer=3", "n_layer=2"), ("--n_embd=64", "n_embd=32"), ("--bias=False", "bias=True"),
                         ("--block_size=64", "block_size=32"), ("--block_size=16", "block_size=32"),
                         (f"--n_layer={train.n_layer}", "n_layer=2")):  # typed, though it is train.py's default
        with pytest.raises(UserError, match=rf"^{typed} differs from the checkpoint in {out} \({saved}\), and a "
                                            rf"resumed run keeps the checkpoint's shape; drop --"):
            train.main(tiny(char_data, out, "--max_iters=4", "--init_from=resume", typed))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # a setting left at train.py's default is not a choice: the checkpoint's shape trains, and is what is saved
    args = [a for a in tiny(char_data, out, "--max_iters=4", "--init_from=resume") if not a.startswith("--n_layer")]
    assert train.main(args) == 0
    resumed = load_checkpoint(out / "ckpt.pt")
    assert resumed.model_config["n_layer"] == resumed.settings["n_layer"] == 2 != train.n_layer


def test_a_shape_from_a_config_file_gives_way_to_the_checkpoint_with_a_note_saying_where_it_came_from(
        char_data, tmp_path, capsys):
    """nanoGPT's habit: resuming with the config file that trained another shape (nanoGPT's CPU overrides on the
    command line, say) trains the checkpoint's shape; the note names the file, nothing typed is blamed."""
    out, config = tmp_path / "run", tmp_path / "bigger.py"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0  # 2 layers
    config.write_text("n_layer = 6\nn_embd = 384\n")
    args = [a for a in tiny(char_data, out, "--max_iters=4", "--init_from=resume")
            if not a.startswith(("--n_layer", "--n_embd"))]
    assert train.main([str(config)] + args) == 0
    err = capsys.readouterr().err
    assert f"note: n_layer=6 from {config} is not the checkpoint's (n_layer=2); the resumed run keeps the " \
           f"checkpoint's shape." in err and f"n_embd=384 from {config}" in err
    assert load_checkpoint(out / "ckpt.pt").model_config["n_layer"] == 2
    with pytest.raises(UserError, match=r"^--n_layer=6 differs"):  # the same value typed is a choice: refused
        train.main([str(config)] + args + ["--n_layer=6"])


def test_a_sharded_resume_keeps_the_checkpoints_block_size_too(char_data, tmp_path):
    out = tmp_path / "run"
    assert train.main(tiny(char_data, out, "--max_iters=2", "--checkpoint_format=sharded")) == 0
    with pytest.raises(UserError, match=r"^--block_size=1024 differs from the checkpoint"):  # train.py's default
        train.main(tiny(char_data, out, "--max_iters=4", "--init_from=resume", "--checkpoint_format=sharded",
                        "--block_size=1024"))
    args = [a for a in tiny(char_data, out, "--max_iters=4", "--init_from=resume", "--checkpoint_format=sharded")
            if not a.startswith("--block_size")]  # left at the default: the checkpoint's 32 trains on
    assert train.main(args) == 0
    assert load_checkpoint(out / "ckpt.pt").model_config["block_size"] == 32


def test_a_resume_on_a_dataset_whose_ids_mean_other_characters_is_refused(char_data, tmp_path):
    out, other = tmp_path / "run", tmp_path / "other"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0
    shutil.copytree(char_data, other)
    meta = json.loads((other / "meta.json").read_text())
    meta["chars"] = meta["chars"][::-1]  # the same size, re-mapped
    (other / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"this dataset's meta.json maps its ids to other text than the dataset the "
                                        r"checkpoint in .* was trained on \(char, \d+ characters from '.*' against"):
        train.main(tiny(other, out, "--max_iters=4", "--init_from=resume"))


# -- token files, and outputs named wrong ---------------------------------------------------------------------

@pytest.mark.parametrize("size", [4097, 0, 10], ids=["odd-bytes", "empty", "fewer-than-a-window"])
def test_token_files_cut_short_are_one_sentence_wherever_they_are_read(char_data, tmp_path, size):
    from benchmarks import bench_masks
    data, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(char_data, data)
    assert train.main(tiny(data, out, "--max_iters=2")) == 0
    for split in ("train", "val"):
        (data / f"{split}.bin").write_bytes(b"\x01" * size)
    sentence = (r"\.bin is [\d,]+ bytes, not a whole number of uint16 tokens" if size % 2 else
                r"\.bin has \d+ tokens, fewer than the [\d,]+ needed") + \
        "; it is truncated or not a token file - prepare the dataset again"
    with pytest.raises(UserError, match=sentence):  # sample.py --compare's held-out text
        sample.main([f"--out_dir={out}", "--compare=manual", "--num_samples=1", "--max_new_tokens=4",
                     "--device=cpu", "--dtype=float32"])
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "eot_token": 0}))
    with pytest.raises(UserError, match=sentence):  # bench.py --doc_data's documents
        bench_masks.block_documents(str(data), 0, 2, 32, seed=0)
    trains = r"fewer than the 33 needed; block_size=32 takes 33 a sequence: use a smaller block_size"
    with pytest.raises(UserError, match=sentence if size % 2 else trains):  # train.py's own check
        train.main(tiny(data, tmp_path / "again", "--max_iters=2"))


def test_sample_refuses_a_json_folder_and_int8_without_torchao_before_any_sampling(trained_char_run, tmp_path,
                                                                                  monkeypatch, capsys):
    monkeypatch.setattr(sample, "load_model", lambda *a: pytest.fail("loaded a model before refusing"))
    with pytest.raises(UserError, match=rf"^json {tmp_path} is a folder; pass --json= a file path, such as "):
        sample.main([f"--out_dir={trained_char_run}", f"--json={tmp_path}", "--device=cpu"])
    monkeypatch.setitem(sys.modules, "torchao", None)  # not installed
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(UserError, match=r"^--quantize=int8 needs torchao; pip install torchao\.$"):
        sample.main([f"--out_dir={trained_char_run}", "--compare=manual,sdpa", "--quantize=int8", "--device=cpu",
                     f"--json={tmp_path / 'report.json'}"])
    assert capsys.readouterr().out == "" and not (tmp_path / "report.json").exists()


def test_export_hf_says_a_broken_transformers_in_one_line_and_exports_through_a_symlink(trained_char_run, tmp_path):
    import export_hf
    broken = tmp_path / "site" / "transformers"
    broken.mkdir(parents=True)  # installed, but its import fails as a mismatched dependency makes it fail
    (broken / "__init__.py").write_text("raise AttributeError(\"module 'numpy' has no attribute 'float_'\")\n")
    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    done = subprocess.run([sys.executable, "export_hf.py", f"--out_dir={trained_char_run}", f"--hf_dir={link}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{broken.parent}{os.pathsep}{REPO}"})
    assert done.returncode == 2 and done.stderr == (
        "error: exporting needs transformers, which cannot be imported here (AttributeError: module 'numpy' has no "
        "attribute 'float_'); pip install -r requirements.txt.\n")
    assert export_hf.main([f"--out_dir={trained_char_run}", f"--hf_dir={link}"]) == 0  # into the folder it names
    assert link.is_symlink() and (link / "config.json").is_file() and (target / "model.safetensors").is_file()


# -- clusters ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, own, printed", [
    ({}, False, "error: the same on every rank"),  # one process
    ({"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, False, "error: the same on every rank"),  # a console each
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0"}, False, "error: the same on every rank"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1"}, False, None),  # rank 0 says it
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "9", "LOCAL_RANK": "1"}, True, "error: rank 9: the same on every rank"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "8", "LOCAL_RANK": "0"}, False, None),  # another node's: rank 0 says it
], ids=["one-process", "rank-without-torchrun", "rank-0", "rank-1", "own", "second-node"])
def test_under_torchrun_rank_0_prints_an_error_and_another_rank_only_one_of_its_rank(monkeypatch, env, own, printed):
    for key in ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert errors.error_line(UserError("the same on every rank", own_rank=own)) == printed


RANK_LOCAL = textwrap.dedent("""
    import os, sys, torch.distributed as dist
    from core import errors, runtime
    def main():
        rt = runtime.resolve_runtime("cpu", "float32", distributed=True)
        if sys.argv[1] == "rank-1-only" and rt.rank == 1:
            raise errors.UserError("data/x/train.bin is missing on this node", own_rank=True)
        if sys.argv[1] == "every-rank":
            raise errors.UserError("the same on every rank")
        dist.barrier()  # rank 0 waits here for a rank that never comes
    runtime.run_main(main)
""")


@pytest.mark.slow
@pytest.mark.parametrize("case, said", [("rank-1-only", "error: rank 1: data/x/train.bin is missing on this node"),
                                        ("every-rank", "error: the same on every rank")])
def test_under_torchrun_an_error_is_printed_once_by_the_rank_it_concerns_and_the_run_ends_in_seconds(tmp_path,
                                                                                                      case, said):
    script = tmp_path / "probe.py"
    script.write_text(RANK_LOCAL)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), case], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode != 0 and time.perf_counter() - started < 60
    errors_said = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]
    assert errors_said == [said]


def test_local_ranks_beyond_the_gpus_refuse_each_in_their_own_name(monkeypatch):
    from core import distributed
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env = dict(RANK="3", LOCAL_RANK="3", WORLD_SIZE="4", MASTER_ADDR="localhost", MASTER_PORT="1")
    monkeypatch.setattr(os, "environ", env)
    with pytest.raises(UserError, match=r"^LOCAL_RANK=3 has no GPU of its own: this node shows 2; pass torchrun "
                                        r"--nproc_per_node= at most that many\.$") as refused:
        distributed.join("cuda:0")
    assert refused.value.own_rank


def test_several_mig_slices_are_narrowed_to_one_per_rank_and_their_mfu_is_labelled():
    from core import distributed, flops
    slices = "MIG-aaaa,MIG-bbbb,MIG-cccc"
    env = {"CUDA_VISIBLE_DEVICES": slices, "LOCAL_RANK": "0"}
    assert distributed.one_mig_slice_per_rank(env).startswith("CUDA_VISIBLE_DEVICES names 3 MIG slices")
    assert env["CUDA_VISIBLE_DEVICES"] == slices  # local rank 0's is already first
    env = {"CUDA_VISIBLE_DEVICES": slices, "LOCAL_RANK": "2"}
    assert distributed.one_mig_slice_per_rank(env) is None and env["CUDA_VISIBLE_DEVICES"].startswith("MIG-cccc,")
    with pytest.raises(UserError, match="LOCAL_RANK=3 has no MIG slice of its own"):
        distributed.one_mig_slice_per_rank({"CUDA_VISIBLE_DEVICES": slices, "LOCAL_RANK": "3"})
    for plain in ("0,1", "MIG-aaaa", ""):  # GPUs, or one slice: left as they are
        assert distributed.one_mig_slice_per_rank({"CUDA_VISIBLE_DEVICES": plain, "LOCAL_RANK": "1"}) is None
    mig = SimpleNamespace(is_cuda=True, name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", dtype="bfloat16")
    assert flops.peak_line(mig, None).startswith("mfu not shown: no datasheet peak for NVIDIA H100 80GB HBM3 MIG")
    whole = SimpleNamespace(is_cuda=True, name="NVIDIA H100 80GB HBM3", dtype="bfloat16")
    assert flops.peak_line(whole, 989.4e12) == ("mfu against the datasheet peak of the NVIDIA H100 80GB HBM3, "
                                               "989.4 TFLOP/s in bfloat16")


# -- damaged or older checkpoints --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_checkpoint(char_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0
    return out / "ckpt.pt"


def damaged(contents: dict, kind: str) -> dict:
    if kind == "nonsense size":
        contents["model_config"]["n_layer"] = -1
    elif kind == "config against weights":
        contents["model_config"]["n_layer"] = 3  # the weights hold 2 layers
    elif kind == "optimizer against weights":
        name = next(iter(contents["optimizer"]["state"]))
        contents["optimizer"]["state"][name]["exp_avg"] = torch.zeros(7)
    return contents


@pytest.mark.parametrize("kind, sentence", [
    ("nonsense size", r"model_config is not a model this version can build \(n_layer must be at least 1, "
                      r"got -1\); restore it from a copy or train again\.$"),
    ("config against weights", r"weights do not fit its model_config \(3 layers of width 32; Missing key\(s\) in "
                               r"state_dict: \"transformer\.h\.2\.\S+\", .*\.\.\.\); restore it"),
    ("optimizer against weights", r"optimizer state does not fit its model \(\S+ exp_avg is not a parameter of that "
                                  r"shape\); restore it"),
])
def test_a_damaged_checkpoint_is_called_damaged_in_one_sentence_by_train_sample_and_export(
        one_checkpoint, char_data, tmp_path, kind, sentence):
    import export_hf
    out = tmp_path / "run"
    out.mkdir()
    torch.save(damaged(torch.load(one_checkpoint, weights_only=True), kind), out / "ckpt.pt")
    before = (out / "ckpt.pt").read_bytes()
    calls = [lambda: train.main(tiny(char_data, out, "--max_iters=4", "--init_from=resume"))]
    if kind != "optimizer against weights":  # sample and export read the weights only
        calls += [lambda: sample.main([f"--out_dir={out}", "--max_new_tokens=2", "--num_samples=1"]),
                  lambda: export_hf.main([f"--out_dir={out}", f"--hf_dir={tmp_path / 'hf'}"])]
    for call in calls:
        with pytest.raises(UserError, match=rf"^{out / 'ckpt.pt'} is damaged: its {sentence}"):
            call()
    assert (out / "ckpt.pt").read_bytes() == before and not (tmp_path / "hf").exists()


def test_a_checkpoint_of_an_attention_this_version_lacks_is_read_through_sdpa_with_a_note(
        one_checkpoint, char_data, tmp_path, capsys):
    """Every implementation computes the same attention: a name an older or newer version had does not make the
    weights unreadable (export, where attention does not matter, included)."""
    import export_hf
    out = tmp_path / "run"
    out.mkdir()
    contents = torch.load(one_checkpoint, weights_only=True)
    contents["model_config"]["attn"] = contents["settings"]["attn"] = "ring"
    torch.save(contents, out / "ckpt.pt")
    assert export_hf.main([f"--out_dir={out}", f"--hf_dir={tmp_path / 'hf'}"]) == 0
    assert "note: the checkpoint was trained with attn='ring', which this version does not have; it is read " \
           "through attn='sdpa' (--attn= picks another)." in capsys.readouterr().err
    assert sample.main([f"--out_dir={out}", "--max_new_tokens=2", "--num_samples=1", "--attn=manual"]) == 0
    assert "note: the checkpoint" not in capsys.readouterr().err  # --attn= typed: nothing to say
    assert train.main(tiny(char_data, out, "--max_iters=4", "--init_from=resume", "--attn=sdpa")) == 0


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "stopped by SIGTERM")], ids=["ctrl-c", "sigterm"])
def test_a_signal_while_a_sharded_step_is_written_reads_as_the_signal_not_a_full_disk(char_data, tmp_path,
                                                                                      monkeypatch, capfd, sig, code,
                                                                                      said):
    """DCP writes each tensor through torch.save into a Python stream; a signal raised there came out as 'unexpected
    pos' (a full disk, said the sentence). A scheduler's preemption is a preemption: its exit code and the resume."""
    from torch.distributed.checkpoint import filesystem
    out = tmp_path / "run"
    assert train.main(tiny(char_data, out, "--max_iters=2", "--checkpoint_format=sharded")) == 0
    kept = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "metrics.jsonl"}
    capfd.readouterr()
    real, items = filesystem._write_item, []

    class Signalling:  # the step file's stream: the signal lands inside torch.save's write of a tensor's bytes
        def __init__(self, stream):
            self.stream = stream

        def write(self, data):
            items.append(len(data))
            if len(items) == 3:
                os.kill(os.getpid(), sig)
            return self.stream.write(data)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    def signalled(transforms, stream, *args, **kwargs):
        return real(transforms, Signalling(stream), *args, **kwargs)
    monkeypatch.setattr(filesystem, "_write_item", signalled)
    resume = tiny(char_data, out, "--max_iters=4", "--init_from=resume", "--checkpoint_format=sharded")
    assert errors.exit_code(lambda: train.main(resume)) == code
    assert len(items) > 3  # nothing raised inside DCP's write: the step was written through, then dropped
    err = capfd.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and "disk is full" not in "\n".join(err)
    assert err[-2].startswith("stopped at iter 4; the checkpoint kept in") and err[-1] == said
    now = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "metrics.jsonl"}
    assert now == kept  # the half-written step removed, the pointer still on step 2
    monkeypatch.setattr(filesystem, "_write_item", real)
    assert train.main(resume) == 0  # the resume the hint names


@pytest.mark.parametrize("script", ["train.py", "sample.py", "bench.py", "export_hf.py",
                                    "data/shakespeare_char/prepare.py"])
def test_ctrl_c_while_a_script_is_still_importing_ends_it_without_a_traceback(script, tmp_path):
    """torch takes seconds to import on a cold machine: a Ctrl-C then ends the script as it would end `sleep`,
    quietly. Here torch and numpy are stand-ins that take as long as the test needs (the first heavy imports)."""
    for name in ("torch", "numpy"):
        (tmp_path / f"{name}.py").write_text("import sys, time\nprint('importing', file=sys.stderr, flush=True)\n"
                                             "time.sleep(60)\n")
    process = subprocess.Popen([sys.executable, script, "--help"], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert process.stderr.readline().strip() == "importing"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGINT and "Traceback" not in err, err[-2000:]


# -- torchrun ranks that fail apart --------------------------------------------------------------------------------

APART = textwrap.dedent("""
    import os, runpy, signal, sys
    sys.path.insert(0, os.getcwd())
    case, rank = sys.argv.pop(1), os.environ["RANK"]
    if case == "data-missing-on-rank-1" and rank == "1":  # the same settings, a node whose folder is not there
        from core.errors import UserError
        from engine import startup
        def missing(data_dir, name):
            raise UserError(f"data_dir {data_dir} does not exist; pass --data_dir= the folder that holds train.bin "
                            f"and val.bin.")
        startup.dataset_dir = missing
    if case == "rank-0-killed" and rank == "0":  # SIGKILL (the OOM killer, a scheduler) at its 5th step
        from engine.trainer import Trainer
        step, steps = Trainer.step, []
        def dying(self, batches):
            steps.append(1)
            if len(steps) == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            return step(self, batches)
        Trainer.step = dying
    if case == "rank-1-killed-at-start" and rank == "1":  # killed (out of memory, say) before the ranks compare
        from core import distributed
        def dying(settings, problems):
            os.kill(os.getpid(), signal.SIGKILL)
        distributed.agree = dying
    sys.argv = ["train.py", *sys.argv[1:]]
    runpy.run_path("train.py", run_name="__main__")
""")


@pytest.mark.slow
@pytest.mark.parametrize("case, said", [
    ("max-iters-per-rank", "error: the ranks were given different settings: max_iters is rank 0: 4, rank 1: 6; give "
                           "every rank the same config file and command line."),
    ("data-missing-on-rank-1", "error: rank 1: data_dir {data} does not exist; pass --data_dir= the folder that "
                               "holds train.bin and val.bin."),
    ("rank-0-killed", "error: rank 1: another rank stopped mid-run ("),
    ("rank-1-killed-at-start", "error: another rank stopped before the ranks compared their settings ("),
    ("nccl-on-a-cpu", "error: --backend=nccl needs CUDA GPUs and this run's device is cpu; pass --backend=gloo"),
])
def test_ranks_that_fail_apart_are_one_error_line_and_no_gloo_traceback(char_data, tmp_path, case, said):
    """A config file that differs on one node, a folder one node lacks, a rank killed mid-run: one `error:` line,
    naming the setting and the ranks, or the rank and where the checkpoint is; then torchrun's own report."""
    script, config = tmp_path / "apart.py", tmp_path / "per_rank.py"
    script.write_text(APART)
    config.write_text("import os\nmax_iters = 4 if os.environ['RANK'] == '0' else 6\n")
    out = tmp_path / "out"
    args = [case, *TINY, f"--data_dir={char_data}", f"--out_dir={out}", "--gradient_accumulation_steps=2",
            "--eval_interval=2", "--checkpoint_format=sharded"]
    args = args[:1] + [str(config)] + args[1:] if case == "max-iters-per-rank" else args + ["--max_iters=40"]
    args += ["--backend=nccl"] if case == "nccl-on-a-cpu" else []
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = done.stdout + done.stderr
    errors_said = [line for line in output.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and len(errors_said) == 1, output[-3000:]
    assert errors_said[0].startswith(said.format(data=char_data)) and "[rank1]: Traceback" not in output
    if case == "rank-0-killed":  # the checkpoint it names resumes
        assert errors_said[0].endswith("--init_from=resume") and "the checkpoint kept in" in errors_said[0]
        assert train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--init_from=resume",
                                  "--max_iters=6", "--gradient_accumulation_steps=2"]) == 0
    else:
        assert not out.exists()  # refused before anything was written


@pytest.mark.slow
def test_ranks_told_to_resume_and_to_start_afresh_stop_with_one_line_not_a_hang(char_data, tmp_path):
    """Rank 0 resumes (it locks out_dir and reads the checkpoint), rank 1 starts a new run there: no collective runs
    before the ranks exchange their settings and problems, so the mismatch is one error line, never two ranks
    waiting in different collectives."""
    out = tmp_path / "out"
    assert train.main(tiny(char_data, out, "--max_iters=2")) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    script, config = tmp_path / "apart.py", tmp_path / "per_rank.py"
    script.write_text(APART)
    config.write_text("import os\ninit_from = 'resume' if os.environ['RANK'] == '0' else 'scratch'\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), "same-settings", str(config), *TINY, f"--data_dir={char_data}",
                           f"--out_dir={out}", "--gradient_accumulation_steps=2", "--max_iters=4"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = done.stdout + done.stderr
    errors_said = [line for line in output.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and len(errors_said) == 1, output[-3000:]
    assert errors_said[0].startswith(f"error: rank 1: {out} already holds another run's checkpoint")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("rank, printed", [("0", "interrupted\n"), ("1", "")])
def test_under_torchrun_ctrl_c_is_said_once_by_rank_0(monkeypatch, capsys, rank, printed):
    """torchrun hands Ctrl-C to every rank: one `interrupted` line, not one a rank."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", rank)

    def stopped():
        raise KeyboardInterrupt
    assert errors.exit_code(stopped) == 130 and capsys.readouterr().err == printed


PREPARE_INTERRUPTED = textwrap.dedent("""
    import os, runpy, signal, sys
    n, sig, times = int(sys.argv.pop(1)), int(sys.argv.pop(1)), int(sys.argv.pop(1))
    replace, calls = os.replace, []
    def interrupted(src, dst):  # the signal (sent `times` times) lands just before the n-th of the three renames
        calls.append(dst)
        if len(calls) == n:
            for _ in range(times):
                os.kill(os.getpid(), sig)
        return replace(src, dst)
    os.replace = interrupted
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "stopped by SIGTERM")], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("times", [1, 2])
def test_a_signal_while_prepare_replaces_another_texts_data_leaves_one_whole_set_and_one_line(tmp_path, sig, code,
                                                                                               said, n, times):
    """One signal, or two at once (a second Ctrl-C ends a process at once elsewhere), before any of the three
    renames: train.bin, val.bin and meta.json are all the new text's, and one line says why the run stopped."""
    out = tmp_path / "data"
    (tmp_path / "old.txt").write_text("an old text, other letters: xyz\n" * 200)
    (tmp_path / "new.txt").write_text("To be, or not to be, that is the question.\n" * 200)
    script = str(REPO / "data" / "shakespeare_char" / "prepare.py")
    subprocess.run([sys.executable, script, f"--input={tmp_path / 'old.txt'}", f"--out_dir={out}"], check=True,
                   capture_output=True)
    (tmp_path / "wrap.py").write_text(PREPARE_INTERRUPTED)
    done = subprocess.run([sys.executable, str(tmp_path / "wrap.py"), str(n), str(int(sig)), str(times), script,
                           f"--input={tmp_path / 'new.txt'}", f"--out_dir={out}", "--overwrite=True"],
                          capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == code and "Traceback" not in done.stderr and done.stderr.strip().splitlines()[-1] == said
    meta = json.loads((out / "meta.json").read_text())
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    line = "To be, or not to be, that is the question.\n"
    assert "".join(meta["chars"][i] for i in ids[:len(line)]) == line  # the new text's files, all three
    assert not list(out.glob("*.tmp"))
