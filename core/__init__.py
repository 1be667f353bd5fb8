"""The core that training, sampling and benchmarking share: settings, runtime, checkpoints, data, generation."""
