"""Features a setting opts into (sharded checkpoints, nanoGPT's files, compiled or int8 decoding, wandb), each imported
inside the functions that read its setting. They import the default modules (model.py, core/, attention/, engine/) and
never the scripts."""
