"""Interop: GPT-2 weights from Hugging Face, and nanoGPT's checkpoints and data read as this project's."""
