# nanoGPT's shakespeare_char recipe (config/train_shakespeare_char.py: 6 x 384, batch 64 x 256, the same data),
# redesigned for time to that recipe's best val loss on one GPU with what modded-nanogpt and nanochat publish: Muon
# for the blocks' matrices at a higher rate, a short warmup and an early anneal, bf16 and compile, SDPA's fastest
# kernel, and evaluation that costs an eighth of nanoGPT's. Aim: its loss in a third of that recipe's time (on this
# corpus; nanoGPT's published 1.47 is on tinyshakespeare, docs/quickstart.md).
# Designed, not yet measured on a GPU: python -m benchmarks.time_to_loss --compare=gpu measures it (docs/quickstart.md).
#   python train.py config/train_shakespeare_char_fast.py
out_dir = "out-shakespeare-char-fast"
eval_interval = 100     # the loss is seen within 100 steps of reaching the target
eval_iters = 20         # 20 x 64 x 256 = 330k tokens, three times the val split: nanoGPT's 200 read it 30 times over
eval_train = False      # val only (the training line has the train loss): half of each evaluation
log_interval = 50
always_save_checkpoint = False

dataset = "shakespeare_char"
wandb_project = "shakespeare-char"  # with --wandb_log=True: this recipe's own names, not train.py's GPT-2 ones
wandb_run_name = "fast"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.1           # 1,500 steps pass over the 4.3M training characters ~5.7 times: less to forget than 5,000's 19

optimizer = "muon"      # the blocks' matrices; AdamW (learning_rate) for embeddings, biases and norms
muon_lr = 2e-2          # the CPU quickstart's rates, which reached nanoGPT's CPU loss in a fifth of its time
learning_rate = 3e-3
max_iters = 1500        # nanoGPT's recipe: 5,000
lr_decay_iters = 1500
min_lr = 3e-4
warmup_iters = 50
early_decay_iters = 500  # an early anneal to a quarter of the peak by a third of the run (the CPU quickstart's
early_decay_to = 0.25   # lever: the loss falls fast once the rate does), then on to min_lr at the end
beta2 = 0.99

attn = "sdpa"           # SDPA picks the fastest kernel it has here: cuDNN on Hopper, flash on Ampere (docs/bench.md)
compile = True
