"""
GPT-2 weights in Hugging Face's format, read from a local directory or the hub, with one error line where they are
not GPT-2's; GPT.from_pretrained renames them to the model's (model.from_hf_names) and builds the model.

    model = GPT.from_pretrained("gpt2", dict(attn="flash"))
"""

import difflib
import json
from pathlib import Path

import torch

from core.errors import UserError

INIT_WORDS = ("scratch", "resume", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # what --init_from= names


def read_gpt2(name_or_path: str) -> tuple[dict, dict]:
    """GPT-2's shape (GPTConfig's fields) and its weights, in Hugging Face's names."""
    hf_config, state_dict = load_hf_checkpoint(name_or_path)
    shape = dict(block_size=hf_config["n_positions"], vocab_size=hf_config["vocab_size"],
                 n_layer=hf_config["n_layer"], n_head=hf_config["n_head"], n_embd=hf_config["n_embd"], bias=True,
                 gelu=gelu_of(hf_config, name_or_path))
    return shape, state_dict


# GPT2Config.activation_function -> GPTConfig.gelu: OpenAI's GPT-2 uses the tanh approximation ("gelu_new");
# nanoGPT and models exported from here with gelu='none' use the exact one ("gelu")
HF_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def gelu_of(hf_config: dict, source: str) -> str:
    """The GELU a GPT-2 config names, or one error line on a config this model cannot reproduce."""
    activation = hf_config.get("activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise UserError(f"{source} uses activation_function={activation!r}; this GPT-2 reads only "
                        f"{', '.join(HF_ACTIVATIONS)}.")
    n_inner = hf_config.get("n_inner")
    if n_inner not in (None, 4 * hf_config["n_embd"]) or hf_config.get("scale_attn_by_inverse_layer_idx"):
        raise UserError(f"{source} is not GPT-2's shape (n_inner={n_inner}, scale_attn_by_inverse_layer_idx="
                        f"{hf_config.get('scale_attn_by_inverse_layer_idx')}); only 4 x n_embd MLPs and plain "
                        f"1/sqrt(head_size) attention load.")
    return HF_ACTIVATIONS[activation]


def check_init_from(name_or_path: str) -> Path:
    """A name close to one of INIT_WORDS is a typo, and an empty name or a local path that is no folder is named, each
    one error line, never a trip to the hub (which takes owner/name ids)."""
    close = difflib.get_close_matches(name_or_path, INIT_WORDS, n=1, cutoff=0.6)
    path = Path(name_or_path)
    if not path.is_dir() and close and name_or_path not in INIT_WORDS:
        raise UserError(f"init_from={name_or_path!r} is not scratch, resume, a GPT-2 name or a local folder; did you "
                        f"mean --init_from={close[0]}?")
    local = not name_or_path.strip() or name_or_path.startswith((".", "/", "~")) or path.exists()
    if name_or_path not in INIT_WORDS and local and (not path.is_dir() or not name_or_path.strip()):
        raise UserError(f"init_from={name_or_path!r} is not scratch, resume, {', '.join(INIT_WORDS[2:])}, a local "
                        f"folder of GPT-2 weights (config.json and model.safetensors) nor a hub id (owner/name); pass "
                        f"one of them.")
    return path


GPT2_SIZES = {"gpt2": (12, 768), "gpt2-medium": (24, 1024), "gpt2-large": (36, 1280), "gpt2-xl": (48, 1600)}


def gpt2_shape(name_or_path: str) -> dict:
    """The block_size, vocab_size, n_layer and n_embd of the weights init_from names, before they are read: GPT-2's
    for its names (each 1024 positions of its 50257 tokens), a local folder's config.json (a hub id is known only
    once downloaded: {})."""
    path = check_init_from(name_or_path)
    if name_or_path in GPT2_SIZES:
        return dict(block_size=1024, vocab_size=50257, n_layer=GPT2_SIZES[name_or_path][0],
                    n_embd=GPT2_SIZES[name_or_path][1])
    if not path.is_dir():
        return {}
    c = read_config(path)
    return dict(block_size=c["n_positions"], vocab_size=c["vocab_size"], n_layer=c["n_layer"], n_embd=c["n_embd"])


def read_config(path: Path) -> dict:
    """A GPT-2 folder's config.json, or one error line saying what the folder is instead."""
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json; pass a Hugging Face GPT-2 model directory.")
    try:
        hf_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"could not read {path / 'config.json'} ({type(e).__name__}); pass a Hugging Face GPT-2 "
                        f"model directory.") from None
    model_type = hf_config.get("model_type", "gpt2") if isinstance(hf_config, dict) else None
    missing = [k for k in ("n_positions", "vocab_size", "n_layer", "n_head", "n_embd") if k not in hf_config] \
        if isinstance(hf_config, dict) else ["everything"]
    if model_type != "gpt2" or missing:
        raise UserError(f"{path} holds a Hugging Face '{model_type}' model"
                        f"{' whose config.json lacks ' + ', '.join(missing) if missing else ''}, not GPT-2; pass a "
                        f"GPT-2 model directory (config.json's model_type 'gpt2').")
    return hf_config


def load_hf_checkpoint(name_or_path: str) -> tuple[dict, dict]:
    """(config.json as a dict, state dict) from a local directory, or from the hub when it is a name."""
    path = check_init_from(name_or_path)
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download
            path = Path(snapshot_download(name_or_path, allow_patterns=["config.json", "*.safetensors"]))
        except Exception as e:
            raise UserError(f"init_from={name_or_path!r}: could not get it from the Hugging Face hub "
                            f"({type(e).__name__}); download it where there is network and pass the local directory "
                            f"instead.") from None
    hf_config = read_config(path)
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file
        state_dict = load_file(path / "model.safetensors")
    elif (path / "pytorch_model.bin").is_file():
        state_dict = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UserError(f"{path} has neither model.safetensors nor pytorch_model.bin; pass a GPT-2 model directory.")
    return hf_config, state_dict
