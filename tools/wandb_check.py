"""
wandb_log=True, checked before anything is written: that wandb is installed and can log here (a key, a login, an
offline mode, or a terminal to ask at) to a project name it takes; elsewhere wandb.init would stop the run with a
traceback. start_wandb bounds the wait for its server.
"""

import netrc
import os
import sys
from urllib.parse import urlparse

from core.errors import UserError


def check_wandb(project: str) -> None:
    """wandb_log=True: that wandb can log here, to a project name it takes, decided before anything is written
    (elsewhere wandb.init would stop the run with a traceback)."""
    refused = " ".join(sorted({c for c in project if c in "/\\#?%:"}))
    if refused or not 0 < len(project) <= 128:
        why = f"it holds {refused}" if refused else f"{len(project)} characters, not 1 to 128"
        raise UserError(f"wandb_project={project!r} is not a name wandb takes ({why}); pass --wandb_project= a name "
                        f"without / \\ # ? % :.")
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


INIT_TIMEOUT_S = 30  # wandb's own default waits 90 s for its server, then retries; a run without network says so sooner


def start_wandb(project: str, name: str, config: dict):
    """wandb.init, or one error line when its server cannot be reached (no network) or refuses the run."""
    import wandb  # mode (online/offline/disabled) comes from WANDB_MODE, never hard-coded
    try:
        return wandb.init(project=project, name=name, config=config,
                          settings=wandb.Settings(init_timeout=INIT_TIMEOUT_S))
    except wandb.errors.Error as e:
        reason = " ".join(str(e).split())[:160]
        raise UserError(f"wandb could not start the run ({type(e).__name__}: {reason}); check the network, log "
                        f"offline with WANDB_MODE=offline (wandb sync later), or pass --wandb_log=False.") from None
