"""The GPU acceptance suite: what only a GPU can show, in one command and well under 10 minutes on one GPU.

    python -m pytest tests -m gpu -v

Skipped, with the reason, where CUDA is absent. Every test runs in process on cuda:0 except the multi-GPU ones.
"""

import copy
import json
import math
import string

import pytest
import torch
from torch._dynamo.utils import counters

import bench
from benchmarks import measure
from core import runtime
import sample
import train
from conftest import TINY, checkpoint_of, metrics, run_train, straight_and_resumed, bench_file
from attention.cuda import cuda_facts, cudnn_first
from attention.kernels import AttnCall, attention_problem, decodes_with_mask
from engine.generate import Decoder, for_inference
from engine.generate import weight_bytes
from model import IMPLEMENTATIONS, GPT, GPTConfig
from core.errors import UserError

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (python -m pytest -m gpu)")]
# head size 64 (GPT-2's), so every fused kernel is in play; small enough for seconds per run
GPU = [a.replace("--device=cpu", "--device=cuda").replace("--n_embd=32", "--n_embd=128")
       for a in TINY if not a.startswith("--dtype")]
# bf16 logits against fp32 manual, relative to the largest logit: bf16 keeps 8 bits of mantissa (~4e-3 per
# rounding) and a 2-layer model compounds a handful of them
BF16_TOLERANCE = 3e-2
MASKED_TRAINING = AttnCall("cuda", torch.bfloat16, 64, needs_grad=True, seq_len=1024, masked=True)  # GPT-2's block


def runs(attn: str, dtype: torch.dtype, dropout: float = 0.0, training: bool = True) -> bool:
    call = AttnCall("cuda", dtype, 64, needs_grad=training, dropout_p=dropout, seq_len=32)
    return attention_problem(attn, call, IMPLEMENTATIONS[attn]) is None


# flex trains in test_compile_and_flex_train_together (fp16, compiled: one compile of its backward, not three); its
# bf16 forward and backward are the mask tests'
@pytest.mark.parametrize("attn,dtype", [(a, d) for a in IMPLEMENTATIONS for d in ("bfloat16", "float16") if a != "flex"])
def test_every_attention_trains_in_reduced_precision_or_says_why_not(char_data, tmp_path, attn, dtype):
    # catches: a kernel that crashes, NaNs under fp16 loss scaling, a refusal that is a traceback, no memory logged
    args = GPU + [f"--data_dir={char_data}", f"--attn={attn}", f"--dtype={dtype}", "--max_iters=4",
                  "--eval_interval=4", f"--out_dir={tmp_path}"]
    if not runs(attn, runtime.DTYPES[dtype]):
        with pytest.raises(UserError, match=f"attn='{attn}' cannot run for training on cuda"):
            train.main(args)
        return
    assert train.main(args) == 0
    losses = metrics(tmp_path, "train/step_loss")
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    assert 0 < metrics(tmp_path, "mem/peak_gb")[4]  # torch.cuda.max_memory_allocated, recorded per log line


def test_logits_of_every_implementation_agree_with_fp32_manual_within_the_bf16_tolerance():
    # catches: an implementation computing other attention on CUDA (a wrong mask alignment, scale or layout)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, vocab_size=512, n_layer=2, n_head=4, n_embd=256, attn="manual")).cuda().eval()
    x = torch.randint(512, (2, 256), device="cuda")
    with torch.no_grad():
        reference = model(x, x)[0].float()  # fp32, TF32 matmuls as every script runs them
        for attn in IMPLEMENTATIONS:
            if not runs(attn, torch.bfloat16, training=False):
                continue
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model.set_attention(attn)(x, x)[0].float()
            scaled = ((logits - reference).abs().max() / reference.abs().max()).item()
            assert scaled <= BF16_TOLERANCE, (attn, scaled)


@pytest.fixture(scope="module")
def default_bench(tmp_path_factory) -> dict:
    """`python bench.py`'s rows as a user runs it: GPT-2 124M, B=8, T=1024, every attn, padded and not; 3 timed
    rounds rather than 20 and 3 s for auto's measuring rather than 10 (what is checked is what ran, not its speed)."""
    out = tmp_path_factory.mktemp("bench")
    assert bench.main([f"--out_dir={out}", "--iters=3", "--attn_auto_budget=3"]) == 0
    assert bench_file(out, "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(bench_file(out, "train.json").read_text())


def test_the_audit_names_the_cuda_kernel_each_row_really_ran(default_bench):
    # catches: a forced backend that silently runs another kernel, or an audit that misreads CUDA's op names
    rows = {(r["attn"], r["pad_vocab"]): r for r in default_bench["rows"]}
    for attn, kernel in (("flash2", "flash"), ("efficient", "efficient"), ("cudnn", "cudnn"), ("math", "math")):
        row = rows[(attn, False)]
        assert row["status"] != "ok" or (row["kernel"] == kernel and row["kernel_ok"]), row
    # flash runs cuDNN's flash kernel where SDPA ranks it first (Hopper, Blackwell), else FlashAttention-2
    flash = rows[("flash", False)]
    first = "cudnn" if cudnn_first(*cuda_facts()) else "flash"
    assert flash["status"] == "ok" and flash["kernel_ok"] and first in flash["kernel"].split("+"), flash
    assert rows[("flex", False)]["status"] != "ok" or rows[("flex", False)]["kernel"] == "flex"  # compiled on CUDA
    assert rows[("sdpa_mask", False)]["kernel"] != "flash"  # an explicit mask rules the flash kernel out
    assert rows[("manual", False)]["kernel"] == "none"
    # what decided each kernel is on every row; the default sweep compiles each row once, none falls back
    major, minor = torch.cuda.get_device_capability()
    for row in (r for r in default_bench["rows"] if r["status"] == "ok" and r["attn"] != "auto"):
        assert row["compute_capability"] == f"{major}.{minor}"
        assert row["cudnn_version"] == torch.backends.cudnn.version()
        assert row["recompile_limit_hits"] == 0 and row["graph_breaks"] == 0, row


def test_mfu_is_between_1_and_100_percent_and_peak_memory_is_recorded(default_bench):
    # catches: a wrong datasheet peak or FLOP count (MFU off by 10x either way), CUDA memory not read
    ran = [r for r in default_bench["rows"] if r["status"] == "ok"]
    assert ran and all(0.01 < r["mfu"] < 1.0 and r["mem/peak_gb"] > 0 for r in ran), \
        [(r["attn"], r["mfu"], r["mem/peak_gb"]) for r in ran]


def test_compile_and_flex_train_together(char_data, tmp_path):
    # catches: flex's backward failing to compile on CUDA, or a compiled flex model that does not learn (and, as
    # for every attn above, NaNs under fp16 loss scaling or no memory logged)
    assert train.main(GPU + [f"--data_dir={char_data}", "--attn=flex", "--compile=True", "--dtype=float16",
                             "--max_iters=20", "--eval_interval=20", f"--out_dir={tmp_path}"]) == 0
    val, losses = metrics(tmp_path, "val/loss"), metrics(tmp_path, "train/step_loss")
    assert val[20] < val[0]
    assert sorted(losses) == list(range(1, 21)) and all(math.isfinite(v) for v in losses.values())
    assert 0 < metrics(tmp_path, "mem/peak_gb")[20]


def test_resume_continues_the_same_losses_in_fp32(char_data, tmp_path):
    # catches: CUDA RNG state or optimizer state not restored on resume
    straight, stopped = straight_and_resumed(
        GPU + [f"--data_dir={char_data}", "--attn=manual", "--dtype=float32", "--eval_interval=3"], tmp_path)
    straight, resumed = metrics(straight, "train/step_loss"), metrics(stopped, "train/step_loss")
    for i in (4, 5, 6):  # CUDA's embedding backward adds with atomics, so allow its last-bit wobble
        assert resumed[i] == pytest.approx(straight[i], abs=1e-5)


def test_sample_compare_all_finishes_on_the_gpu(tmp_path, monkeypatch):
    # catches: a CUDA implementation whose cached decoding differs from its cache-free decoding, or a crash in
    # --compare's numerics. Greedy fp32 with TF32 off: every path then rounds alike, so equality is the bar (in
    # bf16 at temperature 0.8 different kernels round differently and one flipped sample diverges for good).
    real_resolve = runtime.resolve_runtime

    def fp32_without_tf32(*args, **kwargs):
        rt = real_resolve(*args, **kwargs)  # turns TF32 on, as for every script
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        return rt
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)  # restored after
    monkeypatch.setattr(runtime, "resolve_runtime", fp32_without_tf32)
    chars = sorted(set("\n .,;:!?'-" + string.ascii_letters))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=len(chars), n_layer=2, n_head=2, n_embd=128))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits: few near ties
    checkpoint_of(model, iter_num=1, meta={"tokenizer": "char", "vocab_size": len(chars), "chars": chars}).save(
        tmp_path / "ckpt.pt")
    assert sample.main([f"--out_dir={tmp_path}", "--compare=all", "--num_samples=1", "--max_new_tokens=40",
                        "--temperature=0", "--dtype=float32", "--start=To be",
                        f"--json={tmp_path / 'compare.json'}"]) == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    assert set(report["implementations"]) | set(report["skipped"]) == set(IMPLEMENTATIONS)
    assert all(r["cache_equals_no_cache"] for r in report["implementations"].values())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("top_k", [None, 200])
def test_decoding_never_synchronizes_the_gpu(compiled, top_k):
    """torch.cuda.set_sync_debug_mode("error") around a whole generation, warmed up first (the checks and compiling
    may wait; a token may not): sampling with and without top_k, past block_size (every step a prefill) included."""
    torch.manual_seed(0)
    model = for_inference(GPT(GPTConfig(block_size=32, vocab_size=512, n_layer=2, n_head=2, n_embd=128)), "cuda",
                          torch.bfloat16)
    decoder = Decoder(model, compile=compiled)
    x = torch.randint(512, (2, 5), device="cuda")
    generator = torch.Generator("cuda").manual_seed(0)
    decoder.generate(x, 40, temperature=1.0, top_k=top_k, generator=generator)  # warm-up: 5 + 40 > block_size
    torch.cuda.set_sync_debug_mode("error")
    try:
        decoder.generate(x, 40, temperature=1.0, top_k=top_k, generator=generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("attn", list(IMPLEMENTATIONS))
def test_every_attention_generates_the_cache_free_tokens_eager_and_compiled_or_says_why_not(attn, monkeypatch):
    """fp32 where the kernel takes it (TF32 off: the three paths then round alike), else bf16, where paths that
    sum in another order may flip a near tie: there 95% of the tokens must agree.
    Catches: a cache or decode mask that differs from cache-free attention on CUDA; a compiled decode step that is
    no CUDA graph (a skipped cudagraph) or that recompiles at every position."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    dtype = torch.float32 if runs(attn, torch.float32, training=False) else torch.bfloat16
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=128, attn=attn))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits: few near ties
    model = for_inference(model, "cuda", dtype)
    x = torch.randint(512, (2, 5), device="cuda")
    if not runs(attn, dtype, training=False):
        with pytest.raises(UserError, match=f"attn='{attn}' cannot run for inference on cuda"):
            Decoder(model).generate(x, 4)
        return
    plain = Decoder(model).generate(x, 70, temperature=0.0, use_cache=False)  # 5 + 70 > block_size 64: refills too

    def agrees(tokens, reference):
        if dtype == torch.float32:
            return torch.equal(tokens, reference)
        return (tokens == reference).float().mean() >= 0.95
    assert agrees(Decoder(model).generate(x, 70, temperature=0.0), plain)
    if not decodes_with_mask(attn, IMPLEMENTATIONS[attn], "cuda", dtype, 64):  # flash: compiled is refused
        with pytest.raises(UserError, match=f"attn='{attn}' takes no mask on cuda"):
            Decoder(model, compile=True)
        return
    # compiled: from a one-token prompt, 60 tokens within block_size, so only the decode step compiles (the
    # compiled prefill and a refill are the window test's and the CPU suite's): one compile per implementation
    one = x[:, :1]
    plain = Decoder(model).generate(one, 60, temperature=0.0, use_cache=False)
    torch._dynamo.reset()
    counters.clear()
    decoder = Decoder(copy.deepcopy(model), compile=True)
    assert agrees(decoder.generate(one, 60, temperature=0.0), plain)  # warm-up: compiles, records the CUDA graph
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert agrees(decoder.generate(one, 60, temperature=0.0), plain)  # every shape met before: no recompile
    assert counters["inductor"]["cudagraph_skips"] == 0  # the decode step really ran as a CUDA graph


def test_int8_weights_and_the_generate_benchmark_run_on_the_gpu(tmp_path):
    """catches: torchao's int8 path failing on CUDA, a silent kernel fallback in generation, int8 bytes not saved.
    A 2-layer model, int8 rows only (every cache mode compiles the same way at any size; bf16 and fp32 decoding, eager
    and compiled, are the tests above's). torchao is not on every GPU image: carry its wheel (docs/tests.md)."""
    pytest.importorskip("torchao", reason="int8 weights need torchao")
    assert bench.main(["--mode=generate", "--attn=sdpa", "--n_layer=2", "--n_head=4", "--n_embd=256",
                       "--vocab_size=512", "--seq_len=128", "--weights=int8", "--new_tokens=32", "--iters=1",
                       f"--out_dir={tmp_path}"]) == 0
    rows = json.loads(bench_file(tmp_path, "generate.json").read_text())["rows"]
    ran = [r for r in rows if r["status"] == "ok"]
    assert {r["cache"] for r in ran if r["attn"] == "sdpa"} == {"none", "cache", "compiled"}
    assert all(r["kernel_ok"] for r in ran)
    int8 = next(r for r in ran if (r["attn"], r["cache"]) == ("sdpa", "cache"))
    bf16 = for_inference(GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, vocab_size=512, block_size=128)), "cuda",
                         torch.bfloat16)
    # 1.57M block weights and lm_head's 0.13M in int8, the tied embedding it was copied from and wpe still bf16
    assert int8["weight_bytes"] < 0.85 * weight_bytes(bf16)


def test_the_max_batch_search_returns_a_batch_that_really_trains():
    # catches: a max-batch search that reports a batch that then runs out of memory, or never finds a limit
    # 20 GiB of the GPU, whatever its size: CUDA's own out-of-memory errors after a few small trials, not dozens
    # of large ones (the allocator refuses past the fraction as it would past the card)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(20 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    try:
        cfg, rt = bench.settings(["--attn=manual", "--seq_len=2048", "--max_batch_limit=256"])
        found = measure.max_batch_size(lambda b: bench.fits(cfg, rt, "manual", False, b), cfg.max_batch_limit)
        assert 1 <= found < 256  # manual attention at T=2048 runs out of memory well before 256
        trainer = bench.build_trainer(cfg, rt, "manual", False, found)
        for _ in range(3):
            trainer.step("manual")
        rt.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gpus_match_one_process_with_the_same_global_batch(char_data, tmp_path, parallel):
    # catches: NCCL DDP/FSDP2 training on other data or with unsynchronised gradients
    common = GPU + [f"--data_dir={char_data}", "--dtype=float32", "--attn=manual", "--max_iters=4",
                    "--eval_interval=100", "--gradient_accumulation_steps=2"]
    run_train(common + [f"--out_dir={tmp_path / 'one'}"])
    run_train(common + [f"--parallel={parallel}", f"--out_dir={tmp_path / 'two'}"], nproc=2)
    one, two = metrics(tmp_path / "one", "train/step_loss"), metrics(tmp_path / "two", "train/step_loss")
    for it in one:
        assert two[it] == pytest.approx(one[it], abs=1e-4)  # NCCL's reduction order differs from one process


# -- document masks and windows ----------------------------------------------------------------------------

def documents_on_cuda(T: int = 1024, eot: int = 0) -> torch.Tensor:
    """(2, T) tokens, end-of-text every 100 to 300 tokens: blocks of 128 with nothing visible for flex to skip."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(1, 512, (2, T), generator=g)
    for row in range(2):
        p = 0
        while p < T:
            idx[row, p] = eot
            p += int(torch.randint(100, 300, (1,), generator=g))
    return idx.cuda()


@pytest.mark.parametrize("mask", [dict(doc_mask=True), dict(window=128), dict(doc_mask=True, window=128)])
def test_every_implementation_trains_every_mask_it_can_with_the_logits_and_gradients_of_fp32_manual(mask):
    # catches: varlen's packing (cu_seqlens, window_size) or flex's block mask computing other attention on CUDA, a
    # forced kernel taking a mask it silently ignores, and a refusal that is a traceback instead of one error line
    torch.manual_seed(0)
    config = GPTConfig(block_size=1024, vocab_size=512, n_layer=2, n_head=4, n_embd=256, eot_token=0,
                       chunked_loss=True, **mask)
    model = GPT(config).cuda()
    x = documents_on_cuda()
    ref_logits, ref_loss = model.set_attention("manual")(x, x, all_positions=True)  # the unchunked loss, fp32
    ref_loss.backward()
    ref_grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    for attn in IMPLEMENTATIONS:
        model.zero_grad()
        if attention_problem(attn, MASKED_TRAINING, IMPLEMENTATIONS[attn]) is not None:
            with pytest.raises(UserError, match=f"attn='{attn}' cannot run for training on cuda"):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    model.set_attention(attn)(x, x)
            continue
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model.set_attention(attn)(x, x)  # the chunked loss (ChunkedLMHeadLoss) on CUDA
            with torch.no_grad():
                logits, _ = model(x, all_positions=True)
        loss.backward()
        scaled = ((logits.float() - ref_logits.float()).abs().max() / ref_logits.float().abs().max()).item()
        assert scaled <= BF16_TOLERANCE, (attn, scaled)
        for name, grad in ref_grads.items():
            p = dict(model.named_parameters())[name]
            assert ((p.grad.float() - grad).abs().max() / grad.abs().max()).item() <= 0.1, (attn, name)
    assert attention_problem("varlen", MASKED_TRAINING, IMPLEMENTATIONS["varlen"]) is None
    assert attention_problem("flex", MASKED_TRAINING, IMPLEMENTATIONS["flex"]) is None


def test_flex_skips_the_blocks_documents_leave_empty_and_the_audit_names_varlen():
    # catches: a BlockMask that computes every block (no sparsity), and a varlen row audited as another kernel
    from attention import masks
    x = documents_on_cuda()
    block_mask = masks.block_mask(masks.document_ids(x, 0), 0, 1024, "cuda")
    assert block_mask.sparsity() > 70  # documents of 100-300 tokens in a 1024 block: most blocks hold nothing
    cfg, rt = bench.settings(["--mode=attention", "--attn=manual,flex,varlen", "--attn_seq_lens=1024",
                              "--attn_head_sizes=64", "--mask=doc", "--doc_len=256", "--iters=2",
                              "--dtype=bfloat16", "--out_dir=/tmp/bench_gpu_masks"])
    rows = {(r["attn"], r["backward"], r["mask"]): r for r in bench.attention_sweep(cfg, rt)}
    for backward in (False, True):
        assert rows[("varlen", backward, "doc")]["kernel"] == "varlen" and rows[("varlen", backward, "doc")]["kernel_ok"]
        assert rows[("flex", backward, "doc")]["computed"] == pytest.approx(4 * 3 / 64)  # 4 documents of 2 blocks


def test_cached_decoding_with_a_window_gives_the_cache_free_tokens_on_cuda(monkeypatch):
    # catches: a decode step that reads the whole cache where a window or a document should cut it, eager and compiled.
    # Greedy, fp32, TF32 off inside the test (earlier tests may leave it on): what differs between the paths is then
    # only the order of sums, which near-uniform sampling at temperature 1.0 could turn into another token
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, vocab_size=64, n_layer=1, n_head=4, n_embd=256, attn="sdpa", doc_mask=True,
                          window=32, eot_token=0)).cuda().eval()
    prompt = torch.randint(1, 64, (2, 8), device="cuda")
    prompt[0, 2] = prompt[1, 5] = 0  # end-of-text: each row's document opens at its own place
    plain = Decoder(model).generate(prompt, 64, 0.0, None, None, use_cache=False)  # 72 tokens: the window cuts
    for compile in (False, True):
        cached = Decoder(model, compile=compile).generate(prompt, 64, 0.0, None, None)
        assert torch.equal(cached, plain), compile
