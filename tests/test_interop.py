"""In and out of the ecosystem: an out_dir exported to Hugging Face loads in transformers with no custom code and
computes the same logits and greedy text; an out_dir as nanoGPT writes it resumes and samples here."""

import json
import re
import os
import shlex
import stat
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from core.configurator import configure
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, pipeline

import export_hf
import sample
import train
from engine.reader import build_model, load_checkpoint
from conftest import REPO, TINY, checkpoint_of, metrics
from core.errors import UserError
from model import GPT, GPTConfig
from data.textdata import write_meta
from core.tokenizer import GPT2Tokenizer, tokenizer_from_meta


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory) -> Path:
    """A small GPT-2 BPE dataset, tokenized offline with the packaged vocabulary."""
    d = tmp_path_factory.mktemp("bpe")
    text = " ".join(f"The king said to the queen, {i} times: be not afraid of greatness." for i in range(400))
    ids = np.array(GPT2Tokenizer().encode(text), dtype=np.uint16)
    split = int(0.9 * len(ids))
    ids[:split].tofile(d / "train.bin")
    ids[split:].tofile(d / "val.bin")
    write_meta(d / "meta.json", {"tokenizer": "gpt2", "vocab_size": 50257})
    return d


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trained(data, *settings): the out_dir of 20 steps of train.py on `data`, trained once per module for each
    (data, settings); the tests read it and write elsewhere."""
    runs = {}

    def run(data: Path, *extra: str) -> Path:
        if (str(data), extra) not in runs:
            out = tmp_path_factory.mktemp("run")
            train.main(TINY + [f"--data_dir={data}", "--max_iters=20", "--eval_interval=20", f"--out_dir={out}",
                               *extra])
            runs[str(data), extra] = out
        return runs[str(data), extra]
    return run


def fresh_out_dir(out: Path, data: Path, **config) -> Path:
    """An out_dir holding what train.py would save for a model of TINY's shape on `data` (its meta.json) before any
    step, with trained-size weights (x5: GELU inputs of order 1, where the exact and tanh GELUs differ): for checks
    that compare two computations of the same weights, without seconds of training a 50257-row embedding."""
    meta = json.loads((data / "meta.json").read_text())
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=meta["vocab_size"], **config))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0 if p.dim() >= 2 else 1.0)
    checkpoint_of(model, meta=meta).save(out / "ckpt.pt")
    return out


def our_logits(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits, _ = model(ids, targets=ids)  # targets: every position's logits
    return logits[..., : model.config.vocab_size]  # the real vocabulary (padded ids are -inf)


# -- export ------------------------------------------------------------------------------------------------

def readme_blocks(heading: str) -> list[tuple[str, str]]:
    """The fenced code blocks (language, text) of one README section, in order."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading):]
    section = section[:section.index("\n#", 1)] if "\n#" in section[1:] else section
    parts = section.split("```")[1::2]
    return [(part.split("\n", 1)[0].strip(), part.split("\n", 1)[1]) for part in parts]


@pytest.mark.slow  # two fresh interpreters, each importing torch and transformers
def test_the_readmes_export_and_pipeline_snippet_run_as_written_on_the_quickstarts_out_dir(tmp_path):
    """The quickstart's model shape (block 64: a prompt plus new tokens must fit), its out_dir name, then the
    README's own commands, literally, from a user's folder: no error and no warning."""
    cfg = configure(vars(train), [str(REPO / "config" / "train_shakespeare_char_cpu.py")])
    chars = sorted(set("ROMEO:\nJULIET: wherefore art thou, abcdefghijklmnopqrstuvwxyz!?."))
    model = GPT(GPTConfig.build({**cfg.as_dict(), "vocab_size": len(chars)}, {}))
    checkpoint_of(model, meta={"tokenizer": "char", "vocab_size": len(chars), "chars": chars}).save(
        tmp_path / cfg.out_dir / "ckpt.pt")
    (sh_lang, sh), (py_lang, snippet) = readme_blocks("### To Hugging Face")[:2]
    assert (sh_lang, py_lang) == ("sh", "python")
    printed = {}
    for line in sh.strip().splitlines():
        program, script, *args = shlex.split(line)
        done = subprocess.run([sys.executable, str(REPO / script), *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        printed[script] = done.stdout
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "max_length" not in done.stderr and "warn" not in done.stderr.lower(), done.stderr
    assert done.stdout.startswith("ROMEO:")
    assert done.stdout.strip() in printed["sample.py"]  # the comment's promise: the sample.py line's text

@pytest.mark.parametrize("kind", ["char", "bpe"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_an_export_loads_in_transformers_with_the_same_logits_and_reads_back_the_same_weights(
        kind, padded, char_data, bpe_data, tmp_path):
    out = fresh_out_dir(tmp_path / "run", char_data if kind == "char" else bpe_data, pad_vocab=padded,
                        gelu="none" if kind == "char" else "tanh")
    hf_dir = tmp_path / "hf"
    assert export_hf.main([f"--out_dir={out}", f"--hf_dir={hf_dir}"]) == 0
    ours = build_model(load_checkpoint(out / "ckpt.pt")).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, ours.config.block_size))
    for loaded in (GPT2LMHeadModel.from_pretrained(hf_dir), AutoModelForCausalLM.from_pretrained(hf_dir)):
        assert loaded.config.vocab_size == ours.config.vocab_size  # the padding is undone
        with torch.no_grad():
            theirs = loaded.eval()(ids).logits
        torch.testing.assert_close(theirs, our_logits(ours, ids), rtol=0, atol=1e-5)
    back = GPT.from_pretrained(str(hf_dir), dict(pad_vocab=padded))
    assert back.config.gelu == ours.config.gelu
    real = ours.config.vocab_size  # padded rows are not exported: they come back as zeros, still behind -inf
    for key, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[key][:real], tensor[:real]), key
    torch.testing.assert_close(our_logits(back, ids), our_logits(ours, ids), rtol=0, atol=0)


def test_sampling_a_character_export_by_directory_is_refused_rather_than_decoded_as_bpe(char_data, trained, tmp_path):
    hf_dir = export_hf.export(load_checkpoint(trained(char_data) / "ckpt.pt"), tmp_path / "hf")
    with pytest.raises(UserError, match="vocabulary, not GPT-2's; sample.py reads Hugging Face directories with GPT-2"):
        sample.main([f"--init_from={hf_dir}", "--device=cpu"])


def test_an_export_gets_the_permissions_any_other_tool_would_give_it(char_data, trained, tmp_path):
    """A shared model folder, a container, another user: readable, as the umask says (it was drwx------ with a
    -rw------- model.safetensors, from the temporary folder it is staged in)."""
    umask = os.umask(0o022)
    try:
        hf_dir = export_hf.export(load_checkpoint(trained(char_data) / "ckpt.pt"), tmp_path / "hf")
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [hf_dir, *hf_dir.rglob("*")]}
    assert modes.pop("hf") == 0o755 and "model.safetensors" in modes
    assert set(modes.values()) == {0o644}, modes


@pytest.mark.parametrize("kind, prompt", [("char", "To be, or"), ("bpe", "The king said")])
def test_pipeline_greedy_text_equals_sample_py_greedy_text(kind, prompt, char_data, bpe_data, trained, tmp_path):
    # char: a train.py run's out_dir, exported as a user exports it; bpe: the same for a fresh model
    out = trained(char_data) if kind == "char" else fresh_out_dir(tmp_path / "run", bpe_data)
    hf_dir = export_hf.export(load_checkpoint(out / "ckpt.pt"), tmp_path / "hf")
    sample.main([f"--out_dir={out}", f"--start={prompt}", "--temperature=0", "--max_new_tokens=12",
                 "--num_samples=1", "--device=cpu", "--dtype=float32", f"--json={tmp_path / 'sample.json'}"])
    ours = json.loads((tmp_path / "sample.json").read_text())["texts"][0]
    generator = pipeline("text-generation", model=str(hf_dir), device="cpu")
    theirs = generator(prompt, max_new_tokens=12, do_sample=False)[0]["generated_text"]
    assert theirs == ours and len(ours) > len(prompt)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_what_a_client_reads_from_an_export_lets_it_generate_pad_and_score_in_transformers_4_and_5(
        kind, char_data, bpe_data, tmp_path, monkeypatch):
    """transformers 4.x refused 5.x's "TokenizersBackend"; batched calls need a pad; generation past the context raised
    IndexError; HF_HUB_OFFLINE and a local folder leaked into tokenizer_config.json. A character vocabulary has no
    token to spare for bos/eos/pad (transformers drops special tokens from decoded text: every newline would go)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = fresh_out_dir(tmp_path / "run", char_data if kind == "char" else bpe_data)
    hf_dir = export_hf.export(load_checkpoint(out / "ckpt.pt"), tmp_path / "hf")
    saved = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == ("PreTrainedTokenizerFast" if kind == "char" else "GPT2TokenizerFast")
    assert not set(saved) & set(export_hf.ENVIRONMENT_KEYS) and saved["padding_side"] == "left"
    # transformers 4.x returns token_type_ids unless the saved tokenizer names its inputs, and GPT-2 adds their
    # embedding to every position (the character export's logits were off by up to 8.33): named, for 4.x and 5.x
    assert saved["model_input_names"] == ["input_ids", "attention_mask"]
    # llama.cpp's convert_hf_to_gguf.py reads GPT-2's context as n_ctx (a KeyError without it), as the hub's has it
    assert json.loads((hf_dir / "config.json").read_text())["n_ctx"] == 32
    tokenizer, model = AutoTokenizer.from_pretrained(hf_dir), AutoModelForCausalLM.from_pretrained(hf_dir)
    assert set(tokenizer("To be")) == {"input_ids", "attention_mask"}
    special = 50256 if kind == "bpe" else None
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id == special
    assert tokenizer.model_max_length == model.generation_config.max_length == 32 == model.config.n_positions
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == special
    generator = pipeline("text-generation", model=str(hf_dir), device="cpu")
    prompts = ["To be,\nor", "or not to be"]
    texts = generator(prompts, do_sample=False, batch_size=2 if kind == "bpe" else 1)  # to the context, no further
    assert [t[0]["generated_text"].startswith(p) for t, p in zip(texts, prompts)] == [True, True]  # newline kept
    assert all(len(tokenizer(t[0]["generated_text"])["input_ids"]) <= 32 for t in texts)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_the_exported_tokenizer_encodes_and_decodes_as_this_repos(kind, char_data, bpe_data, tmp_path):
    data = char_data if kind == "char" else bpe_data
    meta = json.loads((data / "meta.json").read_text())
    tokenizer = export_hf.hf_tokenizer(meta, 32, tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ours = tokenizer_from_meta(meta)
    text = "To be, or not to be:\n line 7 of 12." if kind == "char" else "Hello world<|endoftext|> said the king.\n"
    assert loaded(text)["input_ids"] == ours.encode(text)
    assert loaded.decode(ours.encode(text)) == text


def test_a_model_without_biases_exports_with_zero_biases_and_the_same_logits(char_data, trained, tmp_path):
    out = trained(char_data, "--bias=False")  # nanoGPT's default
    hf_dir = export_hf.export(load_checkpoint(out / "ckpt.pt"), tmp_path / "hf")
    ours = build_model(load_checkpoint(out / "ckpt.pt")).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, ours.config.block_size))
    with torch.no_grad():
        theirs = GPT2LMHeadModel.from_pretrained(hf_dir).eval()(ids).logits
    torch.testing.assert_close(theirs, our_logits(ours, ids), rtol=0, atol=1e-5)


def test_what_gpt2s_format_cannot_express_is_refused_in_one_sentence(char_data, trained, tmp_path):
    out = trained(char_data)
    checkpoint = load_checkpoint(out / "ckpt.pt")
    checkpoint.meta = {"tokenizer": "sentencepiece", "vocab_size": checkpoint.meta["vocab_size"]}
    with pytest.raises(UserError, match=r"names tokenizer 'sentencepiece'; only GPT-2 BPE and character "):
        export_hf.export(checkpoint, tmp_path / "hf")
    checkpoint = load_checkpoint(out / "ckpt.pt")
    checkpoint.model_config["window"] = 8
    with pytest.raises(UserError, match=r"attends through a window of 8 tokens, which Hugging Face's GPT-2 cannot"):
        export_hf.export(checkpoint, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_an_existing_folder_is_never_written_over_and_is_refused_before_anything_is_loaded(char_data, trained,
                                                                                           tmp_path, monkeypatch):
    out = trained(char_data)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    (tmp_path / "a_file").write_text("mine")
    monkeypatch.setattr(export_hf, "load_checkpoint", lambda *args: pytest.fail("loaded before the refusal"))
    for hf_dir in (tmp_path / "hf", tmp_path / "a_file"):
        with pytest.raises(UserError, match="already exists and is not empty"):
            export_hf.main([f"--out_dir={out}", f"--hf_dir={hf_dir}"])
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["notes.txt"] and (tmp_path / "a_file").read_text() == \
        "mine"


# -- nanoGPT checkpoints in -----------------------------------------------------------------------------------

NANO_ARGS = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, bias=True, dropout=0.0)


def nanogpt_out_dir(folder: Path, chars: list[str] | None, seed: int = 0, vocab_size: int = 0) -> tuple[Path, dict]:
    """An out_dir laid out exactly as nanoGPT's train.py writes one for a compiled run: ckpt.pt with `_orig_mod.`
    keys, its per-block causal-mask buffers, AdamW's own state dict (parameters by number, nanoGPT's two groups),
    model_args, iter_num, a tensor best_val_loss and config; meta.pkl beside it for a character vocabulary
    (chars; else a BPE run of vocab_size). Returns it and the raw state."""
    torch.manual_seed(seed)
    vocab_size = len(chars) if chars else vocab_size
    weights = GPT(GPTConfig(vocab_size=vocab_size, gelu="none", **NANO_ARGS))  # only the source of numbers
    with torch.no_grad():  # trained-size weights: GELU inputs of order 1, where the exact and tanh GELUs differ
        for p in weights.parameters():
            p.mul_(5.0 if p.dim() >= 2 else 1.0)
    params = dict(weights.named_parameters())
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.99))
    x = torch.randint(0, vocab_size, (4, 32))
    for _ in range(2):
        weights(x, x)[1].backward()
        adamw.step()
        adamw.zero_grad()
    state = {f"_orig_mod.{k}": v.clone() for k, v in weights.state_dict().items()}
    mask = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
    state.update({f"_orig_mod.transformer.h.{i}.attn.bias": mask for i in range(2)})
    folder.mkdir(parents=True)
    torch.save({"model": state, "optimizer": adamw.state_dict(),
                "model_args": {**NANO_ARGS, "vocab_size": vocab_size}, "iter_num": 7,
                "best_val_loss": torch.tensor(2.5), "config": {"dataset": "shakespeare_char" if chars else "owt",
                                                              "batch_size": 12, "learning_rate": 1e-3,
                                                              "compile": True}},
               folder / "ckpt.pt")
    if chars:
        with open(folder / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                         "stoi": {c: i for i, c in enumerate(chars)}}, f)
    return folder, {"model": state, "optimizer": adamw.state_dict()}


def chars_of(data: Path) -> list[str]:
    return json.loads((data / "meta.json").read_text())["chars"]


def hf_reference(state: dict, vocab_size: int, activation: str) -> GPT2LMHeadModel:
    """nanoGPT's forward pass computed by an independent implementation: transformers' GPT-2, given the raw
    nanoGPT weights (prefix stripped, mask buffers dropped, Linear -> Conv1D) and nanoGPT's exact GELU."""
    config = GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        activation_function=activation, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    hf_state = {}
    for key, tensor in state.items():
        key = key.removeprefix("_orig_mod.")
        if not key.endswith(".attn.bias"):
            hf_state[key] = tensor.t() if key.endswith(conv1d) else tensor
    model = GPT2LMHeadModel(config)
    model.load_state_dict(hf_state, strict=True)
    return model.eval()


def test_a_nanogpt_checkpoint_computes_nanogpts_logits(char_data, tmp_path):
    chars = chars_of(char_data)
    folder, raw = nanogpt_out_dir(tmp_path / "nano", chars)
    ours = build_model(load_checkpoint(folder / "ckpt.pt")).eval()
    ids = torch.randint(0, len(chars), (2, 32))
    with torch.no_grad():
        exact = hf_reference(raw["model"], len(chars), "gelu")(ids).logits
        tanh = hf_reference(raw["model"], len(chars), "gelu_new")(ids).logits
    torch.testing.assert_close(our_logits(ours, ids), exact, rtol=0, atol=1e-5)
    assert (tanh - exact).abs().max() > 1e-4  # the GELU matters at this tolerance: a tanh reading would fail


def test_a_nanogpt_checkpoint_samples_nanogpts_greedy_text(char_data, tmp_path):
    """nanoGPT's sample.py with top_k=1 draws the greedy text (its one allowed token each step): sample.py here gives
    the text an independent greedy loop gives over nanoGPT's forward pass (transformers' GPT-2, nanoGPT's exact
    GELU), token for token, in fp32."""
    chars = chars_of(char_data)
    folder, raw = nanogpt_out_dir(tmp_path / "nano", chars)
    prompt = "To be"
    sample.main([f"--out_dir={folder}", f"--start={prompt}", "--max_new_tokens=24", "--num_samples=1", "--top_k=1",
                 "--temperature=1.0", "--device=cpu", "--dtype=float32", f"--json={tmp_path / 's.json'}"])
    reference = hf_reference(raw["model"], len(chars), "gelu")
    ids = torch.tensor([[chars.index(c) for c in prompt]])
    with torch.no_grad():
        for _ in range(24):
            ids = torch.cat([ids, reference(ids[:, -32:]).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert json.loads((tmp_path / "s.json").read_text())["texts"][0] == "".join(chars[i] for i in ids[0])


def test_nanogpts_padded_gpt2_vocabulary_reads_as_the_real_one_padded(tmp_path):
    folder, raw = nanogpt_out_dir(tmp_path / "nano", None, vocab_size=50304)  # nanoGPT's GPT-2 default
    checkpoint = load_checkpoint(folder / "ckpt.pt")
    ours = build_model(checkpoint).eval()
    assert checkpoint.meta["tokenizer"] == "gpt2" and (ours.config.vocab_size, ours.config.padded_vocab_size) == (
        50257, 50304)
    ids = torch.randint(0, 50257, (1, 32))
    with torch.no_grad():
        theirs = hf_reference(raw["model"], 50304, "gelu")(ids).logits
    torch.testing.assert_close(our_logits(ours, ids), theirs[..., :50257], rtol=0, atol=1e-5)


def test_a_nanogpt_out_dir_resumes_with_its_optimizer_state_and_keeps_the_original(char_data, tmp_path):
    folder, raw = nanogpt_out_dir(tmp_path / "nano", chars_of(char_data))
    original = (folder / "ckpt.pt").read_bytes()
    converted = load_checkpoint(folder / "ckpt.pt", for_training=True)
    assert converted.iter_num == 7 and converted.best_val_loss == 2.5
    by_number = raw["optimizer"]["state"]
    assert torch.equal(converted.optimizer["state"]["transformer.wte.weight"]["exp_avg"], by_number[0]["exp_avg"])
    assert torch.equal(converted.optimizer["state"]["transformer.ln_f.bias"]["exp_avg_sq"],
                       by_number[max(by_number)]["exp_avg_sq"])  # the last of the no-decay group
    train.main(TINY + [f"--data_dir={char_data}", "--init_from=resume", f"--out_dir={folder}", "--max_iters=10",
                       "--eval_interval=10", "--always_save_checkpoint=True"])
    assert sorted(metrics(folder, "train/step_loss")) == [8, 9, 10]  # continued from nanoGPT's iteration 7
    assert load_checkpoint(folder / "ckpt.pt", for_training=True).iter_num == 10
    assert (folder / "ckpt.nanogpt.pt").read_bytes() == original


def test_a_nanogpt_resume_takes_the_batch_and_schedule_nanogpt_saved_and_says_so(char_data, tmp_path, capsys):
    """nanoGPT saves its run's settings in the checkpoint (`config`): a resume takes its batch and schedule, as a
    resume of this project's own checkpoint takes its own, names them, and says the training time is unknown; a flag
    typed still wins; nanoGPT's dtype and compile (its process's, not this one's) are not taken."""
    folder, _ = nanogpt_out_dir(tmp_path / "nano", chars_of(char_data))
    contents = torch.load(folder / "ckpt.pt", weights_only=True)
    contents["config"].update(gradient_accumulation_steps=1, max_iters=9, lr_decay_iters=9, warmup_iters=0,
                              eval_interval=9, eval_iters=2, dtype="float16", device="cuda")
    torch.save(contents, folder / "ckpt.pt")
    train.main([f"--data_dir={char_data}", "--init_from=resume", f"--out_dir={folder}", "--device=cpu",
                "--compile=False", "--learning_rate=2e-3"])
    out, err = capsys.readouterr()
    note = next(line for line in err.splitlines() if line.startswith("note: resuming nanoGPT's run"))
    for taken in ("batch_size=12", "gradient_accumulation_steps=1", "max_iters=9", "eval_iters=2"):
        assert taken in note, note
    assert "learning_rate" not in note and "dtype" not in note and "compile" not in note
    banner = out.splitlines()[0]
    assert "384 tokens per iteration" in banner and not re.search(r"\bfloat16\b", banner)  # 1 x 12 x 32; this
    # machine's dtype=auto (fp32, or bf16 with AMX), never the float16 nanoGPT saved
    assert "nanoGPT's checkpoint does not record its training time" in out
    assert sorted(metrics(folder, "train/step_loss")) == [8, 9]
    assert max(r["lr"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())) <= 2e-3


def test_a_refused_nanogpt_resume_writes_nothing(char_data, tmp_path):
    """Checked before anything is written: a block_size beyond the model's once first left a copy of the file."""
    folder, _ = nanogpt_out_dir(tmp_path / "nano", chars_of(char_data))
    before = sorted(p.name for p in folder.iterdir()) + [".lock"]  # the lock a resume takes stays
    with pytest.raises(UserError, match="block_size=4096 differs from the checkpoint"):
        train.main(TINY + [f"--data_dir={char_data}", "--init_from=resume", f"--out_dir={folder}",
                           "--block_size=4096"])
    assert sorted(p.name for p in folder.iterdir()) == sorted(before)


def test_a_nanogpt_resume_refused_after_its_state_is_applied_leaves_no_copy_of_the_file(char_data, tmp_path,
                                                                                      monkeypatch):
    """attn=auto is decided once the checkpoint is applied (train.restore, then choose_attention); the copy of
    nanoGPT's ckpt.pt is made at the first save that replaces it, so a run refused in between writes nothing."""
    from attention import attn_auto
    folder, _ = nanogpt_out_dir(tmp_path / "nano", chars_of(char_data))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def refused(*args, **kwargs):
        raise UserError("no attention implementation runs here")
    monkeypatch.setattr(attn_auto, "choose_for_training", refused)
    with pytest.raises(UserError, match="no attention implementation runs here"):
        train.main(TINY + [f"--data_dir={char_data}", "--init_from=resume", f"--out_dir={folder}", "--attn=auto",
                           "--max_iters=10", "--eval_interval=10"])
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != ".lock"} == before


def test_a_nanogpt_out_dir_samples_with_its_character_vocabulary(char_data, tmp_path, capsys):
    chars = chars_of(char_data)
    folder, _ = nanogpt_out_dir(tmp_path / "nano", chars)
    sample.main([f"--out_dir={folder}", "--start=To be", "--max_new_tokens=30", "--num_samples=1", "--device=cpu",
                 "--dtype=float32", f"--json={tmp_path / 's.json'}"])
    text = json.loads((tmp_path / "s.json").read_text())["texts"][0]
    assert text.startswith("To be") and len(text) == 35 and set(text) <= set(chars)


def test_a_meta_pkl_that_would_run_code_is_refused_without_running_it(char_data, tmp_path):
    folder, _ = nanogpt_out_dir(tmp_path / "nano", chars_of(char_data))
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 3, "itos": Payload()}))
    with pytest.raises(UserError, match=r"meta.pkl is refused: it is not a pickle of plain dicts, lists, strings "
                                        r"and ints \(refers to builtins.exec\); nothing in it was run"):
        sample.main([f"--out_dir={folder}", "--device=cpu"])
    assert not marker.exists()


def test_a_meta_pkl_of_other_plain_types_is_refused(char_data, tmp_path):
    folder, _ = nanogpt_out_dir(tmp_path / "nano", chars_of(char_data))
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 3, "itos": {0: 1.5}}))
    with pytest.raises(UserError, match="holds types other than dicts, lists, strings and ints"):
        load_checkpoint(folder / "ckpt.pt")


def test_a_nanogpt_character_model_without_its_meta_pkl_names_the_file_to_copy(char_data, tmp_path):
    folder, _ = nanogpt_out_dir(tmp_path / "nano", chars_of(char_data))
    (folder / "meta.pkl").unlink()
    with pytest.raises(UserError, match=r"no meta.pkl was found .*; copy its data folder's meta.pkl next to ckpt.pt "
                                        r"\(train.py also reads it from --data_dir\)"):
        sample.main([f"--out_dir={folder}", "--device=cpu"])


# -- nanoGPT's data folders: train.bin, val.bin and meta.pkl (no meta.json) ----------------------------------

def nanogpt_data_dir(folder: Path, char_data: Path) -> Path:
    """A data folder as nanoGPT's data/shakespeare_char/prepare.py leaves it: the token files and meta.pkl."""
    folder.mkdir(parents=True)
    for name in ("train.bin", "val.bin"):
        (folder / name).write_bytes((char_data / name).read_bytes())
    chars = chars_of(char_data)
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in
                                                                                         enumerate(chars)}}, f)
    return folder


def test_a_nanogpt_run_resumes_from_its_out_dir_and_its_data_folder(char_data, tmp_path):
    """The vocabulary comes from the data folder's meta.pkl: there is none beside the checkpoint."""
    data = nanogpt_data_dir(tmp_path / "nanoGPT" / "data" / "shakespeare_char", char_data)
    out, _ = nanogpt_out_dir(tmp_path / "elsewhere" / "out-shakespeare-char", chars_of(char_data))
    (out / "meta.pkl").unlink()
    train.main(TINY + [f"--data_dir={data}", "--init_from=resume", f"--out_dir={out}", "--max_iters=9",
                       "--eval_interval=9"])
    assert sorted(metrics(out, "train/step_loss")) == [8, 9]
    assert load_checkpoint(out / "ckpt.pt").meta == {"tokenizer": "char", "vocab_size": len(chars_of(char_data)),
                                                     "chars": chars_of(char_data)}


def test_compare_reads_the_held_out_text_of_the_data_a_nanogpt_checkpoint_was_trained_on(char_data, tmp_path):
    """A nanoGPT checkout (out-shakespeare-char beside data/shakespeare_char): --compare's held-out loss reads that
    data folder's val.bin, where the checkpoint's meta.pkl was found, not this project's data/; --data_dir= names
    another; the table's header says which file and how many tokens."""
    data = nanogpt_data_dir(tmp_path / "nanoGPT" / "data" / "shakespeare_char", char_data)
    out, _ = nanogpt_out_dir(tmp_path / "nanoGPT" / "out-shakespeare-char", chars_of(char_data))
    (out / "meta.pkl").unlink()
    other = nanogpt_data_dir(tmp_path / "other", char_data)
    for extra, folder in (([], data), ([f"--data_dir={other}"], other)):
        sample.main([f"--out_dir={out}", "--compare=manual,sdpa", "--num_samples=1", "--max_new_tokens=4",
                     "--device=cpu", f"--json={tmp_path / 'c.json'}", *extra])
        held_out = json.loads((tmp_path / "c.json").read_text())["held_out"]
        assert held_out.startswith(f"{folder / 'val.bin'}: ") and held_out.endswith(" tokens)"), held_out


def test_a_new_run_on_a_nanogpt_data_folder_takes_its_vocabulary_and_samples_with_it(char_data, trained, tmp_path):
    data = nanogpt_data_dir(tmp_path / "data", char_data)
    out = trained(data)
    checkpoint = load_checkpoint(out / "ckpt.pt")
    assert checkpoint.model_config["vocab_size"] == len(chars_of(char_data))  # not GPT-2's 50257
    assert checkpoint.meta["chars"] == chars_of(char_data)
    sample.main([f"--out_dir={out}", "--start=To be", "--max_new_tokens=5", "--num_samples=1", "--device=cpu",
                 f"--json={tmp_path / 's.json'}"])
    assert json.loads((tmp_path / "s.json").read_text())["texts"][0].startswith("To be")


def test_sampling_a_nanogpt_checkpoint_never_reads_its_optimizer_state_and_resuming_refuses_a_bad_one(
        char_data, tmp_path, capsys):
    folder, _ = nanogpt_out_dir(tmp_path / "nano", chars_of(char_data))
    contents = torch.load(folder / "ckpt.pt", weights_only=True)
    contents["optimizer"] = {"state": {}, "param_groups": [{"params": ["not", "numbers"]}]}  # not nanoGPT's layout
    torch.save(contents, folder / "ckpt.pt")
    assert sample.main([f"--out_dir={folder}", "--max_new_tokens=3", "--num_samples=1", "--device=cpu"]) == 0
    assert export_hf.main([f"--out_dir={folder}", f"--hf_dir={tmp_path / 'hf'}"]) == 0
    with pytest.raises(UserError, match=r"ckpt.pt's optimizer state is not AdamW's as nanoGPT's configure_optimizers "
                                        r"writes it .*; it samples and exports, but does not resume"):
        train.main(TINY + [f"--data_dir={char_data}", "--init_from=resume", f"--out_dir={folder}"])


def test_an_export_of_a_doc_mask_model_says_where_clients_differ(char_data, bpe_data, trained, tmp_path, capsys):
    """GPT-2 in transformers cannot mask documents: such an export says in one line where its logits match this
    project's and where they differ (a window is refused); a plain model's export says nothing of it."""
    for data, extra, named in ((bpe_data, ("--doc_mask=True",), "doc_mask"), (char_data, (), None)):
        capsys.readouterr()
        assert export_hf.main([f"--out_dir={trained(data, *extra)}", f"--hf_dir={tmp_path / (named or 'plain')}"]) == 0
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: this model was")]
        assert len(notes) == (named is not None)
        assert not notes or f"trained with {named}, which GPT-2 in transformers" in notes[0] and "differ" in notes[0]
