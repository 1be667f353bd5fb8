"""What the scripts run a model with, above model.py: the single-file checkpoint, its reader and what a resume adds,
train.py's start (settings, runtime, out_dir's lock, the data), the training step and its optimizers (AdamW, Muon),
the metrics log, and sampling. It imports core/ and the model; reading and writing the other formats (sharded,
nanoGPT's) and compiled or int8 decoding are in tools/, imported where their settings are read (checkpoint.py
only says where a sharded step lives)."""
