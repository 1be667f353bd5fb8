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
    """Wall time of training steps, kept without waiting on the device between log points. start and pause
    (around evaluation and checkpointing) synchronize; a lap is read right after the host read a value that step
    `it` produced (its loss), which waits for that step alone while the next one is already queued: so the
    seconds between two laps are the device's time for the steps between them."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.banked = 0.0                   # seconds of training before the last start
        self._t0 = None                     # when the timer last started, while it runs
        self._lap = None                    # (time, iter) of the last lap or start

    @property
    def running(self) -> bool:
        return self._t0 is not None

    @property
    def total(self) -> float:
        """Seconds of training so far, for max_seconds: the host's clock, which runs at most a step or so ahead."""
        return self.banked + (time.perf_counter() - self._t0 if self.running else 0.0)

    def start(self, it: int) -> None:
        self.rt.synchronize()
        self._t0 = time.perf_counter()
        self._lap = (self._t0, it)

    def pause(self) -> None:
        if self.running:
            self.rt.synchronize()
            self.banked += time.perf_counter() - self._t0
            self._t0 = self._lap = None

    def lap(self, it: int) -> tuple[float, int]:
        """(seconds, steps) from the last lap or start to the end of step `it`; (0, 0) when the timer was not
        running across them (the compiling step is not timed)."""
        if self._lap is None:
            return 0.0, 0
        now = time.perf_counter()
        seconds, steps = now - self._lap[0], it - self._lap[1]
        self._lap = (now, it)
        return seconds, steps
