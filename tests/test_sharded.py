"""checkpoint_format='sharded': every rank writes its own shards through torch.distributed.checkpoint into a folder
per step, `latest` names the newest whole one, a resume is exact, every reader reads it, and no fault loses the
previous step. The runs of several ranks (exact resume on 2, resharding 2 -> 1 and 2 -> 3) are at the end."""

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

import export_hf
import sample
import train
from conftest import REPO, SHARDED, TINY, TWO_RANKS, FullDisk, metrics, run_train
from engine.reader import load_checkpoint
from core.errors import UserError


def tiny(char_data, out, *args) -> None:
    train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--eval_interval=2", *args])


def steps(out) -> list[str]:
    return sorted(p.name for p in out.glob("step-*"))


def losses(out) -> dict[int, float]:
    return metrics(out, "train/step_loss")


@pytest.fixture(scope="module")
def straight(char_data_session, tmp_path_factory):
    """Six steps in one single-file run: the losses every interrupted run must give again."""
    out = tmp_path_factory.mktemp("straight")
    tiny(char_data_session, out, "--max_iters=6")
    return out


@pytest.mark.parametrize("async_save", [False, True])
def test_a_sharded_run_keeps_the_newest_steps_and_resumes_exactly(char_data, tmp_path, straight, async_save):
    out = tmp_path / "run"
    tiny(char_data, out, "--max_iters=4", f"--async_save={async_save}", *SHARDED)
    assert steps(out) == ["step-000002", "step-000004"] and (out / "latest").read_text() == "step-000004"
    assert not (out / "ckpt.pt").exists()
    tiny(char_data, out, "--max_iters=6", "--init_from=resume", f"--async_save={async_save}", *SHARDED)
    assert [losses(out)[i] for i in (5, 6)] == [losses(straight)[i] for i in (5, 6)]  # bit for bit
    assert steps(out) == ["step-000004", "step-000006"]  # keep_checkpoints=2
    tiny(char_data, out, "--max_iters=8", "--init_from=resume", "--keep_checkpoints=1", *SHARDED)
    assert steps(out) == ["step-000008"]


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_readers_read_a_sharded_checkpoint_as_the_single_file_of_the_same_run(char_data, tmp_path, straight, capsys):
    out = tmp_path / "out"  # the folder docs/training.md's conversion names
    tiny(char_data, out, "--max_iters=6", *SHARDED)
    single, sharded = load_checkpoint(straight / "ckpt.pt"), load_checkpoint(out / "ckpt.pt")
    assert sharded.iter_num == single.iter_num == 6 and sharded.model_config == single.model_config
    assert sharded.model.keys() == single.model.keys()
    assert all(torch.equal(sharded.model[k], single.model[k]) for k in single.model)
    for_training = load_checkpoint(out / "ckpt.pt", for_training=True)  # its tensors stay put: read in place
    assert for_training.model is None and for_training.shards == str(out / "step-000006")
    assert load_checkpoint(out / "step-000004").iter_num == 4  # a step folder named directly

    capsys.readouterr()
    assert sample.main([f"--out_dir={out}", "--device=cpu", "--num_samples=1", "--max_new_tokens=10",
                        "--start=To be", "--seed=1"]) == 0
    source, text = capsys.readouterr().out.split("\n")[:2]
    assert source.startswith(f"{out / 'step-000006'} (iter 6)")
    assert sample.main([f"--out_dir={straight}", "--device=cpu", "--num_samples=1", "--max_new_tokens=10",
                        "--start=To be", "--seed=1"]) == 0
    assert capsys.readouterr().out.split("\n")[1] == text  # the same weights: the same tokens
    assert sample.main([f"--out_dir={out}", "--device=cpu", "--compare=manual,sdpa", "--num_samples=1",
                        "--max_new_tokens=5",
                        "--start=To be"]) == 0
    assert "manual" in capsys.readouterr().out
    train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--init_from=resume", "--eval_only=True"])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("iter 6")
    assert export_hf.main([f"--out_dir={out}", f"--hf_dir={tmp_path / 'hf'}"]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()

    docs_line = next(line for line in (REPO / "docs" / "training.md").read_text().splitlines() if "single.pt" in line)
    conversion = re.search(r"`(python -c [^`]+)`", docs_line)[1]  # as written there, run beside out/
    program, *args = shlex.split(conversion)  # this interpreter for `python`, as the README's tests run theirs
    subprocess.run([sys.executable, *args], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    converted = load_checkpoint(out / "single.pt")
    assert converted.iter_num == 6 and all(torch.equal(converted.model[k], single.model[k]) for k in single.model)
    assert converted.optimizer is None  # the weights and settings: the optimizer state stays in the shards


def test_switching_format_on_resume_reads_the_newer_checkpoint(char_data, tmp_path, straight):
    out = tmp_path / "run"
    tiny(char_data, out, "--max_iters=2")  # ckpt.pt at step 2
    tiny(char_data, out, "--max_iters=4", "--init_from=resume", *SHARDED)  # read ckpt.pt, wrote step-000004
    assert load_checkpoint(out / "ckpt.pt").iter_num == 4  # the pointer is newer than ckpt.pt
    tiny(char_data, out, "--max_iters=6", "--init_from=resume")  # and back: ckpt.pt at 6 is the newer
    assert load_checkpoint(out / "ckpt.pt").iter_num == 6
    assert [losses(out)[i] for i in range(1, 7)] == [losses(straight)[i] for i in range(1, 7)]


def test_a_half_written_step_is_never_read_and_goes_at_the_next_save(char_data, tmp_path, straight):
    out = tmp_path / "run"
    tiny(char_data, out, "--max_iters=4", *SHARDED)
    half = out / "step-000010"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"half a shard")  # no .metadata: its save never finished
    assert load_checkpoint(out / "ckpt.pt").iter_num == 4
    with pytest.raises(UserError, match=r"step-000010 has no \.metadata \(its save never finished"):
        load_checkpoint(half)
    tiny(char_data, out, "--max_iters=6", "--init_from=resume", *SHARDED)
    assert steps(out) == ["step-000004", "step-000006"]
    assert [losses(out)[i] for i in (5, 6)] == [losses(straight)[i] for i in (5, 6)]


def test_another_runs_sharded_checkpoint_is_protected_until_overwrite(char_data, tmp_path):
    out = tmp_path / "run"
    tiny(char_data, out, "--max_iters=4", *SHARDED)
    val = metrics(out, "val/loss")[4]
    with pytest.raises(UserError) as refused:
        tiny(char_data, out, "--max_iters=2", *SHARDED)
    assert str(refused.value) == (f"{out} already holds another run's checkpoint (iter 4, val loss {val:.3f}); "
                                  f"continue it with --init_from=resume, pass another --out_dir=, or replace it "
                                  f"with --overwrite=True.")
    assert steps(out) == ["step-000002", "step-000004"] and load_checkpoint(out / "ckpt.pt").iter_num == 4
    tiny(char_data, out, "--max_iters=2", "--overwrite=True", *SHARDED)  # replaces step 2, then drops step 4
    assert steps(out) == ["step-000002"] and load_checkpoint(out / "ckpt.pt").iter_num == 2


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_loses_no_step(char_data, tmp_path, monkeypatch, async_save):
    out = tmp_path / "run"
    tiny(char_data, out, "--max_iters=2", *SHARDED)
    from torch.distributed.checkpoint.filesystem import FileSystem
    create_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def full_disk(self, path, mode):  # every shard's write fails as on a full disk ("No space left on device")
        with create_stream(self, path, mode) as stream:
            yield FullDisk(stream) if str(path).endswith(".distcp") and "w" in mode else stream
    monkeypatch.setattr(FileSystem, "create_stream", full_disk)
    with pytest.raises(UserError, match=r"could not write the checkpoint .*step-000004 \(rank 0: No space left on "
                                        r"device\); the previous one .* is kept"):
        tiny(char_data, out, "--max_iters=4", "--init_from=resume", f"--async_save={async_save}", *SHARDED)
    assert (out / "latest").read_text() == "step-000002" and load_checkpoint(out / "ckpt.pt").iter_num == 2


# A run killed (SIGKILL, as the OOM killer or a scheduler does) while its step-4 shards are half written.
KILLED_MID_SAVE = textwrap.dedent("""
    import os, signal, sys
    from torch.distributed.checkpoint.filesystem import FileSystem
    import train
    create_stream = FileSystem.create_stream
    def dying(self, path, mode):
        if "step-000004" in str(path) and str(path).endswith(".distcp") and "w" in mode:
            with open(path, "wb") as half:
                half.write(b"half a shard")
            os.kill(os.getpid(), signal.SIGKILL)
        return create_stream(self, path, mode)
    FileSystem.create_stream = dying
    train.main(sys.argv[1:])
""")


@pytest.fixture(scope="module")
def straight_launched(char_data_session, tmp_path_factory):
    """The straight six steps as a launch of train.py, for runs compared across launches: a process's own thread
    count (changed in-process by other tests' settings) changes fp32 sums in the last bits."""
    out = tmp_path_factory.mktemp("straight_launched")
    run_train(TINY + [f"--data_dir={char_data_session}", f"--out_dir={out}", "--eval_interval=2", "--max_iters=6"])
    return out


@pytest.mark.slow  # three launches of train.py (straight, killed, resumed): ~8 s each case
@pytest.mark.parametrize("async_save", [False, True])
def test_kill_9_during_a_save_keeps_the_previous_step_and_the_resume_exact(char_data, tmp_path, straight_launched,
                                                                          async_save):
    out = tmp_path / "run"
    args = TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--eval_interval=2", *SHARDED,
                   f"--async_save={async_save}"]
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, *args, "--max_iters=6"], cwd=REPO,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / "latest").read_text() == "step-000002" and not (out / "step-000004" / ".metadata").exists()
    assert load_checkpoint(out / "ckpt.pt", for_training=True).iter_num == 2
    run_train(args + ["--max_iters=6", "--init_from=resume"])  # launched as the killed run was
    assert [losses(out)[i] for i in range(3, 7)] == [losses(straight_launched)[i] for i in range(3, 7)]
    assert steps(out) == ["step-000004", "step-000006"]


def test_async_save_without_sharded_format_is_one_sentence(char_data, tmp_path):
    with pytest.raises(UserError, match=r"^async_save=True writes sharded checkpoints only; add "
                                        r"--checkpoint_format=sharded\.$"):
        tiny(char_data, tmp_path / "run", "--max_iters=2", "--async_save=True")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


# -- several ranks (gloo): one torchrun launch for the 2-rank runs (conftest.two_rank_runs), one for 3 ranks -----

@pytest.mark.slow
def test_two_ranks_write_their_own_shards_and_resume_bit_for_bit(two_rank_runs):
    for name, straight_run in (("ddp_sharded", "ddp"), ("fsdp_async", "fsdp")):
        resumed, uninterrupted = two_rank_runs.losses(name), two_rank_runs.losses(straight_run)
        assert sorted(resumed) == list(range(1, 7))
        assert [resumed[i] for i in range(4, 7)] == [uninterrupted[i] for i in range(4, 7)], name
    step = two_rank_runs.out / "fsdp_async_at_3" / "step-000003"
    shards = sorted(step.glob("*.distcp"))
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
    # FSDP2: every weight and optimizer moment was written half by each rank, nothing gathered (DCP's index says
    # which file holds each piece)
    index = dcp.FileSystemReader(step).read_metadata()
    files_of = {}
    for piece, stored in index.storage_data.items():
        files_of.setdefault(piece.fqn, set()).add(stored.relative_path)
    tensors = [k for k in files_of if k.startswith(("model.", "optimizer.state."))  # not AdamW's step counts:
               and len(index.state_dict_metadata[k].size) > 0]                        # scalars, saved once
    assert len(tensors) > 40 and all(files_of[k] == {p.name for p in shards} for k in tensors)


@pytest.mark.slow
def test_a_fsdp_checkpoint_of_two_ranks_resumes_on_one_and_on_three(two_rank_runs, char_data, tmp_path):
    saved, uninterrupted = two_rank_runs.out / "fsdp6_sharded", two_rank_runs.losses("fsdp6")
    args = TWO_RANKS + SHARDED + [f"--data_dir={char_data}", "--gradient_accumulation_steps=6", "--init_from=resume"]
    for world_size in (1, 3):  # the same global batch: 6 micro-batches a step, split over the ranks
        out = tmp_path / f"on_{world_size}"
        shutil.copytree(saved / "step-000003", out / "step-000003")
        shutil.copy(saved / "latest", out / "latest")
        if world_size == 1:
            train.main(args + [f"--out_dir={out}"])
        else:
            run_train(args + ["--parallel=fsdp", f"--out_dir={out}"], nproc=world_size)
        resumed = losses(out)
        assert sorted(resumed) == [4, 5, 6]
        for i in (4, 5, 6):  # fp32 sums in another order: the noise of fp32, not a different run
            assert abs(resumed[i] - uninterrupted[i]) <= 1e-5, (world_size, i, resumed[i], uninterrupted[i])
