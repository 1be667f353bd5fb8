"""sample.py: reproducible samples, the KV cache changes nothing, every implementation compared, clear errors."""

import dataclasses
import functools
import json
import re
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import compare
from core import runtime
import sample
from conftest import checkpoint_of, runnable_on_cpu, strict_recompile_limit
from engine.generate import Decoder, Sampling, draw_samples
from model import IMPLEMENTATIONS, GPT, GPTConfig
from core.errors import UserError
from core.tokenizer import CharTokenizer, GPT2Tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
CHARS = list("\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")  # tinyshakespeare's 65
CHAR_META = {"tokenizer": "char", "vocab_size": len(CHARS), "chars": CHARS}
TINY = dict(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32)
CPU_RUNNABLE = runnable_on_cpu(training=False)
CPU_FP32 = runtime.Runtime("cpu", "float32")
SAMPLING = Sampling(num_samples=2, max_new_tokens=45, temperature=0.9, top_k=20, seed=7)


def confident_char_model() -> GPT:
    """A tiny char model whose logits reach well above 1 (the tied embedding scaled up), so the fp32 bound
    below is relative to a real logit scale rather than absolute."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # tied to wte: logits up to about 3
    return model.eval()


def save_checkpoint(out_dir: Path, model: GPT, meta) -> Path:
    checkpoint_of(model, meta=meta, iter_num=7).save(out_dir / "ckpt.pt")
    return out_dir


@pytest.fixture(scope="module")
def char_ckpt(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("char"), confident_char_model(), CHAR_META)


def draw(model: GPT, prompt: list[int], rt: runtime.Runtime, sampling: Sampling, use_cache=True):
    """The new tokens of sampling.num_samples samples, drawn eagerly."""
    samples, _, _ = draw_samples(Decoder(model), prompt, rt, sampling, use_cache)
    return samples


def run_sample(capsys, *args: str) -> str:
    """sample.py's main in this process; what it printed."""
    capsys.readouterr()
    assert sample.main(list(args)) == 0
    return capsys.readouterr().out


def texts(stdout: str) -> str:
    """The printed samples, without the timing line."""
    return "\n".join(line for line in stdout.splitlines() if "tokens/s" not in line)


# -- sampling ---------------------------------------------------------------------------------------------

def test_the_same_seed_prints_the_same_text_twice(char_ckpt, capsys):
    args = (f"--out_dir={char_ckpt}", "--num_samples=2", "--max_new_tokens=20", "--seed=3", "--start=ROMEO:",
            "--dtype=float32")
    first, second = run_sample(capsys, *args), run_sample(capsys, *args)
    assert texts(first) == texts(second)
    assert first.count("---------------") == 2 and "\nROMEO:" in first
    assert "tokens/s" in first


def test_kv_cache_and_cache_free_paths_give_the_same_tokens_past_block_size(char_ckpt):
    model, tok, _, _ = sample.load_model("resume", str(char_ckpt))
    prompt = sample.encode_prompt(tok, "To be")
    cached = draw(model, prompt, CPU_FP32, SAMPLING, use_cache=True)
    plain = draw(model, prompt, CPU_FP32, SAMPLING, use_cache=False)
    assert cached == plain
    assert [len(s) for s in cached] == [45, 45] and cached[0] != cached[1]  # 5 + 45 > block_size=32
    other_seed = draw(model, prompt, CPU_FP32, dataclasses.replace(SAMPLING, seed=8))
    assert other_seed != cached


def test_char_checkpoint_decodes_with_its_own_characters(char_ckpt):
    model, tok, source, _ = sample.load_model("resume", str(char_ckpt))
    model.set_attention("flash")
    assert isinstance(tok, CharTokenizer) and tok.chars == CHARS
    assert model.config.attn == "flash" and "iter 7" in source
    samples = draw(model, tok.encode("To be"), CPU_FP32, SAMPLING)
    ids = [i for s in samples for i in s]
    assert max(ids) < len(CHARS)
    assert set(tok.decode(ids)) <= set(CHARS)


def test_bpe_checkpoint_without_meta_never_emits_padded_ids(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16, pad_vocab=True))
    with torch.no_grad():
        model.lm_head.weight[50257:] = 50.0  # the padded rows would win every step without the mask
    save_checkpoint(tmp_path, model, meta=None)
    model, tok, _, _ = sample.load_model("resume", str(tmp_path))
    assert isinstance(tok, GPT2Tokenizer) and model.config.padded_vocab_size == 50304
    prompt = sample.encode_prompt(tok, "Hello world")
    assert prompt == [15496, 995]
    samples = draw(model, prompt, CPU_FP32, dataclasses.replace(SAMPLING, max_new_tokens=20))
    assert max(i for s in samples for i in s) < 50257
    assert tok.decode(prompt + samples[0]).startswith("Hello world")


def test_gpt2_weights_from_a_local_hf_directory_sample_with_gpt2_bpe(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    model, tok, source, _ = sample.load_model(str(tmp_path), "unused")
    model.set_attention("math")
    assert isinstance(tok, GPT2Tokenizer) and model.config.attn == "math" and source == str(tmp_path)
    samples = draw(model, tok.encode("<|endoftext|>"), CPU_FP32, SAMPLING)
    assert max(i for s in samples for i in s) < 50257


def test_file_prompt_is_read_from_the_file(char_ckpt, tmp_path, capsys):
    (tmp_path / "prompt.txt").write_text("ROMEO:\nBut soft", encoding="utf-8")
    out = run_sample(capsys, f"--out_dir={char_ckpt}", f"--start=FILE:{tmp_path / 'prompt.txt'}", "--num_samples=1",
                     "--max_new_tokens=10")
    assert "\nROMEO:\nBut soft" in out
    assert sample.read_prompt("plain text") == "plain text"


# -- comparison --------------------------------------------------------------------------------------------

@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_compare_all_runs_every_cpu_implementation_with_identical_fp32_tokens(char_ckpt, tmp_path, capsys):
    out = run_sample(capsys, f"--out_dir={char_ckpt}", "--compare=all", "--dtype=float32", "--num_samples=1",
                     "--max_new_tokens=8", "--start=To be, or not", f"--json={tmp_path / 'c.json'}")
    for name in CPU_RUNNABLE[1:]:
        assert f"=== {name}: tokens identical to manual's (the samples printed under manual)" in out
    sample_text = CharTokenizer(CHARS).decode(CharTokenizer(CHARS).encode("To be, or not") + json.loads(
        (tmp_path / "c.json").read_text())["implementations"]["manual"]["samples"][0])
    assert out.count(sample_text) == 1  # identical samples are printed once, not once per implementation
    assert "=== efficient: skipped, the memory-efficient kernel is CUDA-only" in out
    assert "=== cudnn: skipped, the cuDNN kernel is CUDA-only" in out
    assert "=== varlen: skipped, varlen_attn is CUDA-only" in out
    assert "== teacher-forced logits" in out and "== Appendix A" in out
    report = json.loads((tmp_path / "c.json").read_text())
    gens = report["implementations"]
    assert list(gens) == CPU_RUNNABLE
    assert set(report["skipped"]) == {"flash2", "efficient", "cudnn", "varlen"}
    assert "=== cudnn: skipped, the cuDNN kernel is CUDA-only" in out
    assert report["numerics_tokens"] == 32  # the prompt is short: the default text, cropped to block_size
    for name, g in gens.items():
        assert g["identical_to_first"] and g["first_divergence"] is None and g["cache_equals_no_cache"], name
        fp32 = g["logits"]["float32"]
        # scaled = max|dlogit| / max(1, max|ref logit|): relative to the reference's logit scale (which the
        # confident model puts well above 1), absolute for a model whose logits are all small
        assert fp32["scaled"] <= 1e-5 and fp32["kl_mean"] <= 1e-9, (name, fp32)
        assert g["logits"]["bfloat16"]["max_abs"] > fp32["max_abs"]  # the reduced dtype is measured too
        assert g["texts"][0].startswith("To be, or not")
    for dt in ("float32", "bfloat16"):
        assert set(report["appendix_a"][dt]["pairwise"]) == {"a-b", "a-c", "a-d", "b-c", "b-d", "c-d"}


def test_compare_reports_each_implementations_held_out_loss_as_the_readme_promises(char_ckpt, tmp_path, capsys):
    """README: --compare gives "held-out loss"; it once did only with --quantize=int8. The same weights through each
    implementation score the same text within fp32's rounding."""
    out = run_sample(capsys, f"--out_dir={char_ckpt}", "--compare=manual,sdpa", "--dtype=float32", "--num_samples=1",
                     "--max_new_tokens=4", f"--json={tmp_path / 'c.json'}")
    report = json.loads((tmp_path / "c.json").read_text())
    losses = {name: g["held_out_loss"] for name, g in report["implementations"].items()}
    assert set(losses) == {"manual", "sdpa"} and all(0 < loss < 10 for loss in losses.values())
    assert abs(losses["manual"] - losses["sdpa"]) < 1e-4
    assert "held-out loss" in out and f"{losses['sdpa']:.4f}" in out and report["held_out"] in out


def test_reference_logits_are_large_enough_for_a_relative_bound(char_ckpt):
    model, tok, _, _ = sample.load_model("resume", str(char_ckpt))
    x = torch.tensor([compare.numerics_ids(tok, tok.encode("T"), model.config.block_size)])
    ref = compare.forced_logits(compare.with_attn(model, "manual").double(), x, CPU_FP32)
    assert ref.abs().max().item() > 2.0


def test_kl_ignores_a_constant_logit_shift_that_max_abs_sees():
    ref = torch.randn(5, 11, dtype=torch.float64)
    errors = compare.logit_errors(ref + 0.25, ref)  # softmax is shift-invariant: the same distributions
    assert errors["max_abs"] == pytest.approx(0.25) and errors["kl_mean"] == pytest.approx(0.0, abs=1e-15)
    sharper = compare.logit_errors(2 * ref, ref)  # other distributions: KL(p || q) > 0 at every position
    assert sharper["kl_mean"] > 0 and sharper["kl_max"] >= sharper["kl_mean"]


def test_appendix_a_sdpa_math_is_pre_scaling_bit_for_bit_and_not_allclose_to_nanogpt():
    """The post's Appendix A at GPT-2's head size: allclose(sdpa, nanogpt) fails, allclose(sdpa, scale_before) holds."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 64) for _ in range(3))  # (B, nh, T, hs)
    fp32 = compare.appendix_a((q, k, v), "float32")
    assert max(fp32["vs_float64"].values()) <= 1e-6  # all four are right to fp32 precision
    assert fp32["pairwise"]["b-d"] == {"max_abs": 0.0, "allclose": True}
    assert 0 < fp32["pairwise"]["a-d"]["max_abs"] <= 1e-6 and not fp32["pairwise"]["a-d"]["allclose"]
    bf16 = compare.appendix_a((q, k, v), "bfloat16")
    assert min(bf16["vs_float64"].values()) > 100 * max(fp32["vs_float64"].values())


def test_pre_scaling_by_a_power_of_two_rounds_nothing():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))  # d=16: d^-1/4 = 0.5
    assert compare.appendix_a((q, k, v), "float32")["pairwise"]["a-b"] == {"max_abs": 0.0, "allclose": True}


def test_compare_names_are_checked_and_unrunnable_ones_skipped_with_the_reason():
    comparison = compare.Comparison(CPU_FP32, "bfloat16", SAMPLING, [0], False)
    names, skipped = compare.resolve_compare("sdpa, manual,sdpa,efficient", comparison, GPTConfig(**TINY))
    assert names == ["sdpa", "manual", "efficient"]  # in the order given, each once
    assert skipped == {"efficient": "the memory-efficient kernel is CUDA-only"}
    with pytest.raises(UserError, match="unknown attn 'fast'; use all or a comma-separated list"):
        compare.resolve_compare("manual,fast", comparison, GPTConfig(**TINY))
    with pytest.raises(UserError, match="none of efficient, cudnn can run"):
        compare.resolve_compare("efficient,cudnn", comparison, GPTConfig(**TINY))


def test_first_divergence_names_the_sample_and_the_token():
    assert compare.first_divergence([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == {"sample": 1, "token": 1}
    assert compare.first_divergence([[1, 2]], [[1, 2]]) is None


# -- clear errors --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--attn=fast"], "attn must be one of 'auto', 'manual', 'sdpa_mask'"),
    (["--attn=efficient"], "attn='efficient' cannot run for inference on cpu"),
    (["--compare=manual,fast"], "unknown attn 'fast'; use all or a comma-separated list"),
    (["--start=FILE:no/such/prompt.txt"], "prompt file no/such/prompt.txt does not exist"),
    (["--out_dir=MISSING"], "no checkpoint at"),
    (["--out_dir=CORRUPT"], "cannot be read"),
    (["--temperature=-1.0"], "temperature must be at least 0, got -1.0"),
], ids=["unknown-attn", "unrunnable-attn", "unknown-compare", "missing-prompt-file", "missing-checkpoint",
        "corrupt-checkpoint", "negative-temperature"])
def test_bad_input_is_one_sentence(char_ckpt, tmp_path, args, message):
    (tmp_path / "CORRUPT").mkdir()
    (tmp_path / "CORRUPT" / "ckpt.pt").write_bytes(b"not a checkpoint")
    args = [a.replace("MISSING", str(tmp_path / "nothing")).replace("CORRUPT", str(tmp_path / "CORRUPT"))
            for a in args]
    if not any(a.startswith("--out_dir") for a in args):
        args.append(f"--out_dir={char_ckpt}")
    with pytest.raises(UserError) as error:
        sample.main([*args, "--max_new_tokens=5", "--num_samples=1"])
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow  # a fresh interpreter importing torch: what only the command line shows
def test_the_command_line_prints_bad_input_as_one_line_and_exit_code_2(char_ckpt):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "sample.py"), f"--out_dir={char_ckpt}", "--attn=fast"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: attn must be one of {', '.join(map(repr, ['auto', *IMPLEMENTATIONS]))}, got 'fast'; did you mean "
        f"'flash'?"]


# -- compiled comparisons and kernels that refuse at run time ---------------------------------------------------

@pytest.mark.slow
def test_compare_with_compile_runs_every_implementation_compiled(char_ckpt, monkeypatch, capsys):
    # dynamo raises rather than running later twins eagerly past its recompile limit; eager backend: fast
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    try:
        # two twins of one model: each recompiles for prefill, decode and the teacher-forced passes, together
        # past dynamo's per-code-object limit
        with strict_recompile_limit():
            assert sample.main([f"--out_dir={char_ckpt}", "--compare=manual,sdpa", "--compile=True",
                                "--dtype=float32", "--num_samples=1", "--max_new_tokens=12", "--start=To be"]) == 0
    finally:
        torch._dynamo.reset()
    out = capsys.readouterr().out
    assert all(f"=== {name}: " in out and f"=== {name}: skipped" not in out for name in ("manual", "sdpa"))


def refusing_prefills(attention):
    """An attention function whose kernel refuses prefills shorter than the block (T=32), as a fused kernel can
    refuse a shape or layout at run time: the probe (full length, and one-query decode) still passes."""
    def refusing(q, k, v, causal_mask, dropout_p):
        if 1 < q.size(-2) < TINY["block_size"]:
            raise RuntimeError("No available kernel. Aborting execution.")
        return attention(q, k, v, causal_mask, dropout_p)
    return dataclasses.replace(attention, fn=refusing)  # the record, with its function replaced


def test_a_kernel_refusing_a_real_call_is_one_sentence(monkeypatch):
    monkeypatch.setitem(IMPLEMENTATIONS, "math", refusing_prefills(IMPLEMENTATIONS["math"]))
    model = confident_char_model().set_attention("math")
    model(torch.zeros(1, TINY["block_size"], dtype=torch.long))  # the shape the probe met runs
    with pytest.raises(UserError, match=r"attn='math' cannot run for inference on cpu in float32 .*PyTorch refused "
                                        r"q of shape \(1, 2, 5, 16\) at run time; use one of manual, sdpa_mask"):
        with torch.no_grad():
            model(torch.zeros(1, 5, dtype=torch.long))


def test_compare_skips_an_implementation_that_refuses_at_run_time_and_finishes(char_ckpt, monkeypatch, capsys):
    monkeypatch.setitem(IMPLEMENTATIONS, "math", refusing_prefills(IMPLEMENTATIONS["math"]))
    assert sample.main([f"--out_dir={char_ckpt}", "--compare=manual,math,sdpa", "--dtype=float32",
                        "--num_samples=1", "--max_new_tokens=10", "--start=To be"]) == 0
    out = capsys.readouterr().out
    assert "=== math: skipped, attn='math' cannot run" in out and "=== sdpa: tokens identical to manual's" in out


# -- int8 weights --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_ckpt(trained_char_run) -> Path:
    """conftest's tiny char model trained for 150 steps on char_data, whose checkpoint names that data (val.bin)."""
    return trained_char_run


def test_int8_sampling_draws_the_fp32_greedy_tokens_of_a_trained_model(trained_ckpt, tmp_path, capsys):
    reports = {}
    for quantize in ("", "int8"):
        out = run_sample(capsys, f"--out_dir={trained_ckpt}", f"--quantize={quantize}", "--temperature=0",
                         "--num_samples=2", "--max_new_tokens=40", "--start=To be", "--dtype=float32",
                         f"--json={tmp_path / (quantize or 'fp32')}.json")
        reports[quantize] = json.loads((tmp_path / f"{quantize or 'fp32'}.json").read_text())
        assert ("int8 weights" in out) == (quantize == "int8") and "2 x 40 new tokens in one batch" in out
    assert reports["int8"]["samples"] == reports[""]["samples"]


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_compare_with_int8_weighs_memory_speed_held_out_loss_and_agreement(trained_ckpt, char_data, tmp_path, capsys):
    out = run_sample(capsys, f"--out_dir={trained_ckpt}", "--compare=sdpa", "--quantize=int8", "--dtype=float32",
                     "--num_samples=1", "--max_new_tokens=30", "--start=To be", f"--json={tmp_path / 'c.json'}")
    report = json.loads((tmp_path / "c.json").read_text())
    study = report["weights"]
    assert str(char_data / "val.bin") in study["held_out"] and "== weights: held-out loss" in out
    # one held-out loss for one set of weights: the generation table's fp32 sdpa and the study's fp32 row agree
    assert study["held_out"] == report["held_out"]
    assert study["rows"]["float32"]["loss"] == pytest.approx(report["implementations"]["sdpa"]["held_out_loss"],
                                                             abs=1e-5)
    rows = study["rows"]
    assert list(rows) == ["float32", "bfloat16", "int8"]
    fp32, bf16, int8 = rows["float32"], rows["bfloat16"], rows["int8"]
    assert fp32["loss_delta"] == 0 and fp32["top1_agreement"] == 1 and fp32["greedy_divergence"] is None
    assert fp32["perplexity"] == pytest.approx(math.exp(fp32["loss"]))
    assert fp32["loss"] < 2.5  # trained: well below a uniform guess over its characters (ln 40 = 3.7)
    # the quality cost: int8 moves the held-out loss by under 1% and keeps >= 97% of fp32's greedy tokens
    assert abs(int8["loss_delta"]) <= 0.01 * fp32["loss"] and int8["top1_agreement"] >= 0.97
    assert bf16["top1_agreement"] >= 0.97
    assert bf16["weight_bytes"] == pytest.approx(fp32["weight_bytes"] / 2, rel=0.02)
    assert int8["weight_bytes"] < 0.5 * fp32["weight_bytes"]
    assert all(r["tokens_per_s"] > 0 for r in rows.values())


def test_an_unknown_quantization_is_one_sentence(char_ckpt):
    with pytest.raises(UserError, match="quantize must be one of '', 'int8', got 'int4'"):
        sample.main([f"--out_dir={char_ckpt}", "--quantize=int4"])


def test_compares_speed_rows_say_why_the_cache_can_trail_no_cache_where_it_is_printed(trained_ckpt, capsys):
    """Past block_size every token refills the cache: the table says so under itself, not only docs/sample.md."""
    long = run_sample(capsys, f"--out_dir={trained_ckpt}", "--compare=manual", "--num_samples=1",
                      "--max_new_tokens=40", "--device=cpu", "--dtype=float32")  # block 32: past it
    assert "(the cache holds block_size=32 positions and a sample reaches 4" in long
    short = run_sample(capsys, f"--out_dir={trained_ckpt}", "--compare=manual", "--num_samples=1",
                       "--max_new_tokens=8", "--device=cpu", "--dtype=float32")
    assert "the cache holds block_size" not in short


def test_a_default_sample_prints_one_speed_line_and_measures_nothing_else(trained_ckpt, capsys, tmp_path,
                                                                          monkeypatch):
    """No bandwidth probe, no layout timing, nothing written to the cache folder: GB/s against the machine's
    bandwidth is bench.py --mode=generate's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = run_sample(capsys, f"--out_dir={trained_ckpt}", "--num_samples=1", "--max_new_tokens=4", "--device=cpu")
    speed = [line for line in out.splitlines() if " tokens/s " in line]
    assert len(speed) == 1 and re.search(r"weights read at ([1-9]\d* MB/s|\d+\.\d GB/s)$", speed[0]), speed  # a unit
    # that fits: a small model's figure in MB/s, never "0.0 GB/s"
    assert not (tmp_path / "cache").exists()


def test_a_default_prompt_the_vocabulary_lacks_is_named_as_the_default_with_the_flag_to_set(tmp_path, capsys):
    """A character vocabulary without '\\n' (a text of one line) cannot encode the default prompt: the error line says
    it is the default and names --start=, not only the missing character."""
    meta = {**CHAR_META, "chars": [c if c != "\n" else "\u2603" for c in CHAR_META["chars"]]}
    out = save_checkpoint(tmp_path, confident_char_model(), meta)
    with pytest.raises(UserError) as refused:
        sample.main([f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=2"])
    said = str(refused.value)
    assert said.startswith("the default prompt (--start='\\n'): character '\\n' is not in this character "
                           "vocabulary") and "pass --start=" in said and "\n" not in said
    with pytest.raises(UserError, match=r"^the prompt: character '\\n'"):  # typed: not the default
        sample.main([f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=2", "--start=\n"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rows_that_part_in_a_reduced_dtype_get_a_line_saying_what_holds_there(char_ckpt, monkeypatch, capsys, dtype):
    """In bf16 two tokens whose logits are closer than its rounding can go either way: a row that differs gets one
    line under the table saying so and naming --dtype=float32, where they must be identical (no such line)."""
    from benchmarks import compare
    monkeypatch.setattr(compare, "tokens_cell", lambda name, gens, first: "reference" if name == first else
                        "differ at s0 t3")
    out = run_sample(capsys, f"--out_dir={char_ckpt}", "--compare=manual,sdpa", f"--dtype={dtype}",
                     "--num_samples=1", "--max_new_tokens=8")
    said = [line for line in out.splitlines() if line.startswith("(sdpa part from manual's tokens")]
    assert len(said) == (dtype == "bfloat16")
    assert not said or "with --dtype=float32 the tokens of every implementation, cache or not, are identical" in said[0]
