"""nanoGPT's API on GPT: the calls karpathy/nanoGPT's train.py and sample.py make, with their arguments, give what
nanoGPT's own model.py gives - checked against numbers and loops written here, never against the model itself."""

import copy

import pytest
import torch
from torch.nn import functional as F

from model import GPT, GPTConfig
from core.errors import UserError

# nanoGPT's train.py: model_args = dict(n_layer, n_head, n_embd, block_size, bias, vocab_size, dropout)
MODEL_ARGS = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, bias=False, vocab_size=65, dropout=0.0)


def nanogpt_model(seed: int = 0, **changes) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**MODEL_ARGS, **changes}))


def ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, MODEL_ARGS["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def unique_params(model: GPT) -> list[torch.nn.Parameter]:
    """Each parameter once: the token embedding is tied to lm_head."""
    return list({id(p): p for p in model.parameters()}.values())


def nanogpt_keys(n_layer: int, bias: bool) -> set[str]:
    """The state dict keys of nanoGPT's GPT (torch >= 2: no causal-mask buffer), spelled out by hand."""
    def linear_or_norm(name: str) -> list[str]:
        return [f"{name}.weight"] + ([f"{name}.bias"] if bias else [])
    keys = ["transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight", *linear_or_norm("transformer.ln_f")]
    for i in range(n_layer):
        for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            keys += linear_or_norm(f"transformer.h.{i}.{part}")
    return set(keys)


def reference_generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                       top_k: int | None = None) -> torch.Tensor:
    """nanoGPT's sampling loop without any cache: every step forwards the whole (cropped) context."""
    block_size = model.config.block_size
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits, _ = model(idx[:, -block_size:])  # (B, 1, V): the last position only
            scaled = logits[:, -1, :] / temperature  # (B, V)
            if top_k is not None:
                kth = torch.topk(scaled, min(top_k, scaled.size(-1))).values[:, -1:]  # (B, 1)
                scaled = torch.where(scaled < kth, float("-inf"), scaled)
            drawn = torch.multinomial(F.softmax(scaled, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat([idx, drawn], dim=1)
    return idx


# -- construction, forward, parameters -----------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True])
def test_gptconfig_from_nanogpt_model_args_has_nanogpt_state_dict_keys(bias):
    model = nanogpt_model(bias=bias)
    assert set(model.state_dict()) == nanogpt_keys(MODEL_ARGS["n_layer"], bias)


def test_forward_without_targets_returns_the_last_positions_logits_only():
    model = nanogpt_model().eval()
    x, y = ids(3, 16), ids(3, 16, seed=2)
    with torch.no_grad():
        all_logits, loss = model(x, y)
        last, no_loss = model(x)
    assert all_logits.shape == (3, 16, 65) and last.shape == (3, 1, 65) and no_loss is None
    torch.testing.assert_close(last[:, 0], all_logits[:, -1])
    log_probs = all_logits.double().log_softmax(-1)  # (B, T, V)
    expected = -log_probs.gather(-1, y.unsqueeze(-1)).mean()  # mean negative log-likelihood of the targets
    assert abs(loss.item() - expected.item()) < 1e-5


def test_get_num_params_leaves_out_the_position_embedding_only_by_default():
    model = nanogpt_model()
    C, L, V, T = MODEL_ARGS["n_embd"], MODEL_ARGS["n_layer"], MODEL_ARGS["vocab_size"], MODEL_ARGS["block_size"]
    per_block = C + 3 * C * C + C * C + C + 4 * C * C + 4 * C * C  # bias=False: ln_1, c_attn, c_proj, ln_2, MLP
    total = V * C + T * C + L * per_block + C  # tied wte/lm_head once, wpe, blocks, ln_f
    assert model.get_num_params(non_embedding=False) == total
    assert model.get_num_params() == total - T * C


def test_configure_optimizers_decays_matrices_and_embeddings_not_biases_or_norms():
    model = nanogpt_model(bias=True)
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")  # nanoGPT's call and defaults
    assert isinstance(optimizer, torch.optim.AdamW)
    decay, no_decay = optimizer.param_groups
    L = MODEL_ARGS["n_layer"]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert len(decay["params"]) == 2 + 4 * L  # wte (= lm_head), wpe, and four matrices per block
    assert len(no_decay["params"]) == 8 * L + 2  # per block 2 norms x (weight, bias) + 4 Linear biases; ln_f's two
    named = dict(model.named_parameters())
    matrices = {id(p) for n, p in named.items() if n.endswith(".weight") and ".ln_" not in n}
    assert {id(p) for p in decay["params"]} == matrices
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in named.values()} - matrices
    assert all(g["lr"] == 6e-4 and g["betas"] == (0.9, 0.95) for g in optimizer.param_groups)


# -- MFU ---------------------------------------------------------------------------------------------------------

def test_estimate_mfu_is_the_fraction_of_an_a100s_bf16_peak():
    model = nanogpt_model()
    N = sum(p.numel() for p in unique_params(model)) - model.transformer.wpe.weight.numel()
    L, H, T = MODEL_ARGS["n_layer"], MODEL_ARGS["n_head"], MODEL_ARGS["block_size"]
    Q = MODEL_ARGS["n_embd"] // H
    batch_size, gradient_accumulation_steps, dt = 12, 1, 0.05  # nanoGPT's train.py on a CPU
    flops_per_iter = (6 * N + 12 * L * H * Q * T) * T * batch_size * gradient_accumulation_steps
    expected = flops_per_iter / dt / 312e12
    mfu = model.estimate_mfu(batch_size * gradient_accumulation_steps, dt)
    assert mfu == pytest.approx(expected, rel=1e-12) and 0 < mfu < 1
    assert model.estimate_mfu(12, 0.05, peak_flops=1e12) == pytest.approx(expected * 312, rel=1e-12)


def test_model_flops_utilization_keeps_the_projects_meaning_tokens_per_second_over_a_given_peak():
    model = nanogpt_model()
    N = sum(p.numel() for p in unique_params(model)) - model.transformer.wpe.weight.numel()
    L, C = MODEL_ARGS["n_layer"], MODEL_ARGS["n_embd"]
    expected = (6 * N + 12 * L * C * 8) * 5000 / 2e12  # 5000 tokens/s at sequence length 8 on a 2 TFLOP/s device
    assert model.model_flops_utilization(5000, 2e12, 8) == pytest.approx(expected, rel=1e-12)


# -- generate ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len", [5, 20], ids=["grows_past_block_size", "longer_than_block_size"])
@pytest.mark.parametrize("temperature,top_k", [(0.8, 200), (1.3, 5), (1.0, None), (1.0, 1)],
                         ids=["sample_py_defaults", "top_k_5", "no_top_k", "greedy_top_k_1"])
def test_generate_draws_nanogpts_tokens_from_the_same_seed(prompt_len, temperature, top_k):
    model = nanogpt_model().eval()
    x = ids(2, prompt_len)
    torch.manual_seed(1337)
    expected = reference_generate(model, x, 30, temperature=temperature, top_k=top_k)  # 30 > block_size 16
    torch.manual_seed(1337)
    y = model.generate(x, 30, temperature=temperature, top_k=top_k)
    assert y.shape == (2, prompt_len + 30)
    assert torch.equal(y[:, :prompt_len], x)
    assert torch.equal(y, expected)


def test_greedy_top_k_1_is_the_argmax_of_each_step():
    model = nanogpt_model(seed=3).eval()
    y = model.generate(ids(1, 4), 20, top_k=1)
    with torch.no_grad():
        for t in range(4, y.size(1)):
            logits, _ = model(y[:, max(0, t - 16):t])
            assert y[0, t].item() == logits[0, -1].argmax().item()


@pytest.mark.parametrize("training", [True, False], ids=["train_mode", "eval_mode"])
def test_generate_runs_without_grad_and_leaves_the_models_mode_and_buffers(training):
    model = nanogpt_model().train(training)
    buffers = {name for name, _ in model.named_buffers()}
    grad_enabled = []
    model.register_forward_hook(lambda *_: grad_enabled.append(torch.is_grad_enabled()))
    model.generate(ids(1, 3), 5)
    assert grad_enabled and not any(grad_enabled)
    assert model.training is training
    assert buffers == {name for name, _ in model.named_buffers()}  # no KV cache left behind


# -- from_pretrained, crop_block_size, checkpoints ------------------------------------------------------------

@pytest.fixture
def hf_dir(tmp_path):
    """A tiny random GPT2LMHeadModel saved as a Hugging Face directory: nothing is downloaded."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=65, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path)
    return tmp_path, hf


def test_from_pretrained_with_nanogpts_override_args_gives_transformers_logits(hf_dir):
    path, hf = hf_dir
    model = GPT.from_pretrained(str(path), dict(dropout=0.0)).eval()  # sample.py's call, with a local directory
    assert (model.config.n_layer, model.config.n_head, model.config.n_embd) == (2, 2, 32)
    assert (model.config.block_size, model.config.vocab_size, model.config.bias) == (32, 65, True)
    x = ids(2, 12)
    with torch.no_grad():
        expected = hf(x).logits[:, -1]  # (B, V)
        logits, _ = model(x)  # (B, 1, V)
    assert (logits[:, 0] - expected).abs().max().item() < 1e-5
    assert GPT.from_pretrained(str(path), dict(dropout=0.1)).config.dropout == 0.1  # train.py's finetuning call


def test_crop_block_size_crops_the_position_embedding_and_the_model_still_runs_and_generates():
    model = nanogpt_model(block_size=32).eval()
    original = copy.deepcopy(model)
    model.crop_block_size(16)  # train.py: block_size < model.config.block_size
    assert model.config.block_size == 16 and model.transformer.wpe.weight.shape == (16, MODEL_ARGS["n_embd"])
    x = ids(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], original(x)[0])  # the first 16 positions are unchanged
    with pytest.raises(UserError):
        model(ids(2, 17))
    torch.manual_seed(7)
    expected = reference_generate(model, x, 6)
    torch.manual_seed(7)
    assert torch.equal(model.generate(x, 6), expected)


def test_a_compiled_runs_nanogpt_checkpoint_resumes_as_nanogpts_scripts_load_it(tmp_path):
    source = nanogpt_model(seed=0)
    optimizer = source.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    x, y = ids(4, 16), ids(4, 16, seed=2)
    source(x, y)[1].backward()
    optimizer.step()
    # what nanoGPT's train.py saves; a compiled run's keys carry torch.compile's '_orig_mod.' prefix (its
    # OptimizedModule holds the model as _orig_mod), written here by hand to keep dynamo's import out of this test
    compiled_state = {"_orig_mod." + k: v for k, v in source.state_dict().items()}
    torch.save({"model": compiled_state, "optimizer": optimizer.state_dict(),
                "model_args": MODEL_ARGS, "iter_num": 1, "best_val_loss": torch.tensor(4.0),
                "config": {"dataset": "shakespeare_char"}}, tmp_path / "ckpt.pt")

    checkpoint = torch.load(tmp_path / "ckpt.pt", map_location="cpu")
    model = GPT(GPTConfig(**checkpoint["model_args"]))
    state_dict = checkpoint["model"]
    assert all(k.startswith("_orig_mod.") for k in state_dict)
    state_dict = {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}
    model.load_state_dict(state_dict)  # strict: the keys are exactly this model's
    resumed = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    resumed.load_state_dict(checkpoint["optimizer"])

    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], source(x)[0], rtol=0, atol=0)
    moments = [resumed.state[p]["exp_avg"] for p in resumed.param_groups[0]["params"]]
    assert all(m.abs().sum() > 0 for m in moments)  # AdamW's state came back with the parameters it belongs to
    torch.testing.assert_close(moments[0], optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"])


@pytest.mark.parametrize("call, sentence", [
    (lambda m: m.generate(torch.zeros(1, 3, dtype=torch.long), 4, top_k=0), "top_k must be None .* got 0"),
    (lambda m: m.generate(torch.zeros(2, 0, dtype=torch.long), 4), r"at least one token per row.*\(2, 0\)"),
    (lambda m: m.generate(torch.zeros(3, dtype=torch.long), 4), r"shape \(B, T\), got \(3,\)"),
    (lambda m: m.generate(torch.zeros(1, 3, dtype=torch.long), 4, temperature=float("nan")),
     r"^temperature must be a finite number >= 0 \(0: greedy\), got nan\.$"),
    (lambda m: m.generate(torch.zeros(1, 3, dtype=torch.long), 4, temperature=float("inf")), "got inf"),
    (lambda m: m.generate(torch.zeros(1, 3, dtype=torch.long), 4, temperature=-0.5), "got -0.5"),
])
def test_generate_refuses_what_it_cannot_sample_from_in_one_sentence(call, sentence):
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=8)).eval()
    with pytest.raises(ValueError, match=sentence):
        call(model)


def nanogpt_initial_weights(seed: int, vocab_size: int, block_size: int, n_layer: int, n_embd: int) -> dict:
    """The weights nanoGPT's GPT(config) starts from under torch.manual_seed(seed) with bias=False, rebuilt here from
    the order its model.py draws them: the modules made in order (wte, wpe, each block's c_attn, attn.c_proj, c_fc,
    mlp.c_proj, then lm_head, whose weight wte then shares); every Embedding and Linear drawn again from N(0, 0.02)
    in module order (the shared weight first as wte, last as lm_head); then each c_proj weight from
    N(0, 0.02 / sqrt(2 n_layer)), in parameter order."""
    from torch import nn
    torch.manual_seed(seed)
    C = n_embd
    wte, wpe = nn.Embedding(vocab_size, C), nn.Embedding(block_size, C)
    blocks = [[nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False), nn.Linear(C, 4 * C, bias=False),
               nn.Linear(4 * C, C, bias=False)] for _ in range(n_layer)]
    lm_head = nn.Linear(C, vocab_size, bias=False)
    with torch.no_grad():
        for weight in [lm_head.weight, wpe.weight, *(m.weight for block in blocks for m in block), lm_head.weight]:
            nn.init.normal_(weight, mean=0.0, std=0.02)
        for block in blocks:
            for projection in (block[1], block[3]):
                nn.init.normal_(projection.weight, mean=0.0, std=0.02 / n_layer ** 0.5 / 2 ** 0.5)
    state = {"transformer.wte.weight": lm_head.weight, "transformer.wpe.weight": wpe.weight,
             "lm_head.weight": lm_head.weight}
    for i, block in enumerate(blocks):
        for name, m in zip(("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"), block):
            state[f"transformer.h.{i}.{name}.weight"] = m.weight
    return state


def test_the_initial_weights_are_nanogpts_bit_for_bit_under_one_seed():
    """--bias=False --gelu=none is nanoGPT's model: under the same seed GPT(config) starts from exactly the weights
    nanoGPT's does (the LayerNorms at ones), so a run of each from one seed starts at the same point."""
    model = nanogpt_model(seed=1337)
    reference = nanogpt_initial_weights(1337, MODEL_ARGS["vocab_size"], MODEL_ARGS["block_size"],
                                        MODEL_ARGS["n_layer"], MODEL_ARGS["n_embd"])
    ours = model.state_dict()
    for key, weight in reference.items():
        assert torch.equal(ours[key], weight), key
    assert all(torch.equal(ours[k], torch.ones_like(ours[k])) for k in ours if ".ln_" in k)
