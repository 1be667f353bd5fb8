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
batch_size = 16
block_size = 128

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 2e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 2e-4
beta2 = 0.99
warmup_iters = 100

device = "cpu"
dtype = "float32"
compile = True
