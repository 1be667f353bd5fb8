"""
wandb_log=True, checked before anything is written: that wandb is installed and can log here (a key, a login, an
offline mode, or a terminal to ask at); elsewhere wandb.init would stop the run with a traceback.
"""

import netrc
import os
import sys
from urllib.parse import urlparse

from core.errors import UserError


def check_wandb() -> None:
    """wandb_log=True: that wandb can log here, decided before anything is written (elsewhere wandb.init would stop
    the run with a traceback)."""
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
