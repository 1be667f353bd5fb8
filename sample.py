"""
Sample from a trained model, or read the same weights through every attention implementation and compare.

$ python sample.py --out_dir=out-shakespeare-char
$ python sample.py --init_from=gpt2 --start="FILE:prompt.txt" --num_samples=5 --max_new_tokens=100
$ python sample.py --out_dir=out-shakespeare-char --compile=True --quantize=int8   # fast: tools/decoding.py
$ python sample.py --out_dir=out-shakespeare-char --compare=all --num_samples=1 --json=compare.json

The num_samples samples are drawn together, as one batch. --compare runs compare.py: the claim of PyTorch's post
that the original attention and SDPA sample alike (with --quantize=int8, also what int8 weights cost).
"""

if __name__ == "__main__":  # a Ctrl-C while the imports below load ends the process quietly (main handles its own)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import sys
from pathlib import Path
from typing import Optional

from core import runtime
from engine.checkpoint import POINTER, sharded_folder
from engine.reader import build_model, find_checkpoint, load_checkpoint
from core.configurator import PATH, SEED, configure, one_of
from core import errors
from core.errors import UserError, problems_of
from engine.generate import (QUANTIZE, Decoder, Sampling, draw_samples, for_inference, full_warmup, print_samples,
                             tokens_per_s, weight_bytes)
from model import GPT, IMPLEMENTATIONS
from core.runtime import Runtime
from core.tokenizer import Tokenizer, tokenizer_from_meta

# -----------------------------------------------------------------------------
# I/O
init_from = "resume"              # 'resume' (out_dir/ckpt.pt), or GPT-2 weights: 'gpt2', 'gpt2-xl', ..., a local HF dir
out_dir = "out"                   # the folder train.py wrote ckpt.pt to
data_dir = ""                     # the data folder a checkpoint was trained on (--compare's held-out val.bin, and a
                                  # nanoGPT run's meta.pkl); empty: the one the checkpoint names
start = "\n"                      # the prompt, or "FILE:path" to read it from a file: the whole file is one prompt,
                                  # several lines included, which every sample continues ("<|endoftext|>" for none)
# sampling
num_samples = 3                   # samples to draw (for each implementation with --compare)
max_new_tokens = 500              # new tokens per sample
temperature = 0.8                 # 1.0 samples the model's distribution, lower is more conservative, 0 is greedy
top_k = 200                       # sample among the top_k most likely tokens only; None for all
seed = 1337                       # seed of the sampling generator: the same seed gives the same text
# model and precision
attn = None                       # a model.IMPLEMENTATIONS key, or 'auto' (measured here); None: the checkpoint's
attn_auto_budget = 20.0           # attn='auto': seconds to spend measuring (a cached decision takes none)
attn_auto_refresh = False         # attn='auto': measure again even when an earlier run decided this workload
device = "auto"                   # auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps
dtype = "auto"                    # the weights' dtype: auto (bf16 on GPUs from Ampere and CPUs with AMX, fp16 on
                                  # older GPUs, else fp32), float32, bfloat16, float16
quantize = ""                     # "int8": int8 weight-only weights (torchao), a quarter of fp32's bytes per token
compile = False                   # compile the prefill and the decode step: slow to start, faster per token
threads = 0                       # CPU threads; 0: OMP_NUM_THREADS if set, else torch's default (one per physical
                                  # core)
# comparison
compare = ""                      # "manual,sdpa,flash" or "all": compare the same weights through each of them
json = ""                         # write every number (settings, tokens, timings, errors) to this JSON file
# -----------------------------------------------------------------------------
# the allowed range of every numeric setting and the words of every choice
LIMITS = {"num_samples": "[1, inf)", "max_new_tokens": "[1, inf)", "temperature": "[0, inf)",
          "top_k": "[1, inf) int or None",
          "seed": SEED, "attn": one_of("auto", *IMPLEMENTATIONS), "dtype": one_of("auto", *runtime.DTYPES),
          "quantize": one_of(*QUANTIZE), "attn_auto_budget": "(0, inf)", "threads": "[0, inf) int",
          "out_dir": PATH, "json": PATH, "data_dir": PATH, "init_from": PATH}



# -----------------------------------------------------------------------------
# model, tokenizer, prompt

def load_model(init_from: str, out_dir: str, attn: Optional[str] = None,
               data_dir: str = "") -> tuple[GPT, Tokenizer, str, dict]:
    """The model (fp32, eval mode, on CPU), the tokenizer of its data, where both came from, and the checkpoint's meta
    and settings (held_out_folder's; empty for GPT-2 weights); `attn`: the one typed (None: the checkpoint's)."""
    trained_on = {}
    if init_from == "resume":
        path = Path(out_dir) / "ckpt.pt"
        checkpoint = load_checkpoint(path, data_dir=Path(data_dir) if data_dir else None)
        path = sharded_folder(path) or path  # what was read: ckpt.pt, or the newer sharded step
        model = build_model(checkpoint, **({} if attn is None else {"attn": "sdpa" if attn == "auto" else attn}))
        tok = tokenizer_from_meta(checkpoint.meta, source=f"the meta of {path}")
        source = f"{path} (iter {checkpoint.iter_num})"
        trained_on = dict(meta=checkpoint.meta or {}, settings=checkpoint.settings)
    else:
        given = Path(init_from)
        out = given.parent if given.is_file() and given.suffix == ".pt" else given
        if (out / "ckpt.pt").exists() or (out / POINTER).is_file():  # train.py's, not Hugging Face's
            raise UserError(f"{init_from} is a checkpoint train.py wrote, which --init_from= does not read (it "
                            f"takes GPT-2 weights); pass --init_from=resume --out_dir={out}.")
        model, tok, source = GPT.from_pretrained(init_from), tokenizer_from_meta(None), init_from
        if model.config.vocab_size != tok.vocab_size:  # e.g. a character model exported by export_hf.py
            raise UserError(f"{init_from} has a {model.config.vocab_size}-token vocabulary, not GPT-2's; sample.py "
                            f"reads Hugging Face directories with GPT-2 BPE only - sample from the training out_dir.")
    if model.config.vocab_size > tok.vocab_size:
        raise UserError(f"the model has vocab_size={model.config.vocab_size} but its tokenizer only "
                        f"{tok.vocab_size} tokens; sample from a checkpoint trained on this tokenizer's data.")
    return model.eval(), tok, source, trained_on


def held_out_folder(data_dir: str, meta: Optional[dict] = None, settings: Optional[dict] = None) -> Optional[Path]:
    """The data folder the checkpoint was trained on, if it still holds val.bin: --data_dir=, else the folder its
    vocabulary came from (a nanoGPT run's meta.pkl; None where it was not found), else the data its settings name."""
    from core.dataset import dataset_dir
    meta, settings = meta or {}, settings or {}
    if data_dir or "data_dir" in meta:
        folder = data_dir or meta["data_dir"]
    elif not settings:  # GPT-2 weights
        folder = None
    else:
        try:
            folder = dataset_dir(settings.get("data_dir", ""), settings.get("dataset", ""))
        except UserError:
            folder = None
    return Path(folder) if folder and (Path(folder) / "val.bin").is_file() else None


def read_prompt(start: str) -> str:
    if not start.startswith("FILE:"):
        return start
    path = Path(start.removeprefix("FILE:")).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(f"prompt file {path} {what}; pass --start=FILE: and an existing text file.")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompt file {path} ({type(e).__name__}); pass a readable UTF-8 file.") from None


def encode_prompt(tok: Tokenizer, text: str, default: bool = False) -> list[int]:
    """The prompt's ids; `default`: the prompt is --start's default, which the error line says."""
    try:
        ids = tok.encode(text)
    except UserError as e:
        which = f"the default prompt (--start={text!r})" if default else "the prompt"
        raise UserError(f"{which}: {e} (pass --start= text made of those characters, or --start=FILE:path)") from None
    if not ids:
        raise UserError("the prompt is empty; pass --start=TEXT or --start=FILE:path "
                        "(for GPT-2 BPE, --start='<|endoftext|>' starts from nothing).")
    return ids


# -----------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    found: dict = {}
    cfg = configure(globals(), sys.argv[1:] if argv is None else argv, LIMITS, found)
    # every problem of the command in one report, before the model is moved or anything is written
    made = {}  # the prompt's text, the runtime and the model, where their settings are in range
    checks = [lambda: made.update(text=read_prompt(cfg.start))] if "start" not in found else []
    if cfg.json and "json" not in found:  # find out now, not after a long comparison
        from core.writing import check_writable_file  # only a run that writes a file
        checks.append(lambda: check_writable_file(Path(cfg.json), "json"))
    if cfg.compile:
        checks.append(runtime.check_compile_cache)
    if cfg.quantize:
        from tools.decoding import int8_weights
        checks.append(int8_weights)
    if cfg.compare:  # its names checked before anything is loaded
        from benchmarks import compare  # the comparison: only when it is asked for
        checks.append(lambda: compare.attention_names(cfg.compare))
    if not found.keys() & {"device", "dtype", "threads"}:
        checks.append(lambda: made.update(rt=runtime.resolve_runtime(cfg.device, cfg.dtype, threads=cfg.threads)))
    problems = list(found.values()) + [p for check in checks for p in problems_of(check)]
    if not problems:  # the model is read only where nothing else is wrong; else only whether a checkpoint is there
        problems += problems_of(lambda: made.update(loaded=load_model(cfg.init_from, cfg.out_dir, cfg.attn,
                                                                      cfg.data_dir)))
    elif cfg.init_from == "resume" and "out_dir" not in found:
        problems += problems_of(lambda: find_checkpoint(Path(cfg.out_dir) / "ckpt.pt"))
    errors.refuse_all(problems)
    rt, (model, tok, source, trained_on) = made["rt"], made["loaded"]
    c = model.config  # the KV cache of num_samples sequences, and a step's logits, before any is made
    runtime.check_memory_need({"the KV cache": (2 * c.n_layer * cfg.num_samples * c.block_size * c.n_embd *
                                                rt.torch_dtype.itemsize, "num_samples"),
                               "logits": (4 * cfg.num_samples * c.padded_vocab_size, "num_samples")}, rt)
    prompt = encode_prompt(tok, made["text"], default="start" not in cfg.set_by)
    sampling = Sampling(cfg.num_samples, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.seed)
    report = {"settings": cfg.as_dict(), "device": rt.device, "device_name": rt.name, "dtype": rt.dtype,
              "source": source, "prompt_tokens": len(prompt)}
    print(f"{source}: {model.get_num_params() / 1e6:.2f}M parameters, {rt.dtype} on {rt.name}")
    attn = cfg.attn or model.config.attn  # None: the checkpoint's
    if attn == "auto" and not cfg.compare:  # --compare runs every implementation anyway
        report["attn_auto"], attn = choose_attention(model, rt, cfg, len(prompt))
    if cfg.compare:
        report.update(compare.compare(cfg.compare, model.to(rt.device), tok, rt, sampling, prompt, cfg.compile,
                                      cfg.quantize, held_out_folder(cfg.data_dir, **trained_on)))
    else:
        report.update(sample(model, attn, tok, rt, sampling, prompt, cfg.compile, cfg.quantize))
    if cfg.json:
        from core.writing import write_json
        write_json(Path(cfg.json), report, "json")
        print(f"wrote {cfg.json}")
    return 0


def choose_attention(model: GPT, rt: Runtime, cfg, prompt_len: int) -> tuple[dict, str]:
    """attn='auto': the table and the fastest implementation for this sampling (its batch, prompt, dtype, mask,
    compile), measured or read from the cache of earlier decisions (attn_auto.py)."""
    from attention.attn_auto import Workload, choose
    # the keys a decode step sees midway through the text, for as many steps as it has new tokens: a generation's
    # cost, not a one-token call's
    midway = min(prompt_len + cfg.max_new_tokens // 2, model.config.block_size)
    workload = Workload.of(model.config, rt, cfg.num_samples, midway, training=False, compiled=cfg.compile,
                           new_tokens=cfg.max_new_tokens)
    decision = choose(workload, rt, IMPLEMENTATIONS, cfg.attn_auto_budget, cfg.attn_auto_refresh)
    print(decision.line())
    return decision.metrics(), decision.pick


def sample(model: GPT, attn: str, tok: Tokenizer, rt: Runtime, sampling: Sampling, prompt: list[int], compile: bool,
           quantize: str = "") -> dict:
    """Print num_samples samples through `attn` and the generation speed; return the tokens, texts and tokens/s."""
    model = for_inference(model, rt.device, rt.torch_dtype, quantize).set_attention(attn, dtype=rt.torch_dtype)
    decoder = Decoder(model, compile)
    warmup = full_warmup(model, sampling) if compile else 8
    samples, seconds, warmup_s = draw_samples(decoder, prompt, rt, sampling, warmup=warmup)
    print_samples(tok, prompt, samples)
    rate = tokens_per_s(seconds, sampling)
    weights = f"{quantize} weights, " if quantize else ""
    per_s = weight_bytes(model) * rate / sampling.num_samples  # batch 1 reads every weight once a token
    read = f"{per_s / 1e9:.1f} GB/s" if per_s >= 1e9 else f"{per_s / 1e6:.0f} MB/s"
    print(f"attn={model.config.attn}: {rate:.1f} tokens/s ({sampling.num_samples} x {sampling.max_new_tokens} new "
          f"tokens in one batch, {weights}KV cache{', compiled' if compile else ''}), weights read at {read}"
          + (f"; compiling took {warmup_s:.1f} s, untimed" if compile else ""))
    return dict(attn=model.config.attn, samples=samples, texts=[tok.decode(prompt + x) for x in samples],
                tokens_per_s=rate, compile_s=warmup_s if compile else None, gb_per_s=per_s / 1e9)


if __name__ == "__main__":
    runtime.run_main(main)
