"""attn='auto' (attention/attn_auto.py): the chooser picks the fastest implementation that runs and is right, decided once
per workload and kept; no test asserts a speed (the timer is a stand-in where the pick matters)."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import sample
from model import IMPLEMENTATIONS
from attention import attn_auto
from attention.attn_auto import Workload
from core.runtime import Runtime
from model import GPTConfig
from core.errors import UserError

CPU = Runtime("cpu", "float32")
FAKE_MS = {"manual": 5.0, "sdpa_mask": 4.0, "sdpa": 2.0, "flash": 1.0, "math": 3.0, "flex": 0.5}


def workload(training=True, seq_len=64, **config) -> Workload:
    # head size 16 at length 64: the shapes conftest.runnable_on_cpu already asked attention_problem about
    cfg = GPTConfig(**{**dict(block_size=128, vocab_size=11, n_layer=1, n_head=2, n_embd=32), **config})
    return Workload.of(cfg, CPU, batch_size=2, seq_len=seq_len, training=training, compiled=False)


def fake_clock(monkeypatch, ms: dict) -> None:
    """The seconds each implementation 'takes', whatever it really does (its call still runs once, untimed, for
    the numerics check)."""
    monkeypatch.setattr(attn_auto, "time_candidate", lambda attn, call, rt: ms[attn] / 1e3)


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_the_fastest_implementation_that_runs_is_picked_and_the_refused_are_listed_with_their_reason(monkeypatch):
    fake_clock(monkeypatch, FAKE_MS)
    decision = attn_auto.measure(workload(), CPU, IMPLEMENTATIONS, budget_s=1.0)
    assert decision.pick == "flash"  # flex would be faster, but has no backward on a CPU
    rows = {r["attn"]: r for r in decision.rows}
    assert rows["flex"]["status"] == "refused" and "no backward pass on CPU" in rows["flex"]["reason"]
    assert rows["efficient"]["status"] == "refused" and "CUDA-only" in rows["efficient"]["reason"]
    assert {a for a, r in rows.items() if r["status"] == "ok"} == {"manual", "sdpa_mask", "sdpa", "flash", "math"}
    assert rows["manual"]["ratio"] == 5.0 and rows["flash"]["ratio"] == 1.0 and rows["flash"]["ms"] == 1.0
    sampling = attn_auto.measure(workload(training=False), CPU, IMPLEMENTATIONS, budget_s=1.0)
    assert sampling.pick == "flex"  # forward only: flex runs on a CPU, and is the fastest here


def test_a_numerically_wrong_implementation_is_dropped_however_fast(monkeypatch):
    wrong = lambda q, k, v, mask, dropout_p: v * 1.01  # noqa: E731 - the shape of attention, not its values
    candidates = {**IMPLEMENTATIONS, "flash": dataclasses.replace(IMPLEMENTATIONS["flash"], fn=wrong)}
    fake_clock(monkeypatch, {**FAKE_MS, "flex": 9.0})
    decision = attn_auto.measure(workload(training=False), CPU, candidates, budget_s=1.0)
    rows = {r["attn"]: r for r in decision.rows}
    assert rows["flash"]["status"] == "wrong" and "differs from the reference" in rows["flash"]["reason"]
    assert decision.pick == "sdpa"  # the next fastest that is right


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_masks_are_measured_in_each_implementations_form_and_checked_against_the_masked_reference(monkeypatch):
    fake_clock(monkeypatch, FAKE_MS)
    decision = attn_auto.measure(workload(training=False, doc_mask=True, window=8, eot_token=0), CPU,
                                 IMPLEMENTATIONS, budget_s=1.0)
    assert all(r["status"] in ("ok", "refused") for r in decision.rows)  # every runnable one is right
    assert decision.pick == "flex" and "documents and window 8" in decision.line()


def test_a_cached_decision_measures_nothing_and_a_changed_shape_or_refresh_measures_again(tmp_path, monkeypatch):
    measured = []
    fake_clock(monkeypatch, FAKE_MS)

    real = attn_auto.measure

    def counting(w, rt, implementations, budget_s):
        measured.append(w.seq_len)
        return real(w, rt, implementations, budget_s)
    path = tmp_path / "attn_auto.json"
    monkeypatch.setattr(attn_auto, "cache_file", lambda: path)
    monkeypatch.setattr(attn_auto, "measure", counting)
    first = attn_auto.choose(workload(), CPU, IMPLEMENTATIONS, 1.0)
    again = attn_auto.choose(workload(), CPU, IMPLEMENTATIONS, 1.0)
    assert measured == [64] and not first.cached and again.cached and again.pick == first.pick == "flash"
    assert again.line().endswith("; cached") and "flash (1.00) < sdpa (2.00)" in again.line()
    attn_auto.choose(workload(seq_len=48), CPU, IMPLEMENTATIONS, 1.0)  # another length
    attn_auto.choose(workload(), CPU, IMPLEMENTATIONS, 1.0, refresh=True)
    assert measured == [64, 48, 64] and len(json.loads(path.read_text())) == 2


def test_a_cached_decision_whose_rows_lack_their_timings_is_a_note_and_a_fresh_measurement(tmp_path, monkeypatch,
                                                                                             capsys):
    fake_clock(monkeypatch, FAKE_MS)
    path = tmp_path / "attn_auto.json"
    monkeypatch.setattr(attn_auto, "cache_file", lambda: path)
    path.write_text(json.dumps({workload().key(): {"pick": "flash", "rows": [{"attn": "flash", "status": "ok"}]}}))
    decision = attn_auto.choose(workload(), CPU, IMPLEMENTATIONS, 1.0)
    assert not decision.cached and "flash (1.00) < sdpa (2.00)" in decision.line()
    assert capsys.readouterr().err.startswith(f"note: {path} is not what this project wrote (1 of its 1 entries are "
                                              f"not decisions attn=auto wrote); measuring again")
    assert attn_auto.choose(workload(), CPU, IMPLEMENTATIONS, 1.0).cached  # the file rewritten whole


def test_the_budget_bounds_the_rounds(monkeypatch):
    calls = []
    monkeypatch.setattr(attn_auto, "time_candidate", lambda attn, call, rt: calls.append(attn) or 0.1)  # 100 ms each
    attn_auto.measure(workload(training=False), CPU, IMPLEMENTATIONS, budget_s=0.01)
    rounds = len(calls) // len(set(calls))
    assert rounds == 1 and len(calls) % len(set(calls)) == 0  # at least one round, whatever the budget


@pytest.mark.parametrize("budget", ["0", "-1.0", "inf", "'20'", "True", "None"])
def test_a_bad_budget_is_one_sentence_at_the_command_line_of_every_script_that_measures(budget):
    import bench
    import sample
    import train
    from core.configurator import configure
    for script in (train, sample, bench):
        with pytest.raises(UserError, match=r"^attn_auto_budget "):
            configure(vars(script), [f"--attn_auto_budget={budget}"], script.LIMITS)


def test_a_failure_while_measuring_is_one_line_and_the_run_falls_back_to_sdpa(capsys, tmp_path, monkeypatch):
    def broken(w, rt, implementations, budget_s):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")
    monkeypatch.setattr(attn_auto, "cache_file", lambda: tmp_path / "a.json")
    monkeypatch.setattr(attn_auto, "measure", broken)
    decision = attn_auto.choose_across_ranks(workload(), CPU, IMPLEMENTATIONS, 1.0)
    assert decision.pick == "sdpa"
    assert capsys.readouterr().out == ("attn=auto: measuring failed (RuntimeError: CUDA error: an illegal memory "
                                       "access was encountered); running sdpa\n")


def test_a_library_user_sets_auto_on_a_model_and_it_runs_the_fastest_correct_one(capsys, monkeypatch, tmp_path):
    from model import GPT
    fake_clock(monkeypatch, FAKE_MS)
    monkeypatch.setattr(attn_auto, "cache_file", lambda: tmp_path / "attn_auto.json")  # a decision of its own
    model = GPT(GPTConfig(block_size=64, vocab_size=11, n_layer=1, n_head=2, n_embd=32))
    assert model.set_attention("auto", training=True).config.attn == "flash"  # flex: no backward on a CPU
    line = capsys.readouterr().out
    assert line.startswith("attn=auto: flash (1.00) < sdpa (2.00)") and "B=1 T=64 hs=16 fp32, causal, training" in line
    assert model(torch.zeros(1, 8, dtype=torch.long))[0].shape == (1, 1, 11)  # and it runs


@pytest.mark.slow  # sample.py end to end, twice (the chooser's units above are the fast tier's)
def test_sample_py_decides_once_says_so_in_one_line_and_reads_the_decision_back(trained_char_run, capsys, monkeypatch,
                                                                              tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = [f"--out_dir={trained_char_run}", "--attn=auto", "--attn_auto_budget=2", "--num_samples=1",
            "--max_new_tokens=4", "--device=cpu", "--dtype=float32", f"--json={tmp_path / 's.json'}"]
    assert sample.main(args) == 0
    first = [line for line in capsys.readouterr().out.splitlines() if line.startswith("attn=auto: ")]
    # the prompt's 1 token and midway through 4 new ones: a generation's keys and decode steps, not a 1-token call
    assert len(first) == 1 and "; B=1 T=3 " in first[0] and ", sampling (4 decode steps); measured in " in first[0]
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["attn"] == report["attn_auto"]["attn_auto/pick"] != "auto"  # what ran is what was picked
    assert sample.main(args) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("attn=auto: ")][0].endswith(
        "; cached")
    assert (tmp_path / "nanogpt-attn" / "attn_auto.json").exists()


def decide_on_rank(rank: int, folder: str) -> None:
    """One of two gloo ranks: rank 1's own timer would pick manual, rank 0's flash; what each ends with is written."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        rt = Runtime("cpu", "float32", rank=rank, local_rank=rank, world_size=2)
        ms = FAKE_MS if rank == 0 else {**FAKE_MS, "manual": 0.1}
        attn_auto.time_candidate = lambda attn, call, rt: ms[attn] / 1e3  # this spawned process's own clock and cache
        attn_auto.cache_file = lambda: Path(folder) / f"cache{rank}.json"
        decision = attn_auto.choose_across_ranks(workload(), rt, IMPLEMENTATIONS, 1.0)
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps({"pick": decision.pick, "line": decision.line()}))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # two processes importing torch
def test_under_two_ranks_rank_0_decides_and_every_rank_runs_its_pick(tmp_path):
    torch.multiprocessing.spawn(decide_on_rank, args=(str(tmp_path),), nprocs=2)
    picks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert picks[0] == picks[1] and picks[0]["pick"] == "flash"  # rank 0's decision, rank 1's line too
    assert (tmp_path / "cache0.json").exists() and not (tmp_path / "cache1.json").exists()  # only rank 0 measured


def test_train_py_runs_what_auto_picked_records_it_and_a_resume_of_the_same_shapes_measures_nothing(
        char_data, tmp_path, monkeypatch, capsys):
    import train
    from conftest import TINY
    args = TINY + [f"--data_dir={char_data}", "--attn=auto", "--attn_auto_budget=1", "--eval_interval=2",
                   f"--out_dir={tmp_path}"]
    assert train.main(args + ["--max_iters=2", "--attn_auto_refresh=True"]) == 0
    assert capsys.readouterr().out.startswith("attn=auto: ")  # the decision's line comes first
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    pick = ckpt["attn_decision"]["attn_auto/pick"]
    assert ckpt["model_config"]["attn"] == pick != "auto"  # the checkpoint holds the implementation that ran
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["attn_auto/pick"] == pick and "attn_auto/manual" in logged[0]  # the table, in metrics.jsonl

    def measuring(*args, **kw):
        raise AssertionError("measured again")
    monkeypatch.setattr(attn_auto, "measure", measuring)
    assert train.main(args + ["--max_iters=4", "--init_from=resume"]) == 0
    assert capsys.readouterr().out.startswith(f"attn=auto: {pick}, as the checkpoint decided for B=4 T=32")
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["model_config"]["attn"] == pick

    monkeypatch.setattr(attn_auto, "measure", lambda *a, **kw: 1 / 0)  # another batch size: measured again
    assert train.main(args + ["--max_iters=6", "--init_from=resume", "--batch_size=2"]) == 0
    assert capsys.readouterr().out.startswith("attn=auto: measuring failed (ZeroDivisionError: division by zero); "
                                              "running sdpa\n")


def test_attn_auto_measured_after_a_resume_is_applied_leaves_the_restored_rng_streams_where_they_were(
        char_data, tmp_path, monkeypatch):
    """The decision is taken after restore (one place applies a checkpoint), so measuring must not draw from the RNG
    that restore set: dropout and the data order go on as the saved run's would."""
    import train
    from conftest import TINY
    args = TINY + [f"--data_dir={char_data}", "--eval_interval=2", f"--out_dir={tmp_path}", "--dropout=0.1"]
    assert train.main(args + ["--max_iters=2"]) == 0  # with dropout: each candidate's timed calls draw from the RNG
    seen = {}
    real = train.choose_attention

    def watched(run):
        seen["before"] = (torch.get_rng_state(), run.batches.generator.get_state())
        real(run)
        seen["after"] = (torch.get_rng_state(), run.batches.generator.get_state())
    monkeypatch.setattr(train, "choose_attention", watched)
    measured = []
    real_measure = attn_auto.measure
    monkeypatch.setattr(attn_auto, "measure", lambda *a, **kw: measured.append(1) or real_measure(*a, **kw))
    assert train.main(args + ["--max_iters=4", "--init_from=resume", "--attn=auto", "--attn_auto_budget=1",
                              "--attn_auto_refresh=True"]) == 0
    assert measured  # it measured, drawing random inputs
    assert all(torch.equal(b, a) for b, a in zip(seen["before"], seen["after"]))
