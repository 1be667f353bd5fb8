"""
The training log: one line on the console, one JSON line in out_dir/metrics.jsonl, and wandb when enabled; and the
clock of its ms_per_iter, which times training steps only.
"""

import json
import netrc
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from core.configurator import Settings
from core.errors import UserError
from core.runtime import Runtime


def check_wandb() -> None:
    """wandb_log=True: that wandb is installed and can log here, decided before anything is written. It logs offline
    or not at all by WANDB_MODE, online with a key (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc), and asks
    for one at a terminal; anywhere else wandb.init would stop the run with a traceback."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError("wandb_log=True needs the wandb package: pip install wandb, or pass --wandb_log=False.") \
            from None
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass  # no ~/.netrc, or one wandb cannot read either
    if sys.stdin is not None and sys.stdin.isatty():
        return  # wandb asks for a key
    raise UserError(f"wandb_log=True, but wandb has no login here (no WANDB_API_KEY, no {host} entry in ~/.netrc, no "
                    f"terminal to ask at): run `wandb login` once, log offline with WANDB_MODE=offline (wandb sync "
                    f"later), or pass --wandb_log=False.")


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
        text = "  ".join(f"{k} {100 * v:.2f}%" if k == "mfu" else f"{k} {v:.4g}" if isinstance(v, float)
                         else f"{k} {v}" for k, v in metrics.items())  # mfu: a percent, as bench's (JSON: a fraction)
        print(text, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if k != "iter"}, step=metrics["iter"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


class StepTimer:
    """Wall time of training steps only: pause it around evaluation and checkpointing."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.total = 0.0                    # seconds of training so far, for max_seconds
        self.window, self.steps = 0.0, 0    # since the last read, for ms per step
        self._t0 = None

    @property
    def running(self) -> bool:
        return self._t0 is not None

    def start(self) -> None:
        self.rt.synchronize()
        self._t0 = time.perf_counter()

    def pause(self) -> None:
        if self._t0 is not None:
            self.rt.synchronize()
            seconds = time.perf_counter() - self._t0
            self.total += seconds
            self.window += seconds
            self._t0 = None

    def step(self) -> None:
        self.steps += 1

    def read_and_reset(self) -> tuple[float, int]:
        """(seconds, steps) since the last read; a running timer keeps running."""
        running = self.running
        self.pause()
        seconds, steps = self.window, self.steps
        self.window, self.steps = 0.0, 0
        if running:
            self.start()
        return seconds, steps
