"""model.py: every attention implementation computes the same GPT-2, padding is invisible, generation is exact."""

import dataclasses
import copy

import pytest
import torch
from torch.nn import functional as F

from attention import masks
import model as model_module
from benchmarks.measure import profiled_run
from core.runtime import Runtime

from engine.generate import Decoder
from model import IMPLEMENTATIONS
from attention.kernels import AttnCall, attention_problem, refuse_unless_runs
from benchmarks.compare import attention_names
from conftest import runnable_on_cpu
from model import GPT, GPTConfig
from core.errors import UserError

# What runs on this CPU for training; flex runs forward only (no backward on CPU).
CPU_TRAINABLE = runnable_on_cpu(training=True)
CPU_ALL = runnable_on_cpu(training=False)
TINY = dict(block_size=32, vocab_size=101, n_layer=2, n_head=4, n_embd=32)


def test_on_a_cpu_every_implementation_but_the_cuda_only_ones_runs_and_flex_only_for_inference():
    """torch 2.13's CPU kernels, as the registry's own check finds them: what the tests below parametrize over."""
    cuda_only = ("flash2", "efficient", "cudnn", "varlen")
    assert runnable_on_cpu(training=False) == [a for a in IMPLEMENTATIONS if a not in cuda_only]
    assert runnable_on_cpu(training=True) == [a for a in IMPLEMENTATIONS if a not in (*cuda_only, "flex")]


def tiny_model(attn="manual", pad_vocab=False, seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **kw}, attn=attn, pad_vocab=pad_vocab))


def with_attn(model: GPT, attn: str) -> GPT:
    """The same weights, read through another attention implementation."""
    return copy.deepcopy(model).set_attention(attn)


def batch(seed=1, B=3, T=32, vocab=101):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g), torch.randint(0, vocab, (B, T), generator=g)


def logits_and_grads(model: GPT, x, y, autocast_dtype=None):
    model.zero_grad()
    with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        _, loss = model(x, y)
        with torch.no_grad():
            logits, _ = model(x, all_positions=True)
    loss.backward()
    return logits.double(), {n: p.grad.double() for n, p in model.named_parameters()}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def reference():
    model = tiny_model()
    x, y = batch()
    ref_logits, ref_grads = logits_and_grads(with_attn(model, "manual").double(), x, y)
    return model, x, y, ref_logits, ref_grads


@pytest.mark.parametrize("attn", CPU_TRAINABLE)
def test_fp32_logits_and_gradients_match_float64_reference(reference, attn):
    model, x, y, ref_logits, ref_grads = reference
    logits, grads = logits_and_grads(with_attn(model, attn), x, y)
    assert rel_err(logits, ref_logits) <= 1e-5
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) <= 1e-5, name


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_flex_forward_matches_float64_reference(reference):
    model, x, y, ref_logits, _ = reference
    with torch.no_grad():  # eval: FlexAttention has no backward on a CPU, so set_attention refuses training mode
        logits, _ = copy.deepcopy(model).eval().set_attention("flex")(x, y)
    assert rel_err(logits.double(), ref_logits) <= 1e-5


@pytest.mark.parametrize("attn", [a for a in CPU_TRAINABLE if a != "manual"])
def test_bf16_autocast_error_is_at_most_twice_manual(reference, attn):
    model, x, y, ref_logits, ref_grads = reference
    manual_logits, manual_grads = logits_and_grads(with_attn(model, "manual"), x, y, torch.bfloat16)
    logits, grads = logits_and_grads(with_attn(model, attn), x, y, torch.bfloat16)
    assert rel_err(logits, ref_logits) <= 2 * rel_err(manual_logits, ref_logits)
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) <= 2 * rel_err(manual_grads[name], ref), name


# -- Hugging Face GPT-2 --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_gpt2():
    """A small randomly initialised GPT2LMHeadModel: no download."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def hf_logits(hf_model, attn_implementation: str, x):
    hf_model.set_attn_implementation(attn_implementation)
    with torch.no_grad():
        return hf_model(x).logits


@pytest.mark.parametrize("pad_vocab", [False, True])
@pytest.mark.parametrize("attn", CPU_ALL)
def test_logits_equal_hf_gpt2_eager_and_sdpa(hf_gpt2, attn, pad_vocab):
    hf = hf_gpt2
    config = GPTConfig(**TINY, attn=attn, pad_vocab=pad_vocab, gelu="tanh")
    model = GPT(config).eval()
    model.load_state_dict(model_module.from_hf_names(hf.state_dict(), config))
    x, y = batch()
    with torch.no_grad():
        logits, _ = model(x, y)
    assert logits.size(-1) == (128 if pad_vocab else 101)
    for impl in ("eager", "sdpa"):
        expected = hf_logits(hf, impl, x)
        assert (logits[..., :101] - expected).abs().max().item() <= 1e-4, impl
    if pad_vocab:
        assert torch.isneginf(logits[..., 101:]).all()


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "bin"])
def test_from_pretrained_reads_a_local_hf_directory(hf_gpt2, tmp_path, safe_serialization):
    hf_gpt2.save_pretrained(tmp_path, safe_serialization=safe_serialization)
    x, _ = batch()
    expected = hf_logits(hf_gpt2, "eager", x)[:, -1]
    for pad_vocab in (False, True):
        model = GPT.from_pretrained(str(tmp_path), dict(attn="sdpa", pad_vocab=pad_vocab)).eval()
        with torch.no_grad():
            logits, _ = model(x)
        assert (logits[:, -1, :101] - expected).abs().max().item() <= 1e-4


def test_from_pretrained_without_weights_says_what_to_pass(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        GPT.from_pretrained(str(tmp_path))


# -- vocab padding ---------------------------------------------------------------------------------------

def test_padded_loss_equals_unpadded_loss_for_the_same_weights():
    unpadded = tiny_model(pad_vocab=False)
    padded = tiny_model(pad_vocab=True)
    state = unpadded.state_dict()
    for key in ("transformer.wte.weight", "lm_head.weight"):
        state[key] = torch.cat([state[key], 5.0 * torch.randn(128 - 101, TINY["n_embd"])])
    padded.load_state_dict(state)
    x, y = batch()
    assert padded.config.padded_vocab_size == 128
    assert torch.allclose(padded(x, y)[1], unpadded(x, y)[1], rtol=0, atol=1e-6)


def test_targets_may_be_a_strided_slice_of_the_token_tensor():
    model = tiny_model()
    tokens = batch(T=33)[0]  # (B, T + 1)
    x, y = tokens[:, :-1], tokens[:, 1:]  # both views with row stride 33: neither is contiguous
    assert not y.is_contiguous()
    _, loss = model(x, y)
    logits, _ = model(x, all_positions=True)
    expected = -logits.log_softmax(-1).gather(-1, y.unsqueeze(-1)).mean()  # mean next-token NLL, by hand
    assert torch.allclose(loss, expected, rtol=0, atol=1e-6)


def test_gpt2_vocab_pads_to_50304():
    assert GPTConfig(pad_vocab=True).padded_vocab_size == 50304
    assert GPTConfig(pad_vocab=False).padded_vocab_size == 50257


def test_padded_ids_are_never_sampled_even_when_their_logits_would_win():
    model = tiny_model(pad_vocab=True).eval()
    with torch.no_grad():
        model.lm_head.weight[101:] = 100.0 * torch.randn(128 - 101, TINY["n_embd"])
    x, _ = batch(B=4, T=4)
    with torch.no_grad():
        hidden = model.transformer.ln_f(model.transformer.wte(x) + model.transformer.wpe(torch.arange(4)))
        raw = hidden @ model.lm_head.weight.t()
    assert (raw.argmax(-1) >= 101).float().mean() > 0.5  # the padded rows would win without the mask
    out = Decoder(model).generate(x, 40, temperature=2.0, generator=torch.Generator().manual_seed(0))
    assert out.max().item() < 101
    greedy = Decoder(model).generate(x, 10, temperature=0)
    assert greedy.max().item() < 101


# -- generation ---------------------------------------------------------------------------------------------

# the KV cache against cache-free decoding, for every implementation, is test_generate.py's and test_masks.py's


def test_the_same_seed_gives_the_same_tokens_and_prompts_longer_than_block_size_are_cropped():
    model = tiny_model().eval()
    prompt, _ = batch(B=1, T=40)  # longer than block_size=32
    a = Decoder(model).generate(prompt, 8, generator=torch.Generator().manual_seed(3))
    b = Decoder(model).generate(prompt, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (1, 48)
    assert torch.equal(a[:, :40], prompt)


# -- torch.compile ---------------------------------------------------------------------------------------

# manual and flex in the fast tier (the plain math, and the one that builds block masks); the SDPA rows, which differ
# only in the backend they force, in the slow one (~0.6 s each)
@pytest.mark.parametrize("attn", [a if a in ("manual", "flex") else pytest.param(a, marks=pytest.mark.slow)
                                  for a in CPU_ALL])
def test_dynamo_finds_no_graph_break(attn):
    torch._dynamo.reset()
    model = tiny_model(attn)
    x, y = batch()
    with torch.set_grad_enabled(attn != "flex"):
        explanation = torch._dynamo.explain(model)(x, y)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("attn", CPU_TRAINABLE)
def test_compiled_forward_and_backward_equal_eager(attn):
    torch._dynamo.reset()
    model = tiny_model(attn)
    x, y = batch()
    eager_logits, eager_grads = logits_and_grads(model, x, y)
    compiled = copy.deepcopy(model)
    compiled.compile()
    logits, grads = logits_and_grads(compiled, x, y)
    assert rel_err(logits, eager_logits) <= 1e-5
    for name, g in eager_grads.items():
        assert rel_err(grads[name.replace("_orig_mod.", "")], g) <= 1e-5, name


@pytest.mark.slow
def test_compiled_flex_forward_equals_eager():
    torch._dynamo.reset()
    model = tiny_model("flex").eval()
    x, y = batch()
    with torch.no_grad():
        eager_logits, _ = model(x, y)
        compiled = copy.deepcopy(model)
        compiled.compile()
        logits, _ = compiled(x, y)
    assert rel_err(logits.double(), eager_logits.double()) <= 1e-5


@pytest.mark.slow
def test_a_sweep_of_every_compiled_flex_use_stays_within_its_recompile_limits(monkeypatch):
    """CUDA compiles every flex call. Its uses - fp32 and bf16, prompts of any length, decode steps at every
    position, the availability probes - must never pass dynamo's recompile limit, past which flex would run eagerly
    without a word. Run here by compiling CPU flex as CUDA does (inference only: CPU flex has no backward), with
    dynamo raising at a limit instead of falling back."""
    import model
    from conftest import strict_recompile_limit
    monkeypatch.setattr(model, "COMPILE_FLEX_OFF_CUDA", True)
    model.compiled_flex.cache_clear()
    attention_problem.cache_clear()
    torch._dynamo.reset()
    flex, generator = IMPLEMENTATIONS["flex"], torch.Generator().manual_seed(0)
    try:
        with strict_recompile_limit(), torch.no_grad():
            for dtype in (torch.float32, torch.bfloat16):
                cache = torch.randn(2, 1, 2, 64, 16, generator=generator).to(dtype)  # (k|v, B, nh, block, hs)
                for T in (5, 9, 17, 33, 64):  # prompts and training-length blocks
                    q = torch.randn(1, 2, T, 16, generator=generator).to(dtype)  # (B, nh, T, hs)
                    y = flex(q, cache[0][:, :, :T], cache[1][:, :, :T], None, 0.0)
                    reference = model.manual_attention(q.float(), cache[0][:, :, :T].float(),
                                                       cache[1][:, :, :T].float(), None, 0.0)
                    assert (y.float() - reference).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)
                for position in range(5, 40, 3):  # decode steps over the whole cache, keys [0, position] visible
                    span = masks.visible_mask("block", torch.zeros(1, dtype=torch.long), torch.tensor([position + 1]),
                                              64)
                    mask = torch.arange(64)[None, None, None, :] <= position  # (1, 1, 1, block): the same, densely
                    q = torch.randn(1, 2, 1, 16, generator=generator).to(dtype)
                    y = flex(q, cache[0], cache[1], span, 0.0)
                    reference = model.manual_attention(q.float(), cache[0].float(), cache[1].float(), mask, 0.0)
                    assert (y.float() - reference).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)
                assert attention_problem("flex", AttnCall("cpu", dtype, 16, seq_len=32), flex) is None
    finally:
        model.compiled_flex.cache_clear()
        attention_problem.cache_clear()
        torch._dynamo.reset()


# -- clear errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("attn,reason", [("efficient", "CUDA-only"), ("cudnn", "CUDA-only"), ("varlen", "CUDA-only")])
def test_cuda_only_kernels_on_cpu_say_why_and_what_runs(attn, reason):
    model = tiny_model(attn)
    x, y = batch()
    with pytest.raises(UserError, match=reason) as err:
        model(x, y)
    assert "manual, sdpa_mask, sdpa, flash, math" in str(err.value)


def test_flex_training_on_cpu_says_no_backward():
    model = tiny_model("flex")
    x, y = batch()
    with pytest.raises(UserError, match="no backward pass on CPU"):
        model(x, y)


def test_flash_with_dropout_on_cpu_is_refused_before_pytorch_aborts():
    with pytest.raises(UserError, match="has no attention dropout on CPU"):
        refuse_unless_runs("flash", AttnCall("cpu", torch.float32, 8, needs_grad=True, dropout_p=0.1), IMPLEMENTATIONS)
    call = AttnCall("cpu", torch.float32, 8, needs_grad=True, dropout_p=0.1)
    assert attention_problem("sdpa", call, IMPLEMENTATIONS["sdpa"]) is None  # math


def probe_with(monkeypatch, attn: str, fn) -> str:
    """attention_problem for `attn` with its function replaced by `fn`."""
    attention_problem.cache_clear()
    try:
        return attention_problem(attn, AttnCall("cpu", torch.float32, 8, needs_grad=True),
                                 dataclasses.replace(IMPLEMENTATIONS[attn], fn=fn))
    finally:
        attention_problem.cache_clear()


def test_a_kernel_declining_on_cpu_reports_pytorchs_reason_without_the_cpp_location(monkeypatch):
    """The CPU flash kernel really declining a call: C++ warns a header, then the reason, each ending in
    '(Triggered internally at <file>:<line>.)'."""
    flash = IMPLEMENTATIONS["flash"]

    def mismatched_v(q, k, v, mask, dropout_p):
        v = torch.cat([v, v], dim=-1)  # (B, nh, T, 2 hs): the flash kernel needs one head size for q, k and v
        return flash(q, k, v, mask, dropout_p)
    assert probe_with(monkeypatch, "flash", mismatched_v) == (
        "PyTorch has no kernel for it (Flash attention requires q,k,v to have the same last dimension. Got "
        "Query.size(-1): 8, Key.size(-1): 8, Value.size(-1): 16 instead)")


def test_a_forced_cuda_kernel_reports_its_own_reason_not_another_kernels(monkeypatch):
    """What CUDA warns for attn=flash in fp32 (torch 2.13's sdp_utils.cpp, word for word): every kernel's header in
    turn, efficient first, each line with its C++ location; the efficient kernel is only 'runtime disabled'."""
    import warnings

    def cuda_flash_in_fp32(q, k, v, mask, dropout_p):
        for text in ["Memory efficient kernel not used because:",
                     "Memory Efficient attention has been runtime disabled.",
                     "Flash attention kernel not used because:",
                     "Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float, "
                     "Key dtype: float, and Value dtype: float instead.",
                     "CuDNN attention kernel not used because:",
                     "CuDNN attention has been runtime disabled."]:
            warnings.warn(f"{text} (Triggered internally at /pytorch/aten/src/ATen/native/transformers/sdp_utils.cpp:1.)")
        raise RuntimeError("No available kernel. Aborting execution.")
    assert probe_with(monkeypatch, "flash", cuda_flash_in_fp32) == (
        "PyTorch has no kernel for it (Expected query, key and value to all be of dtype: {Half, BFloat16}. Got "
        "Query dtype: float, Key dtype: float, and Value dtype: float instead)")


def test_dropout_applies_in_training_only():
    model = tiny_model("sdpa", dropout=0.5)
    x, y = batch()
    model.eval()
    assert torch.equal(model(x, all_positions=True)[0], model(x, all_positions=True)[0])
    model.train()
    assert not torch.equal(model(x, all_positions=True)[0], model(x, all_positions=True)[0])


def test_unknown_attn_lists_the_valid_names():
    with pytest.raises(UserError, match="unknown attn 'fast'.*" + ", ".join(IMPLEMENTATIONS)):
        GPTConfig(attn="fast")


def test_attention_lists_accept_all_or_comma_separated_names():
    assert attention_names("all") == list(IMPLEMENTATIONS)
    with pytest.raises(UserError, match=r"^'all' stands alone, and all,sdpa names others beside it; pass all, or "):
        attention_names("all,sdpa")
    assert attention_names("sdpa, manual,sdpa") == ["sdpa", "manual"]
    with pytest.raises(UserError, match="unknown attn 'fast'; use all or a comma-separated list of manual"):
        attention_names("manual,fast")


def test_n_embd_not_divisible_by_n_head_is_refused():
    with pytest.raises(UserError, match="n_embd=30 is not divisible by n_head=4"):
        GPTConfig(n_embd=30, n_head=4)


def test_sequence_longer_than_block_size_is_refused():
    model = tiny_model()
    with pytest.raises(UserError, match="block_size is 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


# -- optimizer and FLOPs ---------------------------------------------------------------------------

def test_weight_decay_applies_to_2d_tensors_only():
    model = tiny_model()
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.dim() == 1 for p in plain["params"])
    n_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n_opt == sum(p.numel() for p in model.parameters())


def test_the_flops_per_token_estimate_matches_what_torch_counts_in_a_training_step():
    """6N + 12·L·C·T against torch's own FLOP counter over a forward and backward of manual attention (which
    computes the full T x T scores, as the formula assumes); biases and norms are the small difference."""
    from torch.utils.flop_counter import FlopCounterMode
    model = tiny_model(n_embd=64, n_head=4)
    x, y = batch(B=2, T=32)
    with FlopCounterMode(display=False) as counter:
        model(x, y)[1].backward()
    assert model.flops_per_token() * 2 * 32 == pytest.approx(counter.get_total_flops(), rel=0.03)


# -- the loss: lm_head and the cross-entropy over chunks of rows ---------------------------------------------

@pytest.fixture
def short_chunks(monkeypatch):
    """Chunks of 40 rows at vocab 128: the 96 rows of a (3, 32) batch end in a short chunk (three chunks of 32
    rounded up to a multiple of 10)."""
    monkeypatch.setattr(model_module, "LOSS_CHUNK_ELEMENTS", 40 * 128)
    monkeypatch.setattr(model_module, "LOSS_CHUNK_ROWS", 10)
    assert model_module.loss_chunk_rows(96, 128) == 40


def test_the_chunked_loss_and_gradients_match_a_float64_reference_with_padding_and_ignored_targets(short_chunks):
    model = tiny_model(pad_vocab=True, chunked_loss=True)  # 101 ids padded to 128: the -inf bias stays in the softmax
    x, y = batch()
    y[0, :5] = -1  # ignored, as F.cross_entropy(ignore_index=-1) ignores them
    reference = copy.deepcopy(model).double()
    _, expected = reference(x, y, all_positions=True)  # the whole logits and F.cross_entropy
    expected.backward()
    logits, loss = model(x, y)
    loss.backward()
    assert logits is None and loss.dtype == torch.float32
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad.double(), q.grad) <= 1e-5, name


def test_the_chunked_loss_under_bf16_autocast_matches_the_whole_logits_loss(short_chunks):
    model = tiny_model(pad_vocab=True, chunked_loss=True)
    x, y = batch()
    whole = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
        _, expected = whole(x, y, all_positions=True)
    (loss * 3.0).backward()  # a scaled loss (GradScaler, accumulation) scales the gradients saved in forward
    (expected * 3.0).backward()
    assert abs(loss.item() - expected.item()) <= 1e-2  # both bf16 matmuls, fp32 sums in another order
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        assert rel_err(p.grad.double(), q.grad.double()) <= 3e-2, name


def test_a_fresh_model_returns_nanogpts_logits_with_the_loss_and_the_chunked_loss_is_opt_in():
    """nanoGPT's model(idx, targets) returns the (B, T, V) logits and the loss, training or not; a notebook reads them.
    chunked_loss=True (what train.py and bench.py ask for) returns None logits and the same loss, in every mode."""
    model = tiny_model()
    x, y = batch()
    logits, loss = model(x, y)
    assert logits.shape == (3, 32, 101) and loss.requires_grad
    chunked = tiny_model(chunked_loss=True)
    for mode in (chunked.train, chunked.eval):
        mode()
        none, same = chunked(x, y)
        assert none is None and abs(same.item() - loss.item()) <= 1e-5
    assert chunked(x, y, all_positions=True)[0].shape == (3, 32, 101)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("ignored", ["none", "some", "all"])
def test_the_chunked_loss_is_f_cross_entropy_with_ignore_index_minus_1_on_every_target_value(short_chunks, grad,
                                                                                            ignored):
    """Chunked or whole, with gradients or not (evaluation): the same loss and gradients; all targets ignored gives
    F.cross_entropy's NaN loss and zero gradients (not NaN gradients); -100 (Hugging Face's ignore index) and ids
    past the vocabulary are refused as F.cross_entropy refuses them."""
    x, y = batch()
    y[0, :5] = -1 if ignored == "some" else y[0, :5]
    y[:] = -1 if ignored == "all" else y
    chunked, whole = tiny_model(pad_vocab=True, chunked_loss=True), tiny_model(pad_vocab=True)
    with torch.set_grad_enabled(grad):
        _, loss = chunked(x, y)
        _, expected = whole(x, y)
    assert torch.allclose(loss, expected, atol=1e-5, equal_nan=True) and (loss.isnan().item() == (ignored == "all"))
    if grad:
        loss.backward()
        expected.backward()
        for (name, p), q in zip(chunked.named_parameters(), whole.parameters()):
            assert torch.isfinite(p.grad).all() and torch.allclose(p.grad, q.grad, atol=1e-6), name
    for bad in (-100, 128):
        y[1, 3] = bad
        with pytest.raises((IndexError, RuntimeError)) as refused_whole:
            whole(x, y)
        with pytest.raises(type(refused_whole.value)):
            with torch.set_grad_enabled(grad):
                chunked(x, y)


def test_the_chunked_loss_never_holds_the_whole_logits(monkeypatch):
    rows, vocab, width = 1024, 4096, 64
    monkeypatch.setattr(model_module, "LOSS_CHUNK_ELEMENTS", 128 * vocab)  # 8 chunks
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g, requires_grad=True)
    targets = torch.randint(vocab, (rows,), generator=g)
    whole_logits = rows * vocab * 4  # bytes in fp32
    rt = Runtime("cpu", "float32")
    _, whole = profiled_run(lambda: F.cross_entropy(x @ weight.t(), targets).backward(), rt)
    _, chunked = profiled_run(
        lambda: model_module.ChunkedLMHeadLoss.apply(x, weight, None, targets, torch.float32).backward(), rt)
    assert whole >= 2 * whole_logits  # the logits, and their gradient or softmax beside them
    assert chunked < whole_logits / 2  # a chunk's logits and softmax, the gradients of x and of the weight


@pytest.mark.slow
def test_a_compiled_training_step_takes_the_chunked_loss_without_graph_breaks(short_chunks):
    torch._dynamo.reset()
    model = tiny_model(pad_vocab=True, chunked_loss=True)
    x, y = batch()
    eager = copy.deepcopy(model)
    _, loss = torch.compile(model, fullgraph=True)(x, y)  # fullgraph: a graph break raises
    loss.backward()
    _, expected = eager(x, y)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4, name


@pytest.mark.slow  # compiles with inductor
def test_a_compiled_chunked_loss_writes_its_logits_and_gradient_in_bf16_and_no_fp32_chunk():
    """Compiled (train.py's default), the fp32 logits, softmax and one-hot of a chunk are one fused pass: the only
    (rows, vocab) buffers inductor allocates are the bf16 matmul's output and the bf16 gradient."""
    import re
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    rows, vocab, width = 256, 512, 64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g, requires_grad=True)
    targets = torch.randint(vocab, (rows,), generator=g)
    loss_of = torch.compile(lambda x, w, t: model_module.ChunkedLMHeadLoss.apply(x, w, None, t, torch.bfloat16))
    loss, code = run_and_get_code(loss_of, x, weight, targets)
    buffers = re.findall(r"empty_strided_cpu\(\((\d+), (\d+)\), \(.*?\), (torch\.\w+)\)", "\n".join(code))
    chunk_sized = [dtype for r, v, dtype in buffers if (int(r), int(v)) == (rows, vocab)]
    assert chunk_sized and set(chunk_sized) == {"torch.bfloat16"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(F.linear(x, weight), targets)
    assert abs(loss.item() - expected.item()) <= 1e-2


def test_from_pretrained_on_another_model_type_names_it_before_reading_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}')
    with pytest.raises(UserError, match=rf"^{tmp_path} holds a Hugging Face 'llama' model whose config.json lacks "
                                        rf"n_positions, vocab_size, n_layer, n_head, n_embd, not GPT-2; pass a GPT-2"):
        GPT.from_pretrained(str(tmp_path))  # no weights there: refused on its config alone


# -- model.py lifts out --------------------------------------------------------------------------------------

BY_ITSELF = '''
import torch
from model import GPT, GPTConfig
for attn in ("manual", "sdpa_mask", "sdpa", "flash"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, attn=attn))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    x = torch.randint(0, 50, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    model.eval()
    cached = model.generate(x[:1, :3], 20, temperature=0)  # past block_size: the cache refills
    plain = x[:1, :3]
    for _ in range(20):  # nanoGPT's loop: the whole context again for every token
        logits, _ = model(plain[:, -16:])
        plain = torch.cat((plain, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(cached, plain), attn
    print(attn, "ok", round(loss.item(), 3))
for extra in (dict(doc_mask=True, eot_token=0), dict(attn="flex")):
    try:
        GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32, **extra))(x)
    except ValueError as e:
        print("refused:", e)
'''


def test_model_py_copied_by_itself_trains_and_generates_and_its_extras_say_they_need_the_repository(tmp_path):
    """nanoGPT's promise: people copy model.py into their own project. By itself (torch installed, nothing else of
    this repository) it trains a step and generates with the plain implementations; an extra says what it needs."""
    import shutil
    import subprocess
    import sys
    shutil.copy(model_module.__file__, tmp_path / "model.py")
    done = subprocess.run([sys.executable, "-c", BY_ITSELF], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": "", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:4]] == [[a, "ok"] for a in ("manual", "sdpa_mask", "sdpa", "flash")]
    assert lines[4:] == [f"refused: {what} needs the rest of the nanoGPT-attn repository (attention/, core/), which "
                         f"model.py copied by itself does not have; copy the whole repository, or do without {what}."
                         for what in ("a doc_mask or window mask", "attn='flex'")]


FROM_PRETRAINED = '''
import sys, torch, transformers
from model import GPT
hf = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval()
model = GPT.from_pretrained(sys.argv[1], dict(attn="sdpa", pad_vocab=True)).eval()  # nanoGPT's call
x = torch.randint(0, 101, (2, 16))
with torch.no_grad():
    ours = model(x, all_positions=True)[0][..., :101]
    print(model.config.vocab_size, model.config.padded_vocab_size, (ours - hf(x).logits).abs().max().item())
'''


def test_from_pretrained_works_from_model_py_copied_by_itself_on_a_local_hugging_face_folder(tmp_path, hf_gpt2):
    """nanoGPT's model.py reads GPT-2 through transformers inside from_pretrained; copied by itself, this one does
    too (a hub name where there is network, a local folder always)."""
    import shutil
    import subprocess
    import sys
    hf_gpt2.save_pretrained(tmp_path / "hf")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(model_module.__file__, alone / "model.py")
    done = subprocess.run([sys.executable, "-c", FROM_PRETRAINED, str(tmp_path / "hf")], cwd=alone,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    vocab, padded, diff = done.stdout.split()
    assert (vocab, padded) == ("101", "128") and float(diff) < 1e-4
