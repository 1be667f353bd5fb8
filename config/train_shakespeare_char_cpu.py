# The CPU quickstart: a small character-level GPT on the packaged Shakespeare plays, 3000 steps in ~2-5 minutes on
# 2 cores with AMX, AVX512-BF16 or AVX512, ~8 on an AVX2-only CPU (all in fp32 at this width, Muon's Newton-Schulz
# too); val 1.89 after ~15-45 s (docs/quickstart.md).
#   python train.py config/train_shakespeare_char_cpu.py
#   python sample.py --out_dir=out-shakespeare-char-cpu
# The data is prepared automatically the first time (data/shakespeare_char/prepare.py, offline).
# Tuned for time to loss (docs/quickstart.md): val 1.89 in a fifth of nanoGPT's CPU recipe's time.
out_dir = "out-shakespeare-char-cpu"
eval_interval = 50      # often enough to see a loss when it comes; 10 val batches cost ~0.2 s
eval_iters = 10
eval_train = False      # val only: the training line shows the train loss; half the evaluation time
log_interval = 50
always_save_checkpoint = False

dataset = "shakespeare_char"
wandb_project = "shakespeare-char"  # with --wandb_log=True: this recipe's own names, not train.py's GPT-2 ones
wandb_run_name = "cpu-quickstart"
gradient_accumulation_steps = 1
batch_size = 32         # Muon's step is a fixed cost (~20 ms on 2 cores): a bigger batch spreads it, and takes a higher lr
block_size = 64

n_layer = 2             # half the compute of 4 layers per token, and as fast to 1.89 per iteration
n_head = 4
n_embd = 128
dropout = 0.0
gelu = "none"           # the exact GELU (nanoGPT's): half the cost of the tanh one on a CPU

optimizer = "muon"      # the blocks' matrices; AdamW (learning_rate) for embeddings, biases and norms. Its
                        # Newton-Schulz runs in bf16 only where a bf16 step is faster (muon_dtype=auto), else in fp32
muon_lr = 2e-2
learning_rate = 3e-3
max_iters = 3000
lr_decay_iters = 3000
min_lr = 3e-4
warmup_iters = 30
early_decay_iters = 250  # an early anneal to a quarter of the peak by iter 250: the loss a short run reaches, early
early_decay_to = 0.25
beta2 = 0.99

device = "cpu"
dtype = "float32"   # bf16 autocast is faster only on CPUs with AMX, and this size is overhead-bound even there
compile = False     # compiling costs ~20 s and saves ~5% per step: not worth it for a run of minutes
