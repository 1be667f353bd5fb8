"""What the kernels need and say, tested on a CPU by standing in for what CUDA would report: refusals before anything
runs, cuDNN's masked-backward hazard, the kernel audit telling flex's eager reference from a generated kernel, dynamo's counters in a row, and
varlen's packing."""
from collections import Counter

import pytest
import torch

from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import flex_attention

import model
from attention import cuda, kernels, masks
from attention.kernels import AttnCall, refuse_unless_runs
from benchmarks import bench_masks, measure
from benchmarks.bench_report import compile_cell
from core import runtime
from core.runtime import Runtime
from engine.generate import Decoder
from model import IMPLEMENTATIONS, GPT, GPTConfig
from core.errors import UserError

def qkv(T=32, hs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, T, hs, generator=g) for _ in range(3)]


# -- refused before anything runs ---------------------------------------------------------------------------

TINY_MODEL = dict(block_size=16, vocab_size=11, n_layer=1, n_head=2, n_embd=8)


@pytest.mark.parametrize("attn", ["efficient", "cudnn", "varlen"])
@pytest.mark.parametrize("use", ["forward", "generate"])
def test_a_model_built_with_a_kernel_this_machine_lacks_is_refused_in_the_one_form_before_anything_runs(attn, use):
    """Without set_attention: the first call asks, so nothing runs but what was asked."""
    model = GPT(GPTConfig(**TINY_MODEL, attn=attn)).eval()
    x = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(UserError) as refused:
        model(x) if use == "forward" else model.generate(x, 3)
    sentence = str(refused.value)
    assert sentence.startswith(f"attn='{attn}' cannot run for inference on cpu in float32 with dropout=0.0 and head "
                               f"size 4: ") and "CUDA-only" in sentence and "; use one of manual, " in sentence


def test_set_attention_checks_the_mode_the_model_is_in_and_refuses_before_any_kernel_warns(recwarn, capfd):
    """GPT(...) is in training mode: flash with dropout on a CPU is refused for training there and then, not by
    the first step's kernel (with C++'s "Triggered internally at" warnings); in eval mode it runs."""
    model = GPT(GPTConfig(**TINY_MODEL, dropout=0.1))
    with pytest.raises(UserError, match=r"^attn='flash' cannot run for training on cpu in float32 with dropout=0.1 "
                                        r"and head size 4: the flash kernel has no attention dropout on CPU; use one of"):
        model.set_attention("flash")
    assert model.config.attn == "sdpa"  # unchanged
    assert model.eval().set_attention("flash").config.attn == "flash"  # inference: no dropout
    model(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(UserError, match=r"^attn='flash' cannot run for training "):  # the same model trained: asked
        model.train()(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    assert not [w for w in recwarn if "Triggered internally" in str(w.message)]
    assert "Triggered internally" not in capfd.readouterr().err


def test_set_attention_checks_the_dtype_autocast_gives_not_the_weights(monkeypatch):
    """What CUDA reports for FlashAttention, injected: fp16 and bf16 only. fp32 weights under bf16 autocast run it
    (the GPU run refused varlen there); outside autocast the sentence names float32."""
    real = kernels.attention_problem

    def cuda_like(attn, call, fn):
        if attn == "flash" and call.dtype == torch.float32:
            return "FlashAttention only supports fp16 and bf16"
        return real(attn, call, fn)
    monkeypatch.setattr(kernels, "attention_problem", cuda_like)
    model = GPT(GPTConfig(**TINY_MODEL)).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.set_attention("flash").config.attn == "flash"
        logits, _ = model(torch.zeros(1, 4, dtype=torch.long))  # the call asks again, in the dtype q has: bf16
    with pytest.raises(UserError, match=r"^attn='flash' cannot run for inference on cpu in float32 .*fp16 and bf16"):
        model(torch.zeros(1, 4, dtype=torch.long))  # the same model outside autocast: refused in the call's words
    with pytest.raises(UserError, match=r"in float32 .*fp16 and bf16"):
        model.set_attention("flash")


def test_kernel_context_records_what_cuda_reports(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91600)
    assert measure.kernel_context(Runtime("cuda:0", "bfloat16")) == dict(cudnn_version=91600,
                                                                         compute_capability="9.0")
    assert measure.kernel_context(Runtime("cpu", "float32")) == dict(cudnn_version=None, compute_capability=None)


# -- cuDNN's masked backward -----------------------------------------------------------------------------

def test_cudnn_nan_gradient_case_is_refused_when_forced_and_warned_where_sdpa_may_pick_cudnn(monkeypatch, capsys):
    hazard = cuda.cudnn_mask_hazard
    h100, new_cudnn, old_cudnn = (9, 0), 91600, 91000
    cudnn, sdpa_mask, sdpa, flash = (IMPLEMENTATIONS[a] for a in ("cudnn", "sdpa_mask", "sdpa", "flash"))
    assert "NaN gradients" in hazard(cudnn, True, True, 192, h100, old_cudnn)  # 192 = 128 + 64
    assert hazard(cudnn, True, True, 256, h100, new_cudnn) is None  # a multiple of 128
    assert hazard(cudnn, False, True, 192, h100, new_cudnn) is None  # no backward
    assert hazard(cudnn, True, False, 192, h100, new_cudnn) is None  # causal: no explicit mask
    assert "NaN gradients" in hazard(sdpa_mask, True, False, 64, h100, new_cudnn)  # its mask is explicit
    assert hazard(sdpa, True, True, 192, h100, old_cudnn) is None  # SDPA prefers cuDNN only past 9.15
    assert hazard(sdpa, True, True, 192, (8, 0), new_cudnn) is None  # nor on an A100
    assert "NaN gradients" in hazard(flash, True, True, 192, h100, new_cudnn)  # flash runs cuDNN's first there
    assert hazard(flash, True, True, 192, (8, 0), new_cudnn) is None  # FlashAttention-2 alone on an A100
    assert hazard(IMPLEMENTATIONS["flash2"], True, True, 192, h100, new_cudnn) is None

    monkeypatch.setattr(cuda, "cuda_facts", lambda device=None: (h100, new_cudnn))
    monkeypatch.setattr(kernels, "attention_problem", lambda *args, **kw: None)  # the probe: runs
    refuse_unless_runs("sdpa", AttnCall("cuda", torch.bfloat16, 64, needs_grad=True, seq_len=192, masked=True),
                    IMPLEMENTATIONS)
    err = capsys.readouterr().err.strip()
    assert err.startswith("note: attn='sdpa' may run cuDNN here: ") and "block_size that is a multiple of 128" in err
    assert err.count("\n") == 0


def test_cudnn_generates_from_a_one_token_prompt_without_a_cache(monkeypatch):
    # on CUDA cuDNN refuses a key length of 1 ("No available kernel"), the first step of cache-free generation from
    # a one-token prompt (the GPU suite met it on an H200); one visible key's value is the answer every kernel gives
    def cudnn_as_cuda_runs_it(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        if k.size(-2) == 1:
            raise RuntimeError("No available kernel. Aborting execution.")
        return model.manual_attention(q, k, v, attn_mask, dropout_p)
    monkeypatch.setattr(model.F, "scaled_dot_product_attention", cudnn_as_cuda_runs_it)
    monkeypatch.setattr(kernels, "attention_problem", lambda *args, **kw: None)  # the probe: cuDNN runs here
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=16, vocab_size=11, n_layer=1, n_head=2, n_embd=32)).eval()
    one = torch.tensor([[3], [5]])
    manual = Decoder(gpt.set_attention("manual")).generate(one, 6, temperature=0.0, use_cache=False)
    cudnn = Decoder(gpt.set_attention("cudnn")).generate(one, 6, temperature=0.0, use_cache=False)
    assert torch.equal(cudnn, manual)


# -- the audit: flex's eager reference is named -------------------------------------------------------------

def profiled_ops(call) -> set[str]:
    return measure.profiled_run(call, Runtime("cpu", "float32"))[0]


def test_the_audit_tells_flexs_eager_reference_from_the_other_kernels():
    q, k, v = qkv()
    eager_flex = profiled_ops(lambda: flex_attention(q, k, v))
    assert measure.kernel_of(eager_flex)[0] == "flex" and measure.ran_eager_flex(eager_flex)
    assert not measure.ran_eager_flex(profiled_ops(lambda: IMPLEMENTATIONS["math"](q, k, v, None, 0.0)))  # softmax too
    assert not measure.ran_eager_flex(profiled_ops(lambda: IMPLEMENTATIONS["manual"](q, k, v, None, 0.0)))
    assert measure.with_eager_flex("flex") == "flex_eager" and measure.with_eager_flex("flash+none") == "flash+none"
    row = measure.audited_row(dict(attn="flex"), dict(ops=eager_flex, ran_ops=eager_flex), "flex",
                              Runtime("cpu", "float32"))
    assert row["kernel"] == "flex_eager" and not row["kernel_ok"]  # compiled flex expected: a fallback
    reference = measure.audited_row(dict(attn="flex", eager_reference=True), dict(ops=eager_flex, ran_ops=eager_flex),
                                    "flex", Runtime("cpu", "float32"))
    assert reference["kernel_ok"]  # uncompiled on purpose: what the row expects


# -- dynamo's counters in a row ----------------------------------------------------------------------------

def test_a_rows_counters_catch_a_forced_recompile_past_its_limit_and_a_graph_break():
    torch._dynamo.reset()
    square = runtime.compile_isolated(lambda x: x * x, recompile_limit=1, backend="eager", dynamic=False)
    tally = Counter()
    for n in (4, 5, 6):  # static shapes: every new length is a recompile, and the limit is one graph
        measure.counted(lambda: square(torch.ones(n)), tally)()
    health = measure.compile_health(tally)
    assert health["graphs_compiled"] == 1 and health["recompile_limit_hits"] == 1 and health["graph_breaks"] == 0
    assert compile_cell(health) == "1 graphs, LIMIT HIT: eager"

    def breaks(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2
    broken, tally = torch.compile(breaks, backend="eager"), Counter()
    measure.counted(lambda: broken(torch.ones(3)), tally)()
    assert tally["graph_breaks"] >= 1 and tally["graphs_compiled"] == 2
    row = measure.audited_row(dict(attn="sdpa"), dict(ops={"aten::_scaled_dot_product_flash_attention_for_cpu"},
                                                      ran_ops=set(), recompile_limit_hits=1), "sdpa",
                              Runtime("cpu", "float32"))
    assert row["kernel"] == "flash" and not row["kernel_ok"]  # the right kernel, but a row that fell back
    assert compile_cell({}) == "-"
    torch._dynamo.reset()


# -- where the numbers come from -------------------------------------------------------------------------

def test_a_masked_rows_computed_share_comes_from_a_block_mask_built_where_the_row_runs(monkeypatch):
    docs = torch.arange(256).div(64, rounding_mode="floor")[None]  # (1, 256): four documents
    built_on, real = [], masks.block_mask

    def recording(row_docs, window, T, device):
        built_on.append((str(device), str(row_docs.device)))
        return real(docs, window, T, "cpu")  # the same mask, where this machine can build it
    monkeypatch.setattr(masks, "block_mask", recording)
    shares = bench_masks.fractions("flex", docs, 0, 256, device="meta")  # meta stands in for cuda:0
    assert built_on == [("meta", "meta")]  # the row's device, its documents moved there
    assert shares["computed"] == 0.5  # 128-blocks: of 2 x 2, the two diagonal ones hold visible scores


def test_varlen_packing_gives_every_document_its_own_sequence():
    g = torch.Generator().manual_seed(0)
    docs = torch.randint(0, 2, (3, 40), generator=g).cumsum(1)  # (3, 40): documents of random lengths
    packing = masks.varlen_packing(docs, 5, 3, 40, "cpu")
    starts = [r * 40 + t for r in range(3) for t in range(40) if t == 0 or docs[r, t] != docs[r, t - 1]]
    expected = starts + [120]
    assert packing.cu_seqlens.tolist() == expected and packing.cu_seqlens.dtype == torch.int32
    assert packing.max_len == max(b - a for a, b in zip(expected, expected[1:])) and packing.window == 5
    assert masks.varlen_packing(None, 0, 3, 40, "cpu").cu_seqlens.tolist() == [0, 40, 80, 120]


# -- attn=flash: the fastest flash kernel the device has --------------------------------------------------------

@pytest.mark.parametrize("capability, cudnn_version, first", [
    ((9, 0), 91900, (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)),  # H100/H200, torch 2.11's cuDNN
    ((10, 0), 91600, (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)),  # B200
    ((9, 0), 91000, (SDPBackend.FLASH_ATTENTION,)),  # a cuDNN SDPA itself does not rank first
    ((8, 0), 91900, (SDPBackend.FLASH_ATTENTION,)),  # A100: FlashAttention-2 is its kernel
])
def test_flash_runs_cudnns_flash_kernel_first_where_sdpa_ranks_it_first(monkeypatch, capability, cudnn_version, first):
    monkeypatch.setattr(model, "FLASH_KERNELS", {})
    monkeypatch.setattr(cuda, "cuda_facts", lambda device=None: (capability, cudnn_version))
    assert model.flash_kernels(torch.device("cuda")) == first
    assert model.flash_kernels(torch.device("cpu")) == (SDPBackend.FLASH_ATTENTION,)  # a CPU: unchanged


def test_flash_hands_sdpa_its_kernels_in_order_and_flash2_forces_flashattention2(monkeypatch):
    """What SDPA sees enabled, and in which priority, when attn=flash calls it (here a CPU told it is a Hopper GPU)."""
    seen = []

    def sdpa_reads_its_settings(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        order = [SDPBackend(b) for b in torch._C._get_sdp_priority_order()]
        enabled = {SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled(),
                   SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled(),
                   SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled(),
                   SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled()}
        seen.append([b for b in order if enabled.get(b)])
        return v
    monkeypatch.setattr(model.F, "scaled_dot_product_attention", sdpa_reads_its_settings)
    monkeypatch.setattr(model, "FLASH_KERNELS", {"cpu": (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)})
    q = torch.randn(1, 2, 8, 16)  # (B, nh, T, hs)
    IMPLEMENTATIONS["flash"](q, q, q, None, 0.0)
    IMPLEMENTATIONS["flash2"](q, q, q, None, 0.0)
    assert seen == [[SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], [SDPBackend.FLASH_ATTENTION]]
    assert torch.backends.cuda.math_sdp_enabled()  # the settings are restored after the call


def test_the_banner_names_the_flash_kernels_on_a_gpu_and_nothing_more_on_a_cpu(monkeypatch):
    monkeypatch.setattr(model, "FLASH_KERNELS", {})
    monkeypatch.setattr(cuda, "cuda_facts", lambda device=None: ((9, 0), 91900))
    flash = IMPLEMENTATIONS["flash"]
    assert flash.kernels_on(torch.device("cuda")) == "cuDNN's flash kernel, then FlashAttention-2"
    assert flash.kernels_on(torch.device("cpu")) == ""
    assert IMPLEMENTATIONS["flash2"].kernels_on(torch.device("cuda")) == ""  # its name says it
