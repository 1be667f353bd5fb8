"""What runs a model, above model.py and below the scripts: checkpoints (one reader for every format), decoding
(compiled steps, int8, sampling), attn=auto, metrics, DDP/FSDP2 wrapping and Muon. It imports core/ and the model,
never the scripts or the measuring tools."""
