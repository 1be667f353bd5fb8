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
    """A name close to one of INIT_WORDS is a typo, one error line, never a trip to the hub."""
    close = difflib.get_close_matches(name_or_path, INIT_WORDS, n=1, cutoff=0.6)
    if not Path(name_or_path).is_dir() and close and name_or_path not in INIT_WORDS:
        raise UserError(f"init_from={name_or_path!r} is not scratch, resume, a GPT-2 name or a local folder; did you "
                        f"mean --init_from={close[0]}?")
    return Path(name_or_path)


def load_hf_checkpoint(name_or_path: str) -> tuple[dict, dict]:
    """(config.json as a dict, state dict) from a local directory, or from the hub when it is a name."""
    path = check_init_from(name_or_path)
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download
            path = Path(snapshot_download(name_or_path, allow_patterns=["config.json", "*.safetensors"]))
        except Exception as e:
            raise UserError(f"could not get '{name_or_path}' from the Hugging Face hub ({type(e).__name__}); "
                            f"download it where there is network and pass the local directory instead.") from None
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json; pass a Hugging Face GPT-2 model directory.")
    hf_config = json.loads((path / "config.json").read_text())
    model_type = hf_config.get("model_type", "gpt2")
    missing = [k for k in ("n_positions", "vocab_size", "n_layer", "n_head", "n_embd") if k not in hf_config]
    if model_type != "gpt2" or missing:
        raise UserError(f"{path} holds a Hugging Face '{model_type}' model"
                        f"{' whose config.json lacks ' + ', '.join(missing) if missing else ''}, not GPT-2; pass a "
                        f"GPT-2 model directory (config.json's model_type 'gpt2').")
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file
        state_dict = load_file(path / "model.safetensors")
    elif (path / "pytorch_model.bin").is_file():
        state_dict = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UserError(f"{path} has neither model.safetensors nor pytorch_model.bin; pass a GPT-2 model directory.")
    return hf_config, state_dict
