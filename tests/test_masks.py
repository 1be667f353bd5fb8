"""Document masks and sliding windows: every implementation computes the masked attention a float64 reference
computes, a document sees nothing of another, a token nothing beyond the window, flex skips exactly the empty
blocks, and decoding over the KV cache gives the cache-free tokens."""

import dataclasses
import copy

import pytest
import torch

import model
from model import IMPLEMENTATIONS
from attention import kernels
from attention import masks
from conftest import runnable_on_cpu
from benchmarks.bench_masks import block_fraction, mask_fraction
from engine.generate import Decoder
from tools import decoding
from model import GPT, GPTConfig
from core.errors import UserError

EOT = 0  # a small vocabulary, so end-of-text also turns up among sampled tokens
CPU_TRAINABLE = runnable_on_cpu(training=True)
CPU_ALL = runnable_on_cpu(training=False)
MASKS = {"doc": dict(doc_mask=True), "window": dict(window=6), "doc+window": dict(doc_mask=True, window=6)}
TINY = dict(block_size=48, vocab_size=23, n_layer=2, n_head=2, n_embd=32, eot_token=EOT)


def tiny_model(attn="manual", seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **kw}, attn=attn))


def documents(B=2, T=48, seed=1) -> torch.Tensor:
    """(B, T) tokens with end-of-text at different places in each row (documents of 1 to 20 tokens)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, TINY["vocab_size"], (2, 48), generator=g)
    idx[0, [5, 6, 25]] = EOT  # a one-token document between two
    idx[1, [0, 17, 40]] = EOT  # a row that opens with end-of-text
    return idx[:B, :T]


def reference_mask(idx: torch.Tensor, doc_mask: bool, window: int) -> torch.Tensor:
    """(B, 1, T, T) written out from the definition, query by query: query i sees the keys from the start of its
    document (the last end-of-text at or before i: end-of-text opens a document) and from i - window + 1, up to i."""
    B, T = idx.shape
    out = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        start = 0
        for i in range(T):
            if doc_mask and idx[b, i] == EOT:
                start = i
            out[b, 0, i, max(start, i - window + 1 if window else 0):i + 1] = True
    return out


def reference_run(model: GPT, idx, targets):
    """Logits and gradients of the same weights in float64, attention a plain softmax under reference_mask."""
    cfg = model.config
    ref = copy.deepcopy(model).double()
    ref.config = GPTConfig(**{**TINY, "attn": "manual"})  # the model builds no mask: the reference passes its own
    mask = reference_mask(idx, cfg.doc_mask, cfg.window)

    def softmax_attention(q, k, v, _mask, dropout_p):
        att = (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5  # (B, nh, T, T)
        return att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    for block in ref.transformer.h:  # what each layer calls: the model's resolved implementation, replaced
        block.attn.attend = softmax_attention
    logits, loss = ref(idx, targets, all_positions=True)  # the whole logits and F.cross_entropy: no chunks
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in ref.named_parameters()}


def rel_err(a, ref) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("attn", CPU_ALL)
def test_every_implementation_and_mask_matches_a_float64_reference(attn, mask):
    model = tiny_model(attn, **MASKS[mask])
    idx = documents()
    targets = torch.roll(idx, -1, dims=1)
    ref_logits, ref_grads = reference_run(model, idx, targets)
    trains = attn in CPU_TRAINABLE
    with torch.no_grad():
        logits, _ = model(idx, all_positions=True)
    assert rel_err(logits, ref_logits) <= 1e-5
    if trains:  # the chunked loss (ChunkedLMHeadLoss), train.py's: its gradients, checked here
        model.config.chunked_loss = True
        _, loss = model(idx, targets)
        loss.backward()
        for name, p in model.named_parameters():
            assert rel_err(p.grad, ref_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("attn", CPU_ALL)
def test_changing_one_document_changes_only_its_own_logits_under_doc_mask(attn):
    idx = documents(B=1)
    edited = idx.clone()
    edited[0, 7:25] = (edited[0, 7:25] % 22) + 1  # the third document (positions 6..24) rewritten, no end-of-text
    inside = torch.zeros(48, dtype=torch.bool)
    inside[7:25] = True
    for doc_mask in (True, False):
        model = tiny_model(attn, doc_mask=doc_mask).eval()
        with torch.no_grad():
            before, _ = model(idx, all_positions=True)
            after, _ = model(edited, all_positions=True)
        changed = (before - after).abs().amax(-1)[0] > 1e-5  # (T,)
        if doc_mask:
            assert torch.equal(changed, inside)  # its own positions change, no other position does
        else:
            assert changed[25:].all()  # causal attention carries the edit into every later document


@pytest.mark.parametrize("attn", CPU_ALL)
def test_tokens_beyond_the_window_have_no_influence(attn):
    """A token reaches back window - 1 positions per layer: with 2 layers and window 6, position i depends on
    positions i - 10 .. i and on none before."""
    model = tiny_model(attn, window=6).eval()
    idx = documents(B=1)
    edited = idx.clone()
    edited[0, 10] = (edited[0, 10] % 22) + 1
    with torch.no_grad():
        before, _ = model(idx, all_positions=True)
        after, _ = model(edited, all_positions=True)
    changed = (before - after).abs().amax(-1)[0] > 1e-6  # (T,)
    assert changed[10:21].all() and not changed[21:].any() and not changed[:10].any()


def test_flex_block_mask_sparsity_is_the_fraction_of_blocks_with_nothing_visible():
    T, block = 512, 128
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(1, 23, (2, T), generator=g)
    idx[0, [100, 300, 301, 450]] = EOT
    idx[1, [200]] = EOT
    for doc_mask, window in ((True, 0), (False, 64), (True, 64), (False, 0)):
        docs = masks.document_ids(idx, EOT) if doc_mask else None
        block_mask = masks.block_mask(docs, window, T, "cpu")
        dense = reference_mask(idx, doc_mask, window) if doc_mask else reference_mask(idx[:1], False, window)
        blocks = dense.view(dense.size(0), T // block, block, T // block, block).any(dim=(2, 4))  # (B, nq, nkv)
        assert block_mask.sparsity() == pytest.approx(100 * (1 - blocks.float().mean().item()))
        assert block_fraction(block_mask) == pytest.approx(blocks.float().mean().item())
        assert mask_fraction(dense) == pytest.approx(dense.float().mean().item())


def decoded(model: GPT, new_tokens: int = 40, temperatures=(0.0, 1.0), **kw) -> list[torch.Tensor]:
    """Tokens from two prompts (12 tokens; 40 new run past block_size=48, so the cache refills), with the cache
    (a Decoder made with **kw) and without it."""
    prompt = documents(T=12)
    return [[decoder.generate(prompt, new_tokens, temperature, None, torch.Generator().manual_seed(7),
                              use_cache=cache) for decoder, cache in ((Decoder(model, **kw), True),
                                                                      (Decoder(model), False))]
            for temperature in temperatures]


@pytest.mark.parametrize("attn", CPU_ALL)
def test_every_implementation_attends_over_exactly_the_keys_a_decode_steps_mask_names(attn):
    """A decode step's visible keys, one interval per row in the implementation's layout (masks.visible_mask): each
    implementation, called as a layer calls it, computes a softmax over exactly those keys of the cache - written
    out by hand here in float64 - with rows starting in their own documents, rows starting alike, and one start for
    every row."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 16, generator=g)  # (B, nh, 1, hs): one query per row
    k, v = torch.randn(2, 2, 2, 48, 16, generator=g)  # (B, nh, block, hs) each: the whole cache
    for starts in ([3, 17], [5, 5], [0]):
        span = masks.visible_mask(IMPLEMENTATIONS[attn].mask, torch.tensor(starts), torch.tensor([30]), 48)  # [s, 30)
        expected = torch.stack([
            ((q[b].double() @ k[b, :, s:30].double().transpose(-2, -1)) / 4.0).softmax(-1) @ v[b, :, s:30].double()
            for b, s in enumerate(starts * 2 if len(starts) == 1 else starts)])  # (B, nh, 1, hs)
        with torch.no_grad():
            got = IMPLEMENTATIONS[attn](q, k, v, span, 0.0)
        assert rel_err(got, expected) <= 1e-5, starts


def decoding_cases():
    """Every implementation with every mask; flex's in the slow tier: eager flex on CPU is PyTorch's unfused
    reference behind a compiled wrapper (~20 ms a call, seconds a case). What flex itself adds, reading a decode
    step's span per row, is the fast test above; its decoding without a mask is test_generate.py's."""
    for attn in CPU_ALL:
        for mask in MASKS:
            yield pytest.param(attn, mask, marks=pytest.mark.slow) if attn == "flex" else (attn, mask)


@pytest.mark.parametrize("attn, mask", list(decoding_cases()))
def test_cached_decoding_with_documents_and_a_window_gives_the_cache_free_tokens(attn, mask):
    runs = decoded(tiny_model(attn, **MASKS[mask]).eval())
    for cached, plain in runs:
        assert torch.equal(cached, plain)
    assert (runs[1][0][:, 12:] == EOT).any()  # sampling opened new documents while decoding


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "flex"])  # a dense mask's decode rows, and flex's score mod over them
def test_compiled_decoding_with_documents_and_a_window_gives_the_cache_free_tokens(attn, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(decoding, "AUTOTUNE", False)  # the same graphs, compiled in seconds
    (cached, plain), = decoded(tiny_model(attn, doc_mask=True, window=6).eval(), new_tokens=30, temperatures=(1.0,),
                               compile=True)
    assert torch.equal(cached, plain)
    assert (cached[:, 12:] == EOT).any()


def test_an_implementation_that_cannot_take_the_mask_is_refused_naming_what_can():
    with pytest.raises(UserError, match=r"attn='varlen' cannot run for training on cpu in float32 with "
                                        r"dropout=0.0, a document or window mask and head size 16: varlen_attn is "
                                        r"CUDA-only; use one of manual, sdpa_mask, sdpa, flash, math\."):
        tiny_model("varlen", doc_mask=True)(documents(), documents())


def test_doc_mask_without_an_end_of_text_token_is_refused_in_one_sentence():
    with pytest.raises(UserError, match="doc_mask needs the end-of-text token"):
        GPTConfig(**{**TINY, "eot_token": -1}, doc_mask=True)
    with pytest.raises(UserError, match="window must be at least 0, got -2"):
        GPTConfig(**TINY, window=-2)


def test_a_flash_like_kernel_without_a_mask_is_refused_for_masked_training(monkeypatch):
    """CUDA's flash kernel takes no mask: what the probe meets there, injected into the CPU flash path."""
    def no_mask_flash(q, k, v, mask, dropout_p):
        if mask is not None:
            raise RuntimeError("No available kernel. Aborting execution.")
        return model.sdpa_attention(q, k, v, None, dropout_p)
    training = kernels.AttnCall("cpu", torch.float32, 16, needs_grad=True)
    flash = dataclasses.replace(IMPLEMENTATIONS["flash"], fn=no_mask_flash)
    assert kernels.attention_problem("flash", training, flash) is None
    call = kernels.AttnCall("cpu", torch.float32, 16, needs_grad=True, masked=True)
    assert kernels.attention_problem("flash", call, flash).startswith("PyTorch has no kernel for it")


def fake_varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, -1)):
    """varlen_attn as torch 2.13 documents it, in plain tensor code: q (total_q, H, D), k and v (total_k, H, D);
    sequence n's queries attend within its keys, key j visible to query i when i - left <= j <= i + right (-1:
    unlimited), positions aligned to the sequence's end where it has fewer queries than keys (FlashAttention's
    bottom-right causal)."""
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32 and len(cu_seq_q) == len(cu_seq_k)
    assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) and max_k == int((cu_seq_k[1:] - cu_seq_k[:-1]).max())
    left, right = window_size
    out = torch.empty_like(q)
    for (q0, q1), (k0, k1) in zip(zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()),
                                  zip(cu_seq_k[:-1].tolist(), cu_seq_k[1:].tolist())):
        i = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)  # each query's position among the keys
        j = torch.arange(k1 - k0)[None, :]
        visible = (j <= i + right) & ((j >= i - left) if left >= 0 else True)
        att = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1]) / q.size(-1) ** 0.5  # (H, len_q, len_k)
        att = att.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", att, v[k0:k1])
    return out


def test_varlen_runs_inference_probes_and_a_one_query_call_over_the_written_keys(monkeypatch):
    """What CUDA would meet for every forward without gradients: the probe's one-query call against T keys."""
    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", fake_varlen_attn)
    varlen = IMPLEMENTATIONS["varlen"]
    assert kernels.probe("varlen", varlen, kernels.AttnCall("cpu", torch.float32, 16, seq_len=32)) is None
    q, k, v = torch.randn(3, 2, 2, 20, 16, generator=torch.Generator().manual_seed(1))  # (B, nh, T, hs) each
    one = varlen(q[:, :, -1:], k, v, None, 0.0)  # the last query over all 20 keys
    assert torch.allclose(one, model.manual_attention(q[:, :, -1:], k, v, None, 0.0), atol=1e-6)
    assert torch.allclose(one, varlen(q, k, v, None, 0.0)[:, :, -1:], atol=1e-6)


@pytest.mark.parametrize("mask", [*MASKS, "causal"])
def test_varlen_packs_each_document_of_each_row_as_one_sequence(mask, monkeypatch):
    """The CUDA-only varlen row, its packing and window convention checked on CPU against the dense reference, with
    varlen_attn replaced by what its documentation says it computes."""
    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", fake_varlen_attn)
    settings = MASKS.get(mask, {})
    idx = documents()
    q, k, v = torch.randn(3, 2, 2, 48, 16, generator=torch.Generator().manual_seed(0))  # (B, nh, T, hs) each
    docs = masks.document_ids(idx, EOT) if settings.get("doc_mask") else None
    packing = masks.build_mask("packed", docs, settings.get("window", 0), 2, 48, "cpu") if settings else None
    expected = model.manual_attention(q, k, v, reference_mask(idx, bool(docs is not None),
                                                              settings.get("window", 0)), 0.0)
    assert torch.allclose(model.varlen_attention(q, k, v, packing, 0.0), expected, atol=1e-6)
    if docs is not None:  # one sequence per document: rows 0 and 1 hold 4 each
        assert packing.cu_seqlens.tolist() == [0, 5, 6, 25, 48, 65, 88, 96]


def test_one_function_builds_what_a_decode_step_hands_attention_where_it_runs_is_probed_and_is_timed(monkeypatch):
    """A decode step, eager and compiled, the kernel probe and attn=auto's timing all hand attention what
    masks.decode_step builds, so what is probed and timed is what runs (the warm-ups meet its key lengths through
    the same decode_keys)."""
    import functools as ft
    from attention import attn_auto, kernels
    from model import IMPLEMENTATIONS, GPT, GPTConfig
    calls = []
    real = masks.decode_step

    @ft.wraps(real)
    def recorded(layout, end, window, block_size, takes_mask, device, dtype=None, doc_start=None):
        keys, row = real(layout, end, window, block_size, takes_mask, device, dtype, doc_start)
        calls.append((layout, end if isinstance(end, int) else ("compiled", end.tolist()), keys, row is not None))
        return keys, row
    monkeypatch.setattr(masks, "decode_step", recorded)
    kernels.attention_problem.cache_clear()
    model = GPT(GPTConfig(block_size=160, vocab_size=11, n_layer=1, n_head=2, n_embd=32, attn="sdpa")).eval()
    model.generate(torch.zeros(1, 130, dtype=torch.long), 3, temperature=0.0)  # a prefill, decode steps at 130, 131
    ran = [c for c in calls if c[1] in (131, 132)]
    assert ran == [("dense", 131, slice(0, 160), True), ("dense", 132, slice(0, 160), True)]  # 2 x 128 > 160: all
    model.setup_cache(1)
    with torch.no_grad():
        model(torch.arange(133)[None] % 11, input_pos=torch.arange(133))  # a prefill of 133
        eager = model(torch.ones(1, 1, dtype=torch.long), input_pos=133)[0]  # the step at 133, its position an int
        calls.clear()
        # a compiled step's position: a (1,) tensor (tools/decoding.py), run eagerly here with its trace's flag set
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        traced = model(torch.ones(1, 1, dtype=torch.long), input_pos=torch.tensor([133]))[0]
    monkeypatch.undo()
    monkeypatch.setattr(masks, "decode_step", recorded)
    assert calls == [("dense", ("compiled", [134]), slice(0, 160), True)]  # the whole cache, behind a row
    assert torch.allclose(traced, eager, atol=1e-6)  # the same keys seen
    calls.clear()
    kernels.attention_problem.cache_clear()
    assert kernels.attention_problem("sdpa", kernels.AttnCall("cpu", torch.float32, 16), IMPLEMENTATIONS["sdpa"]) \
        is None
    assert calls == [("dense", ("compiled", [16]), slice(0, 24), True),  # whether it takes a compiled step's row
                     ("dense", 64, slice(0, 72), True)]  # the probe's eager step at position 64 of a 72-key cache
    calls.clear()
    w = attn_auto.Workload("cpu", torch.__version__, 1, 24, 64, 2, 16, "float32", False, 0, 0.0, False, False, 3)
    attn_auto.attention_call(IMPLEMENTATIONS["manual"].fn, "dense", w, attn_auto.inputs(w, "cpu"), True)
    assert calls == [("dense", 24, slice(0, 64), True)]  # attn=auto's decode steps: the same function
    kernels.attention_problem.cache_clear()
