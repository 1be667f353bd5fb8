"""
Export a training run to a Hugging Face GPT-2 directory (weights, config, tokenizer, vocabulary unpadded) that
transformers loads with no custom code.

    python export_hf.py --out_dir=out-shakespeare-char-cpu --hf_dir=hf-shakespeare-char
    >>> pipeline("text-generation", model="hf-shakespeare-char")("ROMEO:", do_sample=False)  # to its 64-token context

transformers' GPT-2 does not slide its window as sample.py does: prompt and new tokens must fit block_size, which the
export's generation_config sets as max_length (a call without max_new_tokens stops there).
"""

if __name__ == "__main__":  # a Ctrl-C while the imports below load ends the process quietly (main handles its own)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import json

import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError

from core import errors, writing
from core import runtime
from engine.checkpoint import Checkpoint
from engine.reader import build_model, find_checkpoint, load_checkpoint
from core.configurator import PATH, configure
from core.errors import UserError, problems_of
from model import CONV1D_WEIGHTS
from tools.decoding import quiet_imports
from model import GPT
from core.tokenizer import GPT2_EOT_TOKEN, check_gpt2_files, gpt2_files_dir

out_dir = "out"                   # the training run's folder (its ckpt.pt)
hf_dir = ""                       # where to write the Hugging Face directory; empty: <out_dir>/hf
# sampling defaults written to generation_config.json (sample.py's); pipeline(...) arguments override them
temperature = 0.8                 # 0: greedy
top_k = 200                       # sample among the top_k most likely tokens only
LIMITS = {"temperature": "[0, inf)", "top_k": "[1, inf) int", "out_dir": PATH, "hf_dir": PATH}


def hf_config(model: GPT, meta: Optional[dict]):
    """GPT2Config for this model: GPT-2's shape, with its GELU and dropout."""
    from transformers import GPT2Config
    c = model.config
    activation = {"tanh": "gelu_new", "none": "gelu"}[c.gelu]  # GPTConfig allows these two; hf.py reads both back
    eot = GPT2_EOT_TOKEN if is_bpe(meta) else None  # a character vocabulary has no end-of-text token
    # n_ctx: GPT-2's older name for the context, which the hub's config carries and llama.cpp's converter reads
    return GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_ctx=c.block_size, n_embd=c.n_embd,
                      n_layer=c.n_layer,
                      n_head=c.n_head, n_inner=None, activation_function=activation, resid_pdrop=c.dropout,
                      embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=1e-5, scale_attn_weights=True,
                      scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                      tie_word_embeddings=True, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)


def is_bpe(meta: Optional[dict]) -> bool:
    return meta is None or meta.get("tokenizer") == "gpt2"


def newline_id(meta: dict) -> int:
    """A character vocabulary's newline (sample.py's default prompt: its text starts after one), else its first
    character: the id lm-eval's rolling loss starts from (prefix_token_id). It cannot be the tokenizer's bos, eos or
    pad: transformers would then drop every newline from decoded text, as it drops special tokens."""
    chars = meta.get("chars") or []  # another tokenizer stops with an error in hf_tokenizer
    return chars.index("\n") if "\n" in chars else 0


# keys transformers saves that describe the machine it ran on, not the tokenizer (HF_HUB_OFFLINE, a local folder)
ENVIRONMENT_KEYS = ("local_files_only", "is_local", "cache_dir", "_commit_hash", "name_or_path", "token", "revision")


def save_tokenizer(tokenizer, meta: Optional[dict], folder: Path) -> None:
    """The tokenizer saved as transformers 4.x and 5.x both load it: its class named as 4.x knows it (5.x writes
    "TokenizersBackend"), and no key of the exporting machine's environment."""
    tokenizer.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in ENVIRONMENT_KEYS}
    config["tokenizer_class"] = "GPT2TokenizerFast" if is_bpe(meta) else "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """This model's weights as GPT2LMHeadModel's: Linear (out, in) -> Conv1D (in, out), the padded rows of the token
    embedding dropped, lm_head the (tied) token embedding. GPT-2 has a bias in every Linear and LayerNorm: a model
    trained with bias=False gets zeros there, which computes exactly what no bias does."""
    out = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        tensor = tensor.detach().to(torch.float32)
        out[key] = tensor.t().contiguous() if key.endswith(CONV1D_WEIGHTS) else tensor
    for name, module in model.transformer.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and module.bias is None:
            out[f"transformer.{name}.bias"] = torch.zeros(module.weight.shape[0])
    out["transformer.wte.weight"] = out["transformer.wte.weight"][: model.config.vocab_size].clone()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def hf_tokenizer(meta: Optional[dict], block_size: int, folder: Path):
    """A fast tokenizer that encodes and decodes exactly as this repo's tokenizer for `meta` does. For GPT-2 BPE: the
    packaged vocabulary files (checked by hash) copied into `folder` under the hub's names, and loaded from there."""
    from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast
    # left padding: a batch of prompts generates on from each prompt's end, as decoder-only models need
    # what a call returns, named: transformers 4.x otherwise adds token_type_ids, which GPT-2 embeds as positions'
    # offsets (the newline's row of the embedding added everywhere for a character model)
    settings = dict(model_max_length=block_size, clean_up_tokenization_spaces=False, padding_side="left",
                    model_input_names=["input_ids", "attention_mask"])
    if is_bpe(meta):  # bos, eos and unk are <|endoftext|> already; pad is too
        paths = check_gpt2_files(gpt2_files_dir())
        shutil.copyfile(paths["encoder.json"], Path(folder) / "vocab.json")
        shutil.copyfile(paths["vocab.bpe"], Path(folder) / "merges.txt")
        return GPT2TokenizerFast.from_pretrained(folder, pad_token="<|endoftext|>", **settings)
    if meta.get("tokenizer") != "char":
        raise UserError(f"the checkpoint's meta names tokenizer {meta.get('tokenizer')!r}; only GPT-2 BPE and "
                        f"character vocabularies export.")
    return PreTrainedTokenizerFast(tokenizer_object=characters(meta["chars"]), **settings)


def characters(chars: list[str]):
    """One token per character, ids in meta.json's order; decoding joins them with nothing in between."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character, newlines too
    tok.decoder = decoders.Fuse()
    return tok


def check_hf_dir(hf_dir: Path, writable: bool = True) -> Path:
    """The folder the export is written to (a symlink's target: the link stays): new or empty (checked before
    anything is loaded), in a writable folder (made if need be, so checked once the checkpoint is read)."""
    hf_dir = Path(hf_dir)
    if hf_dir.is_symlink():  # the folder it points to is the one replaced; the link stays
        hf_dir = hf_dir.resolve()
    if hf_dir.exists() and (not hf_dir.is_dir() or any(hf_dir.iterdir())):
        raise UserError(f"{hf_dir} already exists and is not empty; pass --hf_dir= a new folder (nothing there "
                        f"is overwritten).")
    if writable:  # the checkpoint's folder may be read-only: hf_dir's parent is what is written
        writing.check_writable_dir(hf_dir.parent, setting="hf_dir")
    return hf_dir


def export(checkpoint: Checkpoint, hf_dir: Path, temperature: float = 0.8, top_k: Optional[int] = 200) -> Path:
    """Write the Hugging Face directory: into a temporary folder beside hf_dir, renamed into place when complete."""
    try:
        with quiet_imports():  # transformers imports torchao: its CUDA-extension notes are noise here
            from transformers import GenerationConfig, GPT2LMHeadModel
            from transformers.utils import logging as hf_logging
    except Exception as e:  # missing, or installed but broken (a mismatched dependency raises anything)
        raise UserError(f"exporting needs transformers, which cannot be imported here ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:160] if str(e) else 'no message'}); pip install -r "
                        f"requirements.txt.") from None
    hf_logging.disable_progress_bar()  # "Writing model shards": one file, written in a moment
    hf_dir = check_hf_dir(hf_dir)
    model = build_model(checkpoint)
    if model.config.window:  # doc_mask exports: within one document HF's causal attention is the same attention
        raise UserError(f"this run attends through a window of {model.config.window} tokens, which Hugging Face's "
                        f"GPT-2 cannot express (its logits would differ); export a run trained with window=0.")
    config = hf_config(model, checkpoint.meta)
    hf_model = GPT2LMHeadModel(config)
    hf_model.load_state_dict(hf_state_dict(model), strict=True)
    sampled = temperature > 0
    # what transformers' own GPT-2 export carries (the end-of-text ids), sample.py's sampling, and the context as
    # max_length: a call without max_new_tokens stops there
    hf_model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        max_length=model.config.block_size,
        do_sample=sampled, temperature=temperature if sampled else None, top_k=top_k if sampled else None)
    # a short name of this process's own (hf_dir's may be 255 bytes already), made as any folder is (tempfile's are
    # 0700); a Ctrl-C or SIGTERM meanwhile is held until the folder is renamed or removed, so none is left behind
    staging = hf_dir.parent / f".export-{os.getpid()}.tmp"
    with errors.deferred_signals() as stop:
        write_staged(hf_model, checkpoint, model.config.block_size, staging, hf_dir, stop)
    return hf_dir


def write_staged(hf_model, checkpoint: Checkpoint, block_size: int, staging: Path, hf_dir: Path, stop) -> None:
    """The export written into `staging`, then renamed to hf_dir unless a signal came meanwhile (`stop.pending`)."""
    try:
        shutil.rmtree(staging, ignore_errors=True)  # a killed export's, of a process with this id
        staging.mkdir()
        hf_model.save_pretrained(staging, safe_serialization=True)
        save_tokenizer(hf_tokenizer(checkpoint.meta, block_size, staging), checkpoint.meta, staging)
        umask = os.umask(0)
        os.umask(umask)  # reading the umask means setting it: put back at once
        for path in staging.iterdir():  # safetensors writes its file 0600 whatever the umask
            path.chmod(0o666 & ~umask)
        if stop.pending is not None:
            return  # raised once the staging folder is gone
        if hf_dir.exists():
            hf_dir.rmdir()  # empty, checked above
        staging.rename(hf_dir)
    except (OSError, SafetensorError) as e:  # safetensors writes in Rust: a full disk is its own error type
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:160]
        raise UserError(f"could not write {hf_dir} ({reason}); pass --hf_dir= a writable folder with free space; "
                        f"nothing was left there.") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: Optional[list[str]] = None) -> int:
    found: dict = {}
    cfg = configure(globals(), sys.argv[1:] if argv is None else argv, LIMITS, found)
    # every problem of the command in one report: the settings, hf_dir, the checkpoint (read where all else is right)
    problems = list(found.values()) if found.keys() & {"out_dir", "hf_dir"} else list(found.values()) + [
        *problems_of(lambda: check_hf_dir(Path(cfg.hf_dir or Path(cfg.out_dir) / "hf"), writable=False)),
        *problems_of(lambda: find_checkpoint(Path(cfg.out_dir) / "ckpt.pt"))]
    errors.refuse_all(problems)
    checkpoint = load_checkpoint(Path(cfg.out_dir) / "ckpt.pt")
    target = export(checkpoint, Path(cfg.hf_dir or Path(cfg.out_dir) / "hf"), cfg.temperature, cfg.top_k)
    print(f"wrote {target}: GPT2LMHeadModel.from_pretrained({str(target)!r}) or "
          f"pipeline('text-generation', model={str(target)!r}) loads it; its context is "
          f"{checkpoint.model_config['block_size']} tokens, prompt and new tokens together")
    if checkpoint.model_config.get("doc_mask"):  # GPT-2 in transformers attends across documents (a window: an error)
        errors.note("this model was trained with doc_mask, which GPT-2 in transformers, ONNX Runtime and llama.cpp "
                    "cannot express: their logits match this project's on windows without an end-of-text token and "
                    "differ on windows holding one (docs/interop.md)")
    if not is_bpe(checkpoint.meta):  # no special token: lm-eval is told where a text starts
        print(f"a character vocabulary has no end-of-text token: give lm-eval --model_args "
              f"pretrained={target},prefix_token_id={newline_id(checkpoint.meta)} (its newline)")
    return 0


if __name__ == "__main__":
    runtime.run_main(main)
