"""
The training log: one line on the console, one JSON line in out_dir/metrics.jsonl, and wandb when enabled.
"""

import json
from pathlib import Path

from configurator import Settings


class MetricsLog:
    """Console, out_dir/metrics.jsonl, and wandb when enabled. Only the master rank writes."""

    def __init__(self, cfg: Settings, run_config: dict, enabled: bool, to_file: bool = True):
        self.enabled, self.wandb = enabled, None
        self.path = Path(cfg.out_dir) / "metrics.jsonl" if to_file else None
        if enabled and cfg.wandb_log:
            import wandb  # mode (online/offline/disabled) comes from WANDB_MODE, never hard-coded
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=run_config)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        text = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        print(text, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if k != "iter"}, step=metrics["iter"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
