# GPT-2 (124M) on OpenWebText, nanoGPT's recipe: ~2.85 val loss after ~5 days on 8x A100 40GB.
# torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py --attn=flash
# --attn=flash runs FlashAttention-2 (the PyTorch blog post's A100 choice), or on Hopper (H100, H200) cuDNN's flash
# kernel first, which beat FlashAttention-2 there; on an H200 --attn=sdpa still ran faster in this script (docs/bench.md);
# --attn=flash2 forces FlashAttention-2; --attn=auto measures and picks for you.
wandb_log = True
wandb_project = "owt"
wandb_run_name = "gpt2-124M"

dataset = "openwebtext"
# 12 batch size * 1024 block size * 40 gradaccum (5 per GPU on 8 GPUs) = 491,520 tokens per iteration
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8
# the PyTorch blog post's fast path: 50257 -> 50304, a multiple of 64, so lm_head's matmul gets aligned tensor-core tiles
pad_vocab = True

# 600k iterations: ~300B tokens
max_iters = 600000
lr_decay_iters = 600000

eval_interval = 1000
eval_iters = 200
log_interval = 10

weight_decay = 1e-1
