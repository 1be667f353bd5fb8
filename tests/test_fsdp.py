"""parallel=fsdp: FSDP2 trains like DDP, shards the parameters, and writes checkpoints any run can load."""

import subprocess
import sys

import pytest
import torch

from conftest import RANK_PROBE, REPO, TINY, metrics, run_train

pytestmark = pytest.mark.slow  # every test here launches two processes
STEPS = TINY + ["--gradient_accumulation_steps=2", "--eval_interval=3"]


def test_fsdp_and_ddp_give_the_same_losses_from_the_same_seed(char_data, tmp_path):
    args = STEPS + [f"--data_dir={char_data}", "--max_iters=6"]
    run_train(args + ["--parallel=ddp", f"--out_dir={tmp_path / 'ddp'}"], nproc=2)
    run_train(args + ["--parallel=fsdp", f"--out_dir={tmp_path / 'fsdp'}"], nproc=2)
    ddp, fsdp = metrics(tmp_path / "ddp", "train/loss"), metrics(tmp_path / "fsdp", "train/loss")
    assert sorted(ddp) == list(range(1, 7))
    for it, loss in ddp.items():
        assert abs(fsdp[it] - loss) <= 1e-5, (it, loss, fsdp[it])


def test_each_rank_stores_only_its_shard(char_data, tmp_path):
    result = run_train(STEPS + [f"--data_dir={char_data}", "--max_iters=1", "--parallel=fsdp",
                                f"--out_dir={tmp_path}"], nproc=2, script=RANK_PROBE)
    line = next(l for l in result.stdout.splitlines() if l.startswith("parameter elements per rank"))
    per_rank, total = line.split(":")[1].split(" of ")
    rank0, rank1 = map(int, per_rank.split())
    assert rank0 + rank1 == int(total)
    assert abs(rank0 - int(total) / 2) <= 0.05 * int(total)


def test_fsdp_checkpoint_resumes_exactly_and_loads_anywhere(char_data, tmp_path):
    args = STEPS + [f"--data_dir={char_data}", "--parallel=fsdp"]
    run_train(args + ["--max_iters=6", f"--out_dir={tmp_path / 'straight'}"], nproc=2)
    run_train(args + ["--max_iters=3", f"--out_dir={tmp_path / 'stopped'}"], nproc=2)
    checkpoint = (tmp_path / "stopped" / "ckpt.pt").read_bytes()
    run_train(args + ["--max_iters=6", "--init_from=resume", f"--out_dir={tmp_path / 'stopped'}"], nproc=2)
    straight, resumed = metrics(tmp_path / "straight", "train/loss"), metrics(tmp_path / "stopped", "train/loss")
    assert [straight[i] for i in range(4, 7)] == [resumed[i] for i in range(4, 7)]

    # the same iteration-3 checkpoint resumes under DDP, and under a single process
    for name, nproc, parallel in (("ddp", 2, "ddp"), ("single", 1, "ddp")):
        out = tmp_path / name
        out.mkdir()
        (out / "ckpt.pt").write_bytes(checkpoint)
        run_train(args[:-1] + [f"--parallel={parallel}", "--max_iters=4", "--init_from=resume", f"--out_dir={out}"],
                  nproc=nproc)
        assert abs(metrics(out, "train/loss")[4] - straight[4]) <= 1e-5

    sample = subprocess.run([sys.executable, str(REPO / "sample.py"), f"--out_dir={tmp_path / 'stopped'}",
                             "--device=cpu", "--num_samples=1", "--max_new_tokens=20", "--start=To be"],
                            capture_output=True, text=True, timeout=300)
    assert sample.returncode == 0, sample.stderr
    assert "To be" in sample.stdout
    assert torch.load(tmp_path / "stopped" / "ckpt.pt", weights_only=True)["iter_num"] == 6


def test_fsdp_trains_with_compile_per_block(char_data, tmp_path):
    run_train(STEPS + [f"--data_dir={char_data}", "--max_iters=3", "--parallel=fsdp", "--compile=True",
                       f"--out_dir={tmp_path}"], nproc=2)
    losses = metrics(tmp_path, "train/loss")
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1]
