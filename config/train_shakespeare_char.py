# A baby GPT on character-level Shakespeare, nanoGPT's recipe: ~3 minutes on one A100 (its README: val 1.47, on
# tinyshakespeare; this repo's packaged plays are another corpus, with another figure: docs/quickstart.md).
# The data is prepared automatically from the packaged plays the first time.
out_dir = "out-shakespeare-char"
eval_interval = 250   # keep frequent because we'll overfit
eval_iters = 200
log_interval = 10     # don't print too often
always_save_checkpoint = False  # only save when val improves

wandb_log = False
wandb_project = "shakespeare-char"
wandb_run_name = "mini-gpt"

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256      # context of up to 256 previous characters

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # with baby networks can afford to go a bit higher
max_iters = 5000
lr_decay_iters = 5000 # make equal to max_iters usually
min_lr = 1e-4         # learning_rate / 10 usually
beta2 = 0.99          # make a bit bigger because number of tokens per iter is small
warmup_iters = 100
