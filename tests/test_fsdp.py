"""parallel=fsdp: FSDP2 trains like DDP, shards the parameters, and writes checkpoints any run can load. The 2-rank
runs come from conftest.two_rank_runs (one torchrun launch for the suite)."""

import pytest
import torch

import sample
import train
from conftest import TWO_RANKS, metrics

pytestmark = pytest.mark.slow  # every test here reads runs of two processes


def test_fsdp_and_ddp_give_the_same_losses_from_the_same_seed(two_rank_runs):
    ddp, fsdp = two_rank_runs.losses("ddp"), two_rank_runs.losses("fsdp")
    assert sorted(ddp) == list(range(1, 7))
    for it, loss in ddp.items():
        assert abs(fsdp[it] - loss) <= 1e-5, (it, loss, fsdp[it])


def test_each_rank_stores_only_its_shard(two_rank_runs):
    fsdp = two_rank_runs.report["runs"]["fsdp"]
    (rank0, rank1), total = fsdp["elements"], fsdp["total"]
    assert rank0 + rank1 == total
    assert abs(rank0 - total / 2) <= 0.05 * total


def test_fsdp_checkpoint_resumes_exactly_and_loads_anywhere(char_data, tmp_path, two_rank_runs, capsys):
    straight, resumed = two_rank_runs.losses("fsdp"), two_rank_runs.losses("fsdp_resumed")
    assert sorted(resumed) == list(range(1, 7))  # three steps, then three more from the checkpoint at step 3
    assert [straight[i] for i in range(4, 7)] == [resumed[i] for i in range(4, 7)]

    # the same iteration-3 checkpoint (a full state dict) resumes in a single process, without FSDP
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "ckpt.pt").write_bytes((two_rank_runs.out / "fsdp_at_3" / "ckpt.pt").read_bytes())
    train.main(TWO_RANKS + [f"--data_dir={char_data}", "--max_iters=4", "--init_from=resume",
                            f"--out_dir={tmp_path / 'single'}"])
    assert abs(metrics(tmp_path / "single", "train/step_loss")[4] - straight[4]) <= 1e-5

    out = two_rank_runs.out / "fsdp_resumed"
    assert sample.main([f"--out_dir={out}", "--device=cpu", "--num_samples=1", "--max_new_tokens=20",
                        "--start=To be"]) == 0
    assert "To be" in capsys.readouterr().out
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 6


def test_fsdp_compiled_per_block_trains_as_the_eager_run_does(two_rank_runs):
    eager, compiled = two_rank_runs.losses("fsdp"), two_rank_runs.losses("fsdp_compiled")
    assert sorted(compiled) == [1, 2, 3]
    for it, loss in compiled.items():  # inductor fuses and reorders fp32 arithmetic: close, not bit-equal
        assert abs(eager[it] - loss) <= 1e-4, (it, loss, eager[it])
