"""generate.py: the static KV cache, compiled or not, gives the cache-free tokens; the decode step compiles once;
int8 weights stay close to fp32 and are quiet to import."""

import copy
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from core import runtime
from engine.generate import Decoder, Sampling, for_inference
from tools import decoding
from tools.decoding import quantize_int8
from engine.generate import tensor_bytes, weight_bytes
from model import IMPLEMENTATIONS, GPT, GPTConfig
from attention.kernels import decodes_with_mask
from core.errors import UserError
from conftest import runnable_on_cpu

REPO = Path(__file__).resolve().parent.parent
CPU_INFERENCE = runnable_on_cpu(training=False)  # every attn that runs inference on CPU
SMALL = dict(block_size=16, vocab_size=61, n_layer=2, n_head=2, n_embd=32)  # 61: padding rounds it up to 64


def small_model(attn="sdpa", pad_vocab=False, seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**SMALL, attn=attn, pad_vocab=pad_vocab)).eval()


def prompts(B=2, T=5, seed=1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def host_reads(monkeypatch) -> list:
    """Every read of a computed value (item, tolist, float, bool, ...) and every tensor made from host data
    (torch.tensor) that the project's own code makes: on CUDA each one waits for the device (a pageable copy, a
    sync), so a compiled decode step (a CUDA graph) could not run ahead of the host."""
    reads, project = [], str(REPO)

    def counted(real, name):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(project) and "/tests/" not in caller:
                reads.append(name)
            return real(*args, **kwargs)
        return call
    for name in ("item", "tolist", "__float__", "__bool__", "__int__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name), name))
    monkeypatch.setattr(torch, "tensor", counted(torch.tensor, "torch.tensor"))
    return reads


def as_compiled(model, idx, input_pos):
    """A step as tools/decoding.py's compiled steps call the model, uncompiled: a decode step's position a tensor."""
    from model import last_logits
    if isinstance(input_pos, int):
        input_pos = torch.full((1,), input_pos, device=idx.device)
    return last_logits(model, idx, input_pos)


@pytest.mark.parametrize("window", [0, 4])
def test_decoding_makes_no_host_read_per_token_in_the_loop_or_the_compiled_step(monkeypatch, window):
    """The compiled step's Python runs as it is traced (torch.compiler.is_compiling() true): stood in for here by
    running the eager step with that flag set, so every read its code would make shows, and by the loop around it."""
    from model import decode_tokens
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, attn="flash", window=window)).eval()
    x = prompts(B=1)
    expected = decode_tokens(model, x, 8, temperature=0)
    reads = host_reads(monkeypatch)
    assert torch.equal(decode_tokens(model, x, 8, temperature=0), expected) and reads == []  # eager
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(decode_tokens(model, x, 8, temperature=0, prefill=as_compiled, decode=as_compiled),
                       expected) and reads == []


class HostSyncs(TorchDispatchMode):
    """Every ATen op that on CUDA would make the host wait for the device or copy from the host: a scalar read
    (_local_scalar_dense, item), a tensor made from host data (lift_fresh: torch.tensor, or an index given as a
    Python list), a copy to the CPU, and ops whose output size the data decides (nonzero)."""
    SYNCING = ("aten._local_scalar_dense", "aten.item", "aten.lift_fresh", "aten.nonzero", "aten.masked_select")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        to_host = name in ("aten._to_copy", "aten.to") and str(kwargs.get("device", "")) == "cpu"
        if name.startswith(self.SYNCING) or to_host:
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("top_k", [None, 5])
@pytest.mark.parametrize("prompt_len", [5, SMALL["block_size"] + 3], ids=["within-block", "past-block"])
def test_a_decode_makes_no_op_that_would_sync_a_gpu(monkeypatch, compiled, top_k, prompt_len):
    """Every ATen op of a generation, traced on CPU: none would wait for a GPU or copy from the host, eager or as
    the compiled steps run (their Python as traced: torch.compiler.is_compiling() true), with top_k or without,
    within block_size and past it (where every step is a prefill). Decoding sees the ops the CPU runs, which are
    the ops CUDA runs; Python-level reads (tolist, cpu) are test_decoding_makes_no_host_read_per_token's."""
    from model import decode_tokens
    model = small_model("sdpa")
    x = prompts(B=2, T=prompt_len)
    generator = torch.Generator().manual_seed(0)
    decode_tokens(model, x, 4, temperature=1.0, top_k=top_k, generator=generator)  # the checks, asked once
    steps = {}
    if compiled:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        steps = dict(prefill=as_compiled, decode=as_compiled)
    with HostSyncs() as syncs:
        decode_tokens(model, x, 6, temperature=1.0, top_k=top_k, generator=generator, **steps)
    assert syncs.seen == []


def test_the_sync_tracer_sees_what_would_sync():
    """The tracer above can fail: a list index, a scalar read and torch.tensor are each seen."""
    x = torch.randn(2, 3, 4)
    with HostSyncs() as syncs:
        x[:, [-1], :]
        x.sum().item()
        torch.tensor([1, 2])
    assert syncs.seen == ["aten.lift_fresh", "aten._local_scalar_dense", "aten.lift_fresh"]


# -- the static KV cache -------------------------------------------------------------------------------------

# the padded vocabulary changes lm_head alone, apart from attention: every implementation unpadded, and one padded;
# eager flex (PyTorch's unfused reference, ~3 s here) in the slow tier
@pytest.mark.parametrize("attn, pad_vocab", [pytest.param(a, False, marks=pytest.mark.slow) if a == "flex" else (a, False)
                                             for a in CPU_INFERENCE] + [("sdpa", True)],
                         ids=[f"unpadded-{a}" for a in CPU_INFERENCE] + ["padded-sdpa"])
def test_eager_cached_tokens_equal_cache_free_tokens_across_block_size(attn, pad_vocab):
    model = small_model(attn, pad_vocab)
    # 5 + 20 > block_size=16: past it every step refills the cache, and sampling draws from the same generator
    for temperature, top_k in ((0.0, None), (0.9, 10)):
        cached, plain = (Decoder(model).generate(prompts(), 20, temperature, top_k, torch.Generator().manual_seed(7),
                                                 use_cache=use_cache) for use_cache in (True, False))
        assert torch.equal(cached, plain) and cached.shape == (2, 25)


def compiled_eager_and_cache_free(model: GPT, tune: bool) -> tuple[torch.Tensor, ...]:
    """Greedy and sampled tokens (5 prompt + 20 new, past block_size=16) three ways: compiled with the cache,
    eager with it, and without it."""
    torch._dynamo.reset()
    with mock.patch.object(decoding, "AUTOTUNE", tune):  # read as the decoder compiles
        decoder = Decoder(copy.deepcopy(model), compile=True)
    runs = []
    for temperature in (0.0, 1.0):  # sampling: every path draws from the same seeded generator
        runs.append([d.generate(prompts(), 20, temperature, None, torch.Generator().manual_seed(7), use_cache=cache)
                     for d, cache in ((decoder, True), (Decoder(model), True), (Decoder(model), False))])
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("attn", CPU_INFERENCE)
def test_compiled_cached_tokens_equal_eager_cached_and_cache_free_tokens(attn):
    # untuned: the same graphs (fullgraph decode over the masked cache, dynamic prefill), compiled in seconds. The
    # padded vocabulary only changes lm_head's bias, apart from attention: the tuned test below compiles it, padded
    # and not, so it is not crossed with every implementation here (each compile costs seconds)
    for compiled, eager, plain in compiled_eager_and_cache_free(small_model(attn), tune=False):
        assert torch.equal(compiled, eager) and torch.equal(eager, plain)


@pytest.mark.slow
@pytest.mark.parametrize("pad_vocab", [False, True], ids=["unpadded", "padded"])
def test_the_tuned_decode_step_with_frozen_weights_gives_the_same_tokens(pad_vocab):
    (greedy, _, greedy_plain), (sampled, _, sampled_plain) = compiled_eager_and_cache_free(
        small_model("sdpa", pad_vocab), tune=True)
    assert torch.equal(greedy, greedy_plain) and torch.equal(sampled, sampled_plain)
    assert len(set(sampled[0, 5:].tolist())) > 5  # sampled text: many distinct tokens, past block_size too


@pytest.mark.slow
def test_the_compiled_decode_step_compiles_once_for_every_position():
    torch._dynamo.reset()
    decoder = Decoder(small_model("sdpa"), compile=True)
    counters.clear()
    decoder.generate(prompts(T=3), 2, temperature=0.0)  # a prefill (3 tokens) and a decode step (position 3)
    assert counters["stats"]["unique_graphs"] == 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        # positions 3 to 15, then refills of the whole block past it, and another prompt length
        decoder.generate(prompts(T=3), 30, temperature=0.0)
        decoder.generate(prompts(T=7), 5, temperature=0.0)
    assert counters["stats"]["unique_graphs"] == 2


def test_batched_prompts_give_each_prompt_its_own_tokens():
    model = small_model()
    together = Decoder(model).generate(prompts(B=3), 15, temperature=0.0)
    alone = torch.cat([Decoder(model).generate(prompts(B=3)[i:i + 1], 15, temperature=0.0) for i in range(3)])
    assert torch.equal(together, alone)


def test_a_kernel_without_masks_decodes_exactly_the_written_positions(monkeypatch):
    """CUDA's flash kernel takes no mask: eager decoding reads the written positions alone, with no mask (so any
    kernel runs it), and a compiled decode step, which needs one, is refused with one error line (run here by making
    CPU flash claim what CUDA's does)."""
    model = small_model("flash")
    expected = Decoder(model).generate(prompts(), 20, temperature=0.0, use_cache=False)
    monkeypatch.setattr("tools.decoding.decodes_with_mask", lambda *args: False)
    assert torch.equal(Decoder(model).generate(prompts(), 20, temperature=0.0), expected)
    with pytest.raises(UserError, match="attn='flash' takes no mask on cpu, and a compiled decode step"):
        Decoder(model, compile=True)


def test_the_compiled_decode_gate_asks_about_the_dtype_decoding_runs_in_not_the_weights(monkeypatch):
    """cuDNN on CUDA takes a decode mask in bf16 and refuses fp32: compare.py decodes fp32 weights under bf16
    autocast, so the gate must ask about bf16 (run here by making CPU sdpa answer as cuDNN would)."""
    asked = []

    def like_cudnn(attn, fn, device_type, dtype, head_size):
        asked.append(dtype)
        return dtype == torch.bfloat16
    monkeypatch.setattr("tools.decoding.decodes_with_mask", like_cudnn)
    monkeypatch.setattr(runtime, "compile_isolated", lambda fn, **options: fn)  # the gate, not inductor
    model = small_model("sdpa")  # fp32 weights
    with pytest.raises(UserError, match="takes no mask on cpu"):
        Decoder(model, compile=True)
    assert Decoder(model, compile=True, dtype=torch.bfloat16).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert Decoder(model, compile=True).dtype == torch.bfloat16  # autocast's dtype, by default
    assert asked == [torch.float32, torch.bfloat16, torch.bfloat16]
    with pytest.raises(ValueError, match="compiled its steps for torch.bfloat16 and now decodes in torch.float32"):
        Decoder(model, compile=True, dtype=torch.bfloat16).generate(prompts(), 2, temperature=0.0)


def test_compare_builds_its_decoders_for_the_dtype_it_draws_in(monkeypatch):
    from benchmarks import compare
    made = []
    real = compare.Decoder
    monkeypatch.setattr(compare, "Decoder", lambda model, compile, dtype: made.append(dtype) or real(model, compile,
                                                                                                       dtype=dtype))
    comparison = compare.Comparison(rt=runtime.Runtime("cpu", "bfloat16"), reduced="bfloat16", prompt=[1, 2],
                      sampling=Sampling(1, 2, 0.0, None, 1), compile=False, x=torch.tensor([[1, 2, 3]]),
                      ref_logits=torch.zeros(3, SMALL["vocab_size"], dtype=torch.float64),
                      held_out=(torch.tensor([[1, 2, 3, 4]]), "a held-out text"))
    compare.compare_one(small_model("sdpa"), comparison, None)
    assert made == [torch.bfloat16]  # fp32 weights, bf16 autocast: the cache and the gate are bf16


def test_cpu_flash_takes_a_decode_mask():
    assert decodes_with_mask("flash", IMPLEMENTATIONS["flash"], "cpu", torch.float32, 16)
    assert not decodes_with_mask("efficient", IMPLEMENTATIONS["efficient"], "cpu", torch.float32, 16)  # CUDA-only


def test_positions_without_a_cache_are_refused():
    model = small_model()
    with pytest.raises(ValueError, match="call model.setup_cache"):
        model(prompts(B=1, T=1), input_pos=torch.tensor([0]))


def test_the_cache_holds_block_size_positions_per_layer_in_the_keys_dtype():
    model = small_model()
    model.setup_cache(3, torch.bfloat16)
    # k and v: 2 x layers x (batch, heads, block_size, head size) x 2 bytes
    assert model.cache_bytes() == 2 * 2 * (3 * 2 * 16 * 16) * 2
    assert weight_bytes(model) == weight_bytes(small_model())  # caches are not weights


# -- int8 weights ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(trained_char_run) -> GPT:
    """conftest's tiny char model trained for 150 steps: logits with real structure, so greedy tokens mean something."""
    from engine.reader import build_model, load_checkpoint
    return build_model(load_checkpoint(trained_char_run / "ckpt.pt")).eval()


def test_int8_logits_are_within_2_percent_of_fp32_and_greedy_tokens_agree(trained, char_data):
    import numpy as np
    val = torch.from_numpy(np.fromfile(char_data / "val.bin", dtype=np.uint16).astype(np.int64))
    x = val[:4 * 32].view(4, 32)  # (4, T): held-out text
    int8 = quantize_int8(copy.deepcopy(trained))
    with torch.no_grad():
        ref, _ = trained(x, all_positions=True)
        logits, _ = int8(x, all_positions=True)
    # weight-only int8 with one scale per output row: ~0.4% error per weight, a little more through 2 layers
    assert (logits - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.97
    prompt = x[:1, :8]
    assert torch.equal(Decoder(int8).generate(prompt, 40, temperature=0.0),
                       Decoder(trained).generate(prompt, 40, temperature=0.0))


def test_int8_weights_take_about_a_quarter_of_fp32_bytes():
    fp32 = small_model()
    int8 = quantize_int8(copy.deepcopy(fp32))
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        w32, w8 = (m.transformer.h[1].get_submodule(name).weight for m in (fp32, int8))
        # one byte per weight, plus a scale (and zero point) per output row
        assert 0.25 < tensor_bytes(w8) / tensor_bytes(w32) <= 0.32, name
    assert tensor_bytes(int8.lm_head.weight) / tensor_bytes(fp32.lm_head.weight) <= 0.32
    assert int8.transformer.wte.weight.dtype == torch.float32  # the embedding lookup stays as it was


def test_bf16_weights_halve_the_bytes():
    assert weight_bytes(for_inference(small_model(), "cpu", torch.bfloat16)) * 2 == pytest.approx(
        weight_bytes(small_model()), rel=0.02)  # the bool causal mask does not halve


def test_torchao_is_installed_only_by_those_who_quantize(monkeypatch):
    """transformers imports torchao wherever it is installed, and torchao's load warnings then follow every program
    that imports transformers (the README's Hugging Face snippet): a user installs it for int8, and is told so."""
    requirement = lambda line: line.split("#")[0].strip()  # noqa: E731
    assert "torchao" not in [requirement(line) for line in (REPO / "requirements.txt").read_text().splitlines()]
    assert "torchao" in [requirement(line) for line in (REPO / "requirements-dev.txt").read_text().splitlines()]
    for name in ("torchao", "torchao.quantization"):
        monkeypatch.setitem(sys.modules, name, None)  # as where it is not installed
    with pytest.raises(UserError, match=r"^--quantize=int8 needs torchao; pip install torchao\.$"):
        for_inference(small_model(), "cpu", torch.float32, "int8")


@pytest.mark.slow  # a fresh interpreter: torchao's import-time output can only be seen once per process
def test_importing_torchao_prints_nothing():
    code = ("import torch; from engine.generate import Decoder; from tools.decoding import quantize_int8; "
            "from model import GPT, GPTConfig; "
            "m = quantize_int8(GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=8))); "
            "print(Decoder(m).generate(torch.zeros(1, 1, dtype=torch.long), 3, temperature=0.0).shape)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "torch.Size([1, 4])\n" and result.stderr == ""


def test_a_vanishing_temperature_samples_the_likeliest_token_instead_of_overflowing():
    """Found by the settings' property test: --temperature=6.9e-109 made logits / temperature inf, and
    multinomial refused the NaN probabilities."""
    from model import sample_next
    logits = torch.tensor([[1.0, 3.0, 2.0, float("-inf")]])
    for temperature in (1e-300, 6.877919713494888e-109, 1e-3):
        assert sample_next(logits, temperature, None, torch.Generator().manual_seed(0)).item() == 1


# -- eager decoding presents attention a bounded set of shapes ------------------------------------------------------

def key_lengths(model: GPT) -> set:
    """Wrap every layer's attention: the (query, key) lengths it receives."""
    seen = set()
    for block in model.transformer.h:
        def record(q, k, v, mask, dropout_p, attend=block.attn.attend):
            seen.add((q.size(-2), k.size(-2)))
            return attend(q, k, v, mask, dropout_p)
        block.attn.attend = record
    return seen


@pytest.mark.parametrize("masks", [{}, dict(window=200), dict(doc_mask=True, eot_token=0)],
                         ids=["causal", "window", "documents"])
def test_a_generation_past_block_size_shows_attention_a_bounded_set_of_key_lengths(masks):
    """On a GPU a new key length can mean a new kernel plan (cuDNN builds one per shape): an eager decode step reads
    its keys in spans rounded up to a multiple of 128, so block_size + 100 tokens show at most block_size / 128 + 2
    key lengths, and the tokens are still the cache-free ones."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL, "block_size": 300}, **masks)).eval()
    x = prompts(B=2, T=5)
    expected = Decoder(model).generate(x, 395, temperature=0.0, use_cache=False)
    seen = key_lengths(model)
    assert torch.equal(Decoder(model).generate(x, 395, temperature=0.0), expected)
    lengths = {k for _, k in seen}
    assert len(lengths) <= 300 // 128 + 2, sorted(lengths)
    assert {k for q, k in seen if q == 1} <= {128, 256, 300}  # the decode steps' spans


def test_a_kernel_without_masks_reads_the_exact_keys_at_every_step(monkeypatch):
    """CUDA's flash takes no mask (and keeps no plan per shape): its decode steps read exactly the written keys."""
    monkeypatch.setattr("attention.kernels.decodes_with_mask", lambda *args: False)
    model = small_model("flash")
    seen = key_lengths(model)
    Decoder(model).generate(prompts(T=3), 8, temperature=0.0)
    assert {k for q, k in seen if q == 1} == set(range(4, 11))


def stale_document_case(compile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of a one-token prompt [5] through a cache that served [5, 0, 7, 8] (0: end-of-text) before, and
    through a fresh cache."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, doc_mask=True, eot_token=0)).eval()
    with mock.patch.object(decoding, "AUTOTUNE", False):  # the same graphs, compiled in seconds
        decoder = Decoder(model, compile=compile)
    logits = []
    steps = decoder.decode

    def keep(model, idx, input_pos):
        out = steps(model, idx, input_pos)
        logits.append(out)
        return out
    decoder.decode = keep
    model.setup_cache(1, torch.float32)  # kept across generations: generate reuses a cache it did not make
    decoder.generate(torch.tensor([[5, 0, 7, 8]]), 3, temperature=0.0)
    logits.clear()
    decoder.generate(torch.tensor([[5]]), 1, temperature=0.0)
    reused = logits[0]
    model.setup_cache(1, torch.float32)
    logits.clear()
    decoder.generate(torch.tensor([[5]]), 1, temperature=0.0)
    return reused, logits[0]


def test_a_one_token_prompt_over_a_reused_cache_starts_a_fresh_document():
    reused, fresh = stale_document_case(compile=False)
    assert torch.equal(reused, fresh)


@pytest.mark.slow
def test_a_compiled_one_token_prompt_over_a_reused_cache_starts_a_fresh_document():
    torch._dynamo.reset()
    reused, fresh = stale_document_case(compile=True)
    assert torch.allclose(reused, fresh, atol=1e-5)


@pytest.mark.parametrize("masks", [{}, dict(window=150)], ids=["causal", "window"])
def test_sampling_warms_up_every_attention_shape_its_timed_tokens_meet(masks, monkeypatch):
    """sample.py's speed line times no one-time kernel build: its untimed warm-up meets every (query, key) length."""
    from engine.generate import draw_samples
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL, "block_size": 300}, **masks)).eval()
    rt = runtime.resolve_runtime("cpu", "float32")
    seen = key_lengths(model)
    phases = []

    def timed(call, rt):  # runtime.time_call, noting which shapes each timed call met
        seen.clear()
        result = call()
        phases.append(set(seen))
        return result, 1.0
    monkeypatch.setattr(runtime, "time_call", timed)
    draw_samples(Decoder(model), [1, 2, 3, 4, 5], rt, Sampling(2, 420, 0.0, None, 0))
    warmup, timed_run = phases
    assert timed_run <= warmup and len(timed_run) > 3


