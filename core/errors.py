"""
The one error type for bad input, and the one place a script turns it into an `error:` line, apart from torch so
that what only reads and writes files can raise it.
"""

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator


class UserError(ValueError):
    """Bad input from a user. The message says what was wrong and how to fix it; scripts print it alone, as one
    `error: ...` line, with exit code 2."""


class StoppedWithRank0(UserError):
    """A rank stopping because rank 0's work failed: rank 0 prints its sentence; this rank exits with 2 quietly, so
    a torchrun console shows the error once, not after a line pointing to it."""


QUIET_RANK_PAUSE_S = 1.0  # torchrun looks every 0.1 s: rank 0 ends first, and its report names rank 0's error


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers, `timeout` and torchrun send) during a write held_signals guards, raised where Ctrl-C
    raises KeyboardInterrupt, so the same clean-up runs (temporary files removed, half-written checkpoints dropped)."""


def _terminate(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Across a write that must end whole or not at all, SIGTERM raises Terminated once Python runs again, so the
    write's clean-up runs. Everywhere else SIGTERM keeps its default action: the process ends at once, even while
    it waits in C (a device wait behind a dead peer's collective, a long matmul), which no Python handler could."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may take signals
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_code(main: Callable[[], int | None]) -> int:
    """Run a script's main(): its return value (None is 0), or a UserError printed alone as one `error: ...` line on
    stderr and 2, or 130 on Ctrl-C, 143 on a SIGTERM during a held write (128 + the signal, as a shell reports it;
    elsewhere SIGTERM ends the process itself, which the shell reports as 143 too)."""
    try:
        return main() or 0
    except UserError as e:
        if isinstance(e, StoppedWithRank0) or os.environ.get("RANK", "0") != "0":  # every rank refuses alike
            time.sleep(QUIET_RANK_PAUSE_S)  # rank 0 says it once, and is torchrun's root cause
            return 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        print("stopped by SIGTERM", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
