# The CPU quickstart: a small character-level GPT on the packaged Shakespeare plays in a few minutes on a laptop.
#   python train.py config/train_shakespeare_char_cpu.py
#   python sample.py --out_dir=out-shakespeare-char-cpu
# The data is prepared automatically the first time (data/shakespeare_char/prepare.py, offline).
out_dir = "out-shakespeare-char-cpu"
eval_interval = 250
eval_iters = 20
log_interval = 50
always_save_checkpoint = False

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 3e-3  # 3x nanoGPT's CPU recipe: the biggest win per second at this size
max_iters = 3000
lr_decay_iters = 3000
min_lr = 3e-4
beta2 = 0.99
warmup_iters = 100

device = "cpu"
dtype = "float32"   # this size is overhead-bound; bf16 pays only on CPUs with AMX (see README)
compile = False     # compiling costs ~20 s here and saves ~5% per step: not worth it for a 2-minute run
