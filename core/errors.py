"""
The one error type for bad input, and the one place a script turns it into an `error:` line, apart from torch so
that what only reads and writes files can raise it.
"""

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator


class UserError(ValueError):
    """Bad input from a user. The message says what was wrong and how to fix it; scripts print it as one
    `error: ...` line, without a traceback, with exit code 2. `own_rank`: a problem of this rank only (its GPU, its
    node's files), which that rank prints under torchrun even before the ranks have met."""

    def __init__(self, message: str = "", own_rank: bool = False):
        super().__init__(message)
        self.own_rank = own_rank


class StoppedWithRank0(UserError):
    """A rank stopping because rank 0's work failed: rank 0 prints its error line; this rank exits with 2 quietly, so
    a torchrun console shows the error once."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers, `timeout` and torchrun send) during a write deferred_signals guards, raised as Ctrl-C
    raises KeyboardInterrupt, so the same clean-up runs (temporary files removed, half-written checkpoints dropped).
    Elsewhere SIGTERM keeps its default action: the process ends at once, even while it waits in C (a device wait
    behind a dead peer's collective, a long matmul), which no Python handler could."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_once(error: type[KeyboardInterrupt]):
    """A handler that raises `error` once: the clean-up it starts (a temporary file removed, the resume hint) runs,
    and a second Ctrl-C or SIGTERM meanwhile ends the process at once, as their default action does, never a second
    traceback (a hung clean-up, a wandb upload say, can always be ended)."""
    def handler(signum, frame):
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        raise error()
    return handler


class Deferred:
    """The Ctrl-C or SIGTERM that arrived inside deferred_signals, as the exception it would have raised."""
    pending: KeyboardInterrupt | None = None


@contextlib.contextmanager
def deferred_signals() -> Iterator[Deferred]:
    """Ctrl-C and SIGTERM noted instead of raised, for a write that must end whole or be removed (a checkpoint, an
    export): the first is raised once the block ends, and a second one meanwhile ends the process at once, as their
    default action does."""
    deferred = Deferred()

    def note(signum, frame):  # raised once the block ends; a second signal meanwhile ends the process at once
        deferred.pending = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
    main_thread = threading.current_thread() is threading.main_thread()  # the one signals reach
    previous = {s: signal.signal(s, note) for s in STOP_SIGNALS} if main_thread else {}
    try:
        yield deferred
    finally:
        for s, handler in previous.items():  # the previous handlers back; stopping, a second signal ends the process
            signal.signal(s, signal.SIG_DFL if deferred.pending is not None else handler)
    if deferred.pending is not None:
        raise deferred.pending


def problems_of(work: Callable[[], object]) -> list[UserError]:
    """[] if work() runs, else its UserError (StoppedWithRank0 on the ranks but 0 where rank 0's failed: every rank
    goes on to the next check, and waits there for rank 0)."""
    try:
        work()
    except UserError as e:
        return [e]
    return []


def refuse_all(problems: list[UserError], hint: str = "") -> None:
    """One UserError saying every problem found, numbered, with `hint` after them (a problem that is itself such a
    list adds its own items); none raised when there is none. A rank other than 0 stops quietly (rank 0 prints the
    line)."""
    after_rank0 = [p for p in problems if isinstance(p, StoppedWithRank0)]  # rank 0 prints the error line
    if after_rank0:
        raise after_rank0[0]
    problems = [item for p in problems for item in getattr(p, "problems", [p])]
    if problems:
        text = " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)) if len(problems) > 1 else str(problems[0])
        error = UserError((f"{len(problems)} problems: " if len(problems) > 1 else "") + text
                          + (f" ({hint})" if hint else ""))
        error.problems = problems
        raise error


def exit_code(main: Callable[[], int | None], exiting: bool = False) -> int:
    """Run a script's main(): its return value (None is 0), or a UserError printed as one `error: ...` line on
    stderr and 2, or 130 on Ctrl-C, 143 on a SIGTERM during a guarded write (128 + the signal, as a shell reports it;
    elsewhere SIGTERM ends the process itself, which the shell reports as 143 too), or 0 quietly when the reader of
    its output went away (`| head`). The first Ctrl-C stops main and a second ends the process at once (_stop_once);
    an `exiting` process keeps that default action after main, so a Ctrl-C during Python's exit (atexit callbacks)
    ends it without a word."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    if main_thread:
        signal.signal(signal.SIGINT, _stop_once(KeyboardInterrupt))
    try:
        return main() or 0
    except UserError as e:
        line = error_line(e)
        if line is not None:
            print(line, file=sys.stderr)
        return 2
    except Terminated:
        if first_rank():
            print("stopped by SIGTERM", file=sys.stderr)
        return 143
    except KeyboardInterrupt:  # under torchrun every rank gets the Ctrl-C: rank 0 says so, once
        if first_rank():
            print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the output's reader ended (`| head`): what it wanted was printed, so nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's final flush writes nowhere
        return 0
    finally:
        if main_thread:
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if exiting or handler is None else handler)


def note(text: str) -> None:
    """The one way a `note: ...` line is printed (something the user may want to change, not an error): to stderr,
    flushed, by rank 0 alone under torchrun."""
    if first_rank():
        print(f"note: {text}", file=sys.stderr, flush=True)


def first_rank() -> bool:
    """Whether this process is rank 0 of a torchrun launch, or no launch's rank at all."""
    return "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("RANK", "0") == "0"


def error_line(e: UserError) -> str | None:
    """The `error:` line this process prints, or None where rank 0 prints it. Under torchrun the ranks share one
    console: rank 0 prints the errors every rank meets; another rank prints only a problem of that rank (its GPU, its
    node's files), naming the rank."""
    env = os.environ
    if isinstance(e, StoppedWithRank0):
        return None
    if "TORCHELASTIC_RUN_ID" not in env:  # one process, or a launcher that gives each rank a console of its own
        return f"error: {e}"
    rank = env.get("RANK", "0")
    if rank == "0":
        return f"error: {e}"
    return f"error: rank {rank}: {e}" if e.own_rank else None
