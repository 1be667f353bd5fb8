# Evaluate OpenAI's gpt2 weights on OpenWebText (needs the hub or a local copy: --init_from=/path/to/gpt2).
batch_size = 8
eval_iters = 500  # more batches: a steadier estimate
eval_only = True
wandb_log = False
init_from = "gpt2"
