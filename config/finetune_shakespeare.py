# Fine-tune GPT-2 XL on Shakespeare (GPT-2 BPE): a few minutes on one A100. Data is prepared automatically.
# Offline, download gpt2-xl elsewhere and pass --init_from=/path/to/gpt2-xl.
out_dir = "out-shakespeare"
eval_interval = 5
eval_iters = 40
wandb_log = False
wandb_project = "shakespeare"
wandb_run_name = "ft"

dataset = "shakespeare"
init_from = "gpt2-xl"  # the largest GPT-2

always_save_checkpoint = False  # only save when val improves

# 1 batch_size * 32 grad_accum * 1024 tokens = 32,768 tokens/iter; shakespeare has ~1.3M train tokens: ~1 epoch ~ 40 iters
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20

# finetune at a constant learning rate
learning_rate = 3e-5
decay_lr = False
