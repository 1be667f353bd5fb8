"""The optimizer switch: Muon for the blocks' weight matrices, AdamW for everything else; one process, DDP, resume."""

import pytest
import torch

from core import runtime
from core.configurator import configure
import train
from conftest import REPO, TINY, TWO_RANKS, metrics, straight_and_resumed
from model import GPT, GPTConfig
from core.errors import UserError
from engine.muon import Muon, muon_optimizers, muon_parameters, orthogonalize

BLOCK_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def test_every_parameter_is_in_exactly_one_group_and_muon_gets_the_block_matrices():
    model = GPT(GPTConfig(block_size=16, vocab_size=61, n_layer=2, n_head=2, n_embd=32, pad_vocab=True))
    muon, adamw = muon_optimizers(model, 0.1, 1e-3, 2e-2, 0.95, (0.9, 0.95), "cpu", torch.float32)
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.orthogonalize_dtype == torch.float32
    grouped = [id(p) for optimizer in (muon, adamw) for g in optimizer.param_groups for p in g["params"]]
    assert len(grouped) == len(set(grouped))  # no parameter twice (lm_head is tied to wte: one tensor)
    assert set(grouped) == {id(p) for p in model.parameters()}  # and none left out
    name = {id(p): n for n, p in model.named_parameters()}
    assert {name[id(p)] for p in muon.param_groups[0]["params"]} == {
        f"transformer.h.{i}.{m}" for i in range(2) for m in BLOCK_MATRICES}
    decayed, plain = adamw.param_groups
    assert {name[id(p)] for p in decayed["params"]} == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in plain["params"])  # biases and norms


def test_muon_trains_a_tiny_model_to_a_lower_loss(char_data, tmp_path):
    train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={tmp_path}", "--optimizer=muon", "--max_iters=40",
                       "--eval_interval=20"])
    val = metrics(tmp_path, "val/loss")
    assert val[40] < val[20] < val[0] - 0.5  # from ~ln(vocab) at step 0
    lrs = metrics(tmp_path, "lr")
    assert lrs[1] < lrs[3] == pytest.approx(3e-3)  # the shared schedule: warmup, then the peak


def test_muon_follows_the_schedule_with_its_own_peak():
    model = GPT(GPTConfig(block_size=16, vocab_size=61, n_layer=1, n_head=2, n_embd=32))
    cfg = configure(vars(train), ["--optimizer=muon", "--learning_rate=1e-3", "--muon_lr=0.02"], train.LIMITS)
    optimizers = train.make_optimizers(model, cfg, runtime.Runtime("cpu", "float32"))
    train.set_learning_rates(optimizers, 0.5)
    muon, adamw = optimizers
    assert muon.param_groups[0]["lr"] == pytest.approx(0.01)
    assert all(g["lr"] == pytest.approx(5e-4) for g in adamw.param_groups)


def test_resume_with_muon_continues_bit_for_bit(char_data, tmp_path):
    straight, stopped = straight_and_resumed(
        TINY + [f"--data_dir={char_data}", "--eval_interval=3", "--optimizer=muon"], tmp_path)
    assert [metrics(straight, "train/step_loss")[i] for i in range(4, 7)] == [metrics(stopped, "train/step_loss")[i]
                                                                          for i in range(4, 7)]
    assert metrics(straight, "val/loss")[6] == metrics(stopped, "val/loss")[6]
    state = torch.load(stopped / "ckpt.pt", weights_only=True)["optimizer"]["state"]
    assert "momentum_buffer" in state["transformer.h.0.attn.c_attn.weight"]  # Muon's state is saved
    assert "exp_avg" in state["transformer.wte.weight"]  # and AdamW's


@pytest.mark.slow
def test_two_ranks_with_muon_match_one_rank_with_the_same_global_batch(char_data, tmp_path, two_rank_runs):
    train.main(TWO_RANKS + [f"--data_dir={char_data}", "--optimizer=muon", f"--out_dir={tmp_path}"])
    one, two = metrics(tmp_path, "train/step_loss"), two_rank_runs.losses("muon")
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for it, loss in one.items():  # DDP averages the same gradients in another order
        assert two[it] == pytest.approx(loss, abs=1e-4), it


def test_muon_under_fsdp_is_refused_in_one_sentence(char_data, tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "init_distributed", lambda device, backend="auto": (0, 0, 2, device))
    with pytest.raises(UserError, match="optimizer='muon' does not run under --parallel=fsdp: .*use --parallel=ddp"):
        train.main(TINY + [f"--data_dir={char_data}", "--optimizer=muon", "--parallel=fsdp",
                           "--gradient_accumulation_steps=2", f"--out_dir={tmp_path}"])


def test_resuming_with_another_optimizer_is_refused(char_data, tmp_path):
    train.main(TINY + [f"--data_dir={char_data}", "--max_iters=2", "--eval_interval=2", f"--out_dir={tmp_path}"])
    with pytest.raises(UserError, match="the checkpoint's optimizer state is adamw's; resume with --optimizer=adamw"):
        train.main(TINY + [f"--data_dir={char_data}", "--max_iters=4", "--init_from=resume", "--optimizer=muon",
                           f"--out_dir={tmp_path}"])
    with pytest.raises(UserError, match="optimizer must be one of 'adamw', 'muon', got 'sgd'"):
        train.main(TINY + [f"--data_dir={char_data}", "--optimizer=sgd", f"--out_dir={tmp_path}"])


# -- Muon's orthogonalization and its dtype ----------------------------------------------------------------

def singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 160), (160, 48)])  # wide and tall: a tall one is iterated transposed
def test_newton_schulz_orthogonalizes_in_fp32_and_in_bf16(dtype, shape):
    rows, cols = shape
    k, generator = min(shape), torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=generator))  # (rows, k), orthonormal columns
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=generator))  # (cols, k)
    g = u @ torch.diag(torch.logspace(0, -1.5, k)) @ v.T  # singular values from 1 down to 0.03
    before = singular_values(g)
    assert before.max() / before.min() > 30
    s = singular_values(orthogonalize(g, dtype))
    assert s.shape == before.shape and 0.6 < s.min() and s.max() < 1.25  # Keller's quintic: ~0.7-1.2, not exactly 1
    assert orthogonalize(g, dtype).dtype == dtype


def test_fp32_newton_schulz_is_nearer_a_float64_iteration_than_bf16():
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    exact = orthogonalize(g.double(), torch.float64)
    fp32, bf16 = ((orthogonalize(g, d).double() - exact).abs().max() for d in (torch.float32, torch.bfloat16))
    assert fp32 < 1e-4 < bf16


def test_muon_in_bf16_takes_exactly_torch_optim_muons_steps():
    """torch.optim.Muon is the independent reference: it always iterates in bf16."""
    models = [GPT(GPTConfig(block_size=16, vocab_size=61, n_layer=1, n_head=2, n_embd=32)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    ours = Muon(muon_parameters(models[0]), lr=0.02, adjust_lr_fn="match_rms_adamw", orthogonalize_dtype=torch.bfloat16)
    theirs = torch.optim.Muon(muon_parameters(models[1]), lr=0.02, adjust_lr_fn="match_rms_adamw")
    x = torch.randint(61, (4, 16), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        for model, optimizer in zip(models, (ours, theirs)):
            model(x, x)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    assert ours.state_dict()["param_groups"][0].keys() == theirs.state_dict()["param_groups"][0].keys()


@pytest.mark.parametrize("device_type,capability,bf16_gpu,width,wanted", [
    ("cpu", "AVX2", False, 1024, "float32"),        # bf16 emulated: ~20x an fp32 iteration
    ("cpu", "AVX512", False, 1024, "float32"),
    ("cpu", "AVX512_BF16", False, 1024, "float32"),  # native, but slower than fp32 without AMX (MEASURED.md)
    ("cpu", "AMX", False, 128, "float32"),           # the quickstart's width: the casts cost more than AMX saves
    ("cpu", "AMX", False, 256, "bfloat16"),          # 0.55x fp32's time at 256 x 256, ~0.3x from 384
    ("cuda", "AVX2", True, 128, "bfloat16"),         # Ampere and later, at any width
    ("cuda", "AVX2", False, 1024, "float32"),        # a V100 or T4 only emulates bf16
])
def test_muon_iterates_in_bf16_only_where_bf16_pays(monkeypatch, device_type, capability, bf16_gpu, width, wanted):
    monkeypatch.setattr(runtime, "cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_gpu)
    monkeypatch.setattr(runtime, "pick_device", lambda device: "cuda:0" if device_type == "cuda" else "cpu")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    rt = runtime.resolve_runtime(device_type, "float32", width=width)
    assert rt.muon_dtype == wanted
    assert runtime.resolve_runtime(device_type, "float32", "bfloat16").muon_dtype == "bfloat16"  # a setting wins
    cfg = configure(vars(train), ["--optimizer=muon"], train.LIMITS)
    muon, _ = train.make_optimizers(GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=8)), cfg,
                                    rt)
    assert muon.orthogonalize_dtype == rt.orthogonalize_dtype


@pytest.mark.parametrize("capability,wanted", [("AVX2", "float32"), ("AVX512_BF16", "float32"), ("AMX", "bfloat16")])
def test_dtype_auto_on_a_cpu_picks_bf16_only_with_amx(monkeypatch, capability, wanted):
    monkeypatch.setattr(runtime, "cpu_capability", lambda: capability)
    assert runtime.pick_dtype("auto", "cpu") == wanted


def test_the_run_records_its_newton_schulz_dtype(char_data, tmp_path, capsys):
    train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={tmp_path}", "--optimizer=muon", "--max_iters=1",
                       "--muon_dtype=float32"])
    assert "Muon's Newton-Schulz in float32" in capsys.readouterr().out
    with pytest.raises(UserError, match="muon_dtype must be one of 'auto', 'float32', 'bfloat16', got 'fp8'"):
        train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={tmp_path / 'x'}", "--muon_dtype=fp8"])


# -- time to loss (time_to_loss.py) -------------------------------------------------------------------------

# A stand-in for train.py, launched as time_to_loss launches train.py (python <root>/train.py <recipe>
# --out_dir=...): it writes the evaluations of --losses= to out_dir/metrics.jsonl as train.py logs them ({"iter",
# "val/loss", ...}, between training lines; test_train.py holds train.py to those names), one every --eval_interval=
# iterations, then stalls --then_sleep= seconds, as a long run does between evaluations, before those of --later=.
FAKE_TRAIN = """
import json, os, sys, time
from pathlib import Path
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
if "fail" in args:
    print("error: unknown setting 'n_layers'; did you mean n_layer?")
    sys.exit(2)
if "caches" in args:  # where this launch's compiler caches are
    with open(args["caches"], "a") as f:
        f.write(os.environ["TORCHINDUCTOR_CACHE_DIR"] + " " + os.environ["TRITON_CACHE_DIR"] + "\\n")
out = Path(args["out_dir"])
out.mkdir(parents=True)
losses = [float(x) for x in args["losses"].split(",")]
for i, loss in enumerate(losses + [float(x) for x in args.get("later", "").split(",") if x]):
    if i == len(losses):
        time.sleep(float(args["then_sleep"]))
    it = i * int(args["eval_interval"])
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"iter": it, "train/step_loss": loss + 0.1, "lr": 1e-3}) + "\\n")
        f.write(json.dumps({"iter": it, "train/loss": loss, "val/loss": loss, "lr": 1e-3}) + "\\n")
    time.sleep(0.02)
"""


@pytest.fixture()
def fake_train(tmp_path, monkeypatch):
    """time_to_loss launching FAKE_TRAIN as train.py; the data each recipe needs, recorded instead of prepared."""
    from benchmarks import time_to_loss
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "train.py").write_text(FAKE_TRAIN)
    monkeypatch.setattr(time_to_loss, "ROOT", tmp_path / "root")
    prepared = []
    monkeypatch.setattr(time_to_loss, "prepare_data", lambda recipes: prepared.append(list(recipes)))
    return time_to_loss, prepared


def test_time_to_loss_times_each_recipe_to_the_target_and_pairs_the_rounds(tmp_path, fake_train, monkeypatch, capsys):
    import json

    time_to_loss, prepared = fake_train
    # --full=False: a run that reaches the target is stopped at that evaluation (read from its metrics.jsonl as it
    # is written; were it not, it would stall 30 s and then log iteration 15); one that never does runs to its end,
    # its last evaluation its final loss
    monkeypatch.setitem(time_to_loss.RECIPE_SETS, "quickstart", {
        "adamw": ["--eval_interval=5", "--losses=3.26,3.0,2.7", "--then_sleep=30", "--later=2.5"],
        "never": ["--eval_interval=5", "--losses=3.26,3.25"]})
    caches = tmp_path / "caches.txt"
    assert time_to_loss.main(["--target=2.8", "--runs=2", "--full=False", f"--extra=--caches={caches}",
                              f"--out_dir={tmp_path}"]) == 0
    assert prepared == [["adamw", "never"]]  # the data, before any clock started
    launches = caches.read_text().split()
    assert len(launches) == 8 and len(set(launches)) == 8  # each launch compiles into caches of its own
    report = json.loads((tmp_path / "time_to_loss.json").read_text())
    rounds = report["rounds"]
    assert report["orders"] == [["adamw", "never"], ["never", "adamw"]]  # who goes first alternates
    for r in rounds:
        reached, never = r["adamw"], r["never"]
        assert reached["iter"] == reached["final_iter"] == 10 and 0 < reached["seconds"] <= reached["wall_s"] < 20
        assert reached["final_loss"] == 2.7
        assert never["seconds"] is None and never["final_iter"] == 5 and never["final_loss"] == 3.25
    table = capsys.readouterr().out
    assert "time to val/loss <= 2.8" in table and "not reached" in table
    assert f"{runtime.cpu_capability()}): median" in table  # the CPU's capability names every figure


def test_the_gpu_comparison_times_both_to_the_best_val_nanogpts_recipe_reaches_in_alternating_rounds(fake_train,
                                                                                                     tmp_path):
    import json

    time_to_loss, _ = fake_train
    time_to_loss.RECIPE_SETS["gpu"], real = {"nanoGPT": ["--eval_interval=250", "--losses=4.2,1.6,1.52,1.55"],
                                             "fast": ["--eval_interval=100", "--losses=4.0,1.6,1.5"]}, \
        time_to_loss.RECIPE_SETS["gpu"]
    try:
        assert time_to_loss.main(["--compare=gpu", "--extra=--x=1", f"--out_dir={tmp_path}"]) == 0
    finally:
        time_to_loss.RECIPE_SETS["gpu"] = real
    report = json.loads((tmp_path / "time_to_loss.json").read_text())
    assert report["recipes"]["fast"][-1] == "--x=1" and len(report["rounds"]) == 2  # --extra goes to each
    for run in report["rounds"]:
        assert run["nanoGPT"]["target"] == 1.52  # nanoGPT's best on this data, measured in the round
        assert (run["nanoGPT"]["iter"], run["fast"]["iter"]) == (500, 200)


def test_the_gpu_baseline_is_nanogpts_recipe_and_model_as_its_code_builds_them():
    """nanoGPT's config/train_shakespeare_char.py, with what nanoGPT's train.py and model.py fix: no biases, the
    exact GELU (this repo's defaults are GPT-2's, bias=True and tanh)."""
    import train
    from benchmarks import time_to_loss
    args = time_to_loss.RECIPE_SETS["gpu"]["nanoGPT shakespeare_char"]
    cfg = configure(vars(train), [str(REPO / args[0]), *args[1:]], train.LIMITS)
    nanogpt = dict(bias=False, gelu="none", n_layer=6, n_head=6, n_embd=384, dropout=0.2, block_size=256,
                   batch_size=64, gradient_accumulation_steps=1, learning_rate=1e-3, max_iters=5000, min_lr=1e-4,
                   beta2=0.99, warmup_iters=100, eval_interval=250, eval_iters=200, optimizer="adamw",
                   weight_decay=0.1, grad_clip=1.0, pad_vocab=False, dataset="shakespeare_char")
    assert {k: getattr(cfg, k) for k in nanogpt} == nanogpt


def test_the_gpu_comparison_decides_both_crossings_on_the_same_evaluation():
    """The fast recipe's own 20 val batches would carry one fixed offset into every evaluation (and so into when it
    first 'reaches' the target): both recipes read nanoGPT's 200, the same batches (one seed, one batch shape)."""
    import train
    from benchmarks import time_to_loss
    evaluation = ("eval_iters", "batch_size", "block_size", "seed", "dataset", "data_dir")
    seen = []
    for args in time_to_loss.RECIPE_SETS["gpu"].values():
        cfg = configure(vars(train), [str(REPO / args[0]), *args[1:]], train.LIMITS)
        seen.append({k: getattr(cfg, k) for k in evaluation})
    assert seen[0] == seen[1] and seen[0]["eval_iters"] == 200


def test_time_to_loss_refuses_a_gpu_comparison_on_a_cpu_and_names_a_recipe_that_fails(fake_train, tmp_path,
                                                                                       monkeypatch):
    time_to_loss, _ = fake_train
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="needs a CUDA GPU; here, pass --extra= a scaled-down CPU run"):
        time_to_loss.main(["--compare=gpu", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=r"failed \(exit code 2\): error: unknown setting 'n_layers'"):
        time_to_loss.main(["--extra=--fail=1", f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(UserError, match="cannot be read as train.py settings"):
        time_to_loss.main(["--extra='--x", f"--out_dir={tmp_path / 'out'}"])


@pytest.mark.slow
def test_the_gpu_comparison_runs_both_recipes_on_a_cpu_scaled_down(char_data, tmp_path):
    import json

    from benchmarks import time_to_loss
    tiny = (f"--data_dir={char_data} --device=cpu --compile=False --dtype=float32 --n_layer=1 --n_head=2 "
            f"--n_embd=32 --block_size=32 --batch_size=4 --max_iters=10 --lr_decay_iters=10 --warmup_iters=2 "
            f"--eval_interval=5 --eval_iters=2")
    assert time_to_loss.main(["--compare=gpu", "--target=10", f"--extra={tiny}", f"--out_dir={tmp_path}"]) == 0
    run = json.loads((tmp_path / "time_to_loss.json").read_text())["rounds"][0]
    for recipe in ("nanoGPT shakespeare_char", "fast"):  # reached at the first evaluation, then run to the end
        assert run[recipe]["iter"] == 0 and run[recipe]["final_iter"] == 10 and run[recipe]["final_loss"] < 10


@pytest.mark.parametrize("recipes", ["quickstart", "doc_mask", "attn", "attn_masked", "gpu"])
def test_every_time_to_loss_recipe_is_a_valid_train_py_command_line(recipes, monkeypatch):
    from benchmarks import time_to_loss
    monkeypatch.chdir(time_to_loss.ROOT)  # config files are named from the repository root, where runs start
    for name, args in time_to_loss.RECIPE_SETS[recipes].items():
        assert configure(vars(train), args, train.LIMITS), name


@pytest.mark.parametrize("settings, note", [
    (["--warmup_iters=10", "--lr_decay_iters=5"], "note: warmup_iters=10 is past lr_decay_iters=5: the rate climbs for "
                                                  "10 steps, then drops to min_lr at once; set lr_decay_iters above it "
                                                  "(often max_iters)."),
    (["--min_lr=0.01", "--learning_rate=0.001"], "note: min_lr=0.01 is above learning_rate=0.001: the decay raises the "
                                                 "rate; set min_lr below it (often learning_rate / 10)."),
    (["--warmup_iters=4", "--early_decay_iters=2"], "note: early_decay_iters=2 is not between warmup_iters=4 and "
                                                    "lr_decay_iters=100, so there is no early decay."),
], ids=["warmup past decay", "floor above peak", "early decay in warmup"])
def test_a_schedule_that_does_not_do_what_its_settings_say_is_named_at_start(char_data, tmp_path, capsys, settings,
                                                                             note):
    train.main(TINY + [f"--data_dir={char_data}", "--max_iters=1", "--eval_interval=1", f"--out_dir={tmp_path}",
                       *settings])
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")] == [note]
