"""The foundation: errors, settings (configurator, --help), the runtime and joining the ranks, files and datasets, the
tokenizer, GPUs' datasheet peak FLOP/s, reading Hugging Face's GPT-2 files. It imports only itself and outside
packages; some of it only where a setting asks (distributed.py under torchrun, hf.py for from_pretrained)."""
