"""
Sample from a trained model, or read the same weights through every attention implementation and compare.

$ python sample.py --out_dir=out-shakespeare-char
$ python sample.py --init_from=gpt2 --start="FILE:prompt.txt" --num_samples=5 --max_new_tokens=100
$ python sample.py --out_dir=out-shakespeare-char --compare=all --num_samples=1 --json=compare.json

--compare runs compare.py: the claim of PyTorch's post that the original attention and SDPA sample alike.
"""

import json as jsonlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import runtime
from checkpoint import Checkpoint
from configurator import configure
from errors import UserError
from model import GPT, check_attention
from runtime import Runtime
from tokenizer import Tokenizer, tokenizer_from_meta

# -----------------------------------------------------------------------------
# I/O
init_from = "resume"              # 'resume' (out_dir/ckpt.pt), or GPT-2 weights: 'gpt2', 'gpt2-xl', ..., a local HF dir
out_dir = "out"                   # the folder train.py wrote ckpt.pt to
start = "\n"                      # the prompt, or "FILE:path" to read it from a file ("<|endoftext|>" for none)
# sampling
num_samples = 3                   # samples to draw (for each implementation with --compare)
max_new_tokens = 500              # new tokens per sample
temperature = 0.8                 # 1.0 samples the model's distribution, lower is more conservative, 0 is greedy
top_k = 200                       # sample among the top_k most likely tokens only; None for all
seed = 1337                       # seed of the sampling generator: the same seed gives the same text
# model and precision
attn = None                       # a model.ATTENTION key; None: the checkpoint's ('sdpa' for GPT-2 weights)
device = "auto"                   # auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps
dtype = "auto"                    # auto (bf16 where supported, fp16 on older GPUs, else fp32), float32, bfloat16, ...
compile = False                   # torch.compile the model: slow to start, faster per token
# comparison
compare = ""                      # "manual,sdpa,flash" or "all": compare the same weights through each of them
json = ""                         # write every number (settings, tokens, timings, errors) to this JSON file
# -----------------------------------------------------------------------------
LIMITS = {"num_samples": "[1, inf)", "max_new_tokens": "[1, inf)", "temperature": "[0, inf)", "top_k": "[1, inf)",
          "seed": "[0, inf)"}  # the allowed range of every numeric setting (top_k may also be None)



@dataclass
class Sampling:
    num_samples: int
    max_new_tokens: int
    temperature: float
    top_k: Optional[int]
    seed: int


# -----------------------------------------------------------------------------
# model, tokenizer, prompt

def load_model(init_from: str, out_dir: str, attn: Optional[str]) -> tuple[GPT, Tokenizer, str]:
    """The model (fp32, eval mode, on CPU), the tokenizer of its data, and where both came from."""
    if init_from == "resume":
        path = Path(out_dir) / "ckpt.pt"
        checkpoint = Checkpoint.load(path)
        model = checkpoint.build_model()
        tok = tokenizer_from_meta(checkpoint.meta, source=f"the meta of {path}")
        source = f"{path} (iter {checkpoint.iter_num})"
    else:
        model, tok, source = GPT.from_pretrained(init_from), tokenizer_from_meta(None), init_from
    if attn is not None:
        model.set_attention(attn)
    if model.config.vocab_size > tok.vocab_size:
        raise UserError(f"the model has vocab_size={model.config.vocab_size} but its tokenizer only "
                        f"{tok.vocab_size} tokens; sample from a checkpoint trained on this tokenizer's data.")
    return model.eval(), tok, source


def read_prompt(start: str) -> str:
    if not start.startswith("FILE:"):
        return start
    path = Path(start.removeprefix("FILE:")).expanduser()
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist; pass --start=FILE: and an existing text file.")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompt file {path} ({type(e).__name__}); pass a readable UTF-8 file.") from None


def encode_prompt(tok: Tokenizer, text: str) -> list[int]:
    ids = tok.encode(text)
    if not ids:
        raise UserError("the prompt is empty; pass --start=TEXT or --start=FILE:path "
                        "(for GPT-2 BPE, --start='<|endoftext|>' starts from nothing).")
    return ids


# -----------------------------------------------------------------------------
# generation

def generate(model: GPT, prompt: list[int], rt: Runtime, sampling: Sampling, use_cache: bool = True,
             warmup: int = 8) -> tuple[list[list[int]], list[float]]:
    """num_samples samples from one generator seeded with sampling.seed: the new tokens of each, and seconds each.
    An untimed run of `warmup` tokens first pays for one-time work (CPU kernels are built per shape)."""
    x = torch.tensor([prompt], dtype=torch.long, device=rt.device)  # (1, T)
    generator = torch.Generator(rt.device).manual_seed(sampling.seed)
    samples, seconds = [], []
    with rt.autocast():
        model.generate(x, warmup, sampling.temperature, sampling.top_k, torch.Generator(rt.device), use_cache)
        for _ in range(sampling.num_samples):
            y, took = runtime.time_call(
                lambda: model.generate(x, sampling.max_new_tokens, sampling.temperature, sampling.top_k, generator, use_cache), rt)
            seconds.append(took)
            samples.append(y[0, len(prompt):].tolist())  # y: (1, T + new)
    return samples, seconds


def full_warmup(model: GPT, sampling: Sampling) -> int:
    """Warm-up tokens that meet every shape a timed run will (the cache refills past block_size)."""
    return min(sampling.max_new_tokens, model.config.block_size + 1)


def tokens_per_s(seconds: list[float], new_tokens: int) -> dict:
    """Generation speed over the samples: median, quartiles and extremes of tokens/s."""
    return runtime.summarize([new_tokens / s for s in seconds])


def print_samples(tok: Tokenizer, prompt: list[int], samples: list[list[int]]) -> None:
    for sample in samples:
        print(tok.decode(prompt + sample))
        print("---------------")


# -----------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    cfg = configure(globals(), sys.argv[1:] if argv is None else argv, LIMITS)
    if cfg.json:  # find out now, not after a long comparison
        runtime.check_writable_dir(Path(cfg.json).parent, "json")
    rt = runtime.resolve_runtime(cfg.device, cfg.dtype)
    model, tok, source = load_model(cfg.init_from, cfg.out_dir, cfg.attn)
    prompt = encode_prompt(tok, read_prompt(cfg.start))
    sampling = Sampling(cfg.num_samples, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.seed)
    report = {"settings": cfg.as_dict(), "device": rt.device, "device_name": rt.name, "dtype": rt.dtype,
              "source": source, "prompt_tokens": len(prompt)}
    print(f"{source}: {model.get_num_params() / 1e6:.2f}M parameters, {rt.dtype} on {rt.name}")
    if cfg.compare:
        import compare  # the comparison harness imports this module: only now, when it is asked for
        report.update(compare.compare(cfg.compare, model.to(rt.device), tok, rt, sampling, prompt, cfg.compile))
    else:
        report.update(sample(model, tok, rt, sampling, prompt, cfg.compile))
    if cfg.json:
        write_json(Path(cfg.json), report)
    return 0


def sample(model: GPT, tok: Tokenizer, rt: Runtime, sampling: Sampling, prompt: list[int], compile: bool) -> dict:
    """Print num_samples samples and the generation speed; return the tokens, texts and tokens/s."""
    check_attention(model.config.attn, rt.device_type, rt.torch_dtype, 0.0, model.config.head_size,
                    needs_grad=False, seq_len=model.config.block_size)
    model.to(rt.device)
    if compile:
        model.compile()
    warmup = full_warmup(model, sampling) if compile else 8
    samples, seconds = generate(model, prompt, rt, sampling, warmup=warmup)
    print_samples(tok, prompt, samples)
    rate = tokens_per_s(seconds, sampling.max_new_tokens)
    print(f"attn={model.config.attn}: {rate['median']:.1f} tokens/s (median of {sampling.num_samples} samples, "
          f"{rate['min']:.1f}-{rate['max']:.1f}) with the KV cache")
    return dict(attn=model.config.attn, samples=samples, texts=[tok.decode(prompt + x) for x in samples],
                tokens_per_s=rate)


def write_json(path: Path, report: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(jsonlib.dumps(report, indent=1) + "\n")
    except OSError as e:
        raise UserError(f"could not write {path} ({e.strerror or e}); pass --json= a writable path.") from None
    print(f"wrote {path}")


if __name__ == "__main__":
    runtime.run_main(main)
