"""A refusal (a bad flag, flags that cannot work together) said once by a job of several processes.

Under torchrun every rank parses the same command line and mostly reaches the same refusal. The law:
rank 0 prints it, every rank leaves with the same status (2, as argparse's), and a refusal is never
lost: another rank prints nothing when rank 0 refused the same thing, and prints its own, as
``rank R: ...``, when rank 0's differs, when rank 0 passed its checks, or when rank 0 says nothing
within ``WAIT_S``.

How the ranks agree: torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``, at MASTER_ADDR:MASTER_PORT,
up before any rank starts), under keys of this run, restart and phase ("check" before the process
group, "run" after it). Rank 0 prints and posts its refusal; another rank reads it (waiting at most
``WAIT_S``) and prints its own if it differs. Then each waits (polling, at most ``WAIT_S``) until every
rank has arrived, by refusing or by passing its checks (``checked``), and only then leaves. torchrun
ends the other ranks with SIGTERM at the first exit it sees: a refusing rank leaves with its status on
SIGTERM too, and the arrival wait puts every rank under that handler before any leaves, so the summary
torchrun prints shows each rank's ``exitcode: 2``. Without an agent store (another launcher setting
WORLD_SIZE) every rank prints its refusal, rank R's as ``rank R: ...``.

Argparse's own refusals (an unknown flag, a bad choice) and ``--help`` are parsed with the output held
back (``parsed``): rank 0 writes it, another rank only a refusal of its own.

What stays torchrun's: its summary of the failed ranks (``ChildFailedError``: an entry per rank), its
traceback above it, and its OMP_NUM_THREADS banner (gone when OMP_NUM_THREADS is set).

Cost: nothing for one process; a store connection per rank once its flags pass, and on a refusal.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import signal
import sys
import time
from typing import Callable, NoReturn, TypeVar

T = TypeVar("T")
WAIT_S = 60.0  # at most this long a rank waits for the others before it leaves, saying its own refusal
POLL_S = 0.02  # store polls: short sleeps, between which SIGTERM's handler runs
CONNECT_S = 10.0


def world() -> int:
    """WORLD_SIZE; 1 without it or where it is not an int (then each process speaks for itself)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def rank() -> int | None:
    """RANK; None where it is not an int."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return None


def _store():
    """A client of torchrun's agent store; None without one, or where it cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=CONNECT_S))
    except (KeyError, ValueError, RuntimeError):
        return None


def _key(name: str, phase: str | None = None) -> str:
    if phase is None:
        import torch.distributed as dist

        phase = "run" if dist.is_available() and dist.is_initialized() else "check"
    run, restart = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"zfunc/refusal/{run}/{restart}/{phase}/{name}"


def _until(ready: Callable[[], bool]) -> bool:
    """Polls ``ready()`` for at most WAIT_S (sleeping between polls, so signals are handled)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if ready():
            return True
        time.sleep(POLL_S)
    return False


def checked() -> None:
    """This rank's flags passed their checks: it counts as arrived (a refusing rank need not wait for
    it), and rank 0 posts that it passed (another rank's refusal is then its own)."""
    if world() == 1:
        return
    store = _store()
    if store is None:
        return
    with contextlib.suppress(RuntimeError):
        if rank() == 0:
            store.set(_key("rank0", "check"), "")
        store.add(_key("arrived", "check"), 1)


@contextlib.contextmanager
def _leaving_with(code: int, said: list[str]):
    """While a rank refuses, SIGTERM (torchrun ending it) ends it with ``code``, after ``said[0]``
    (its refusal, until it knows rank 0 said it) is printed. The previous handler is put back."""
    def leave(signum, frame):
        if said and said[0]:
            print(said[0], file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    try:
        previous = signal.signal(signal.SIGTERM, leave)
    except ValueError:  # not the main thread: no handler to set
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_AT_ONCE = False


def exit_at_once() -> None:
    """A recipe's ``__main__`` (recipes/loop.py's ``script``): a refusal under torchrun leaves by
    ``os._exit`` with its status once said, still under its SIGTERM handler; called in-process (no
    ``exit_at_once``) it raises ``SystemExit``."""
    global _AT_ONCE
    _AT_ONCE = True


def _leave(code: int) -> NoReturn:
    if _AT_ONCE and world() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def refuse(text: str, code: int = 2, out: str = "") -> NoReturn:
    """Leave with status ``code`` once ``text`` (stderr; ``out``: stdout) is said once by the job (module
    docstring)."""
    me, n = rank(), world()
    if n == 1 or me is None:
        _say(text, out)
        raise SystemExit(code)
    store = _store()
    mine = text if me == 0 else f"rank {me}: {text}"
    pending = [mine if me != 0 else ""]
    with _leaving_with(code, pending):
        with contextlib.suppress(RuntimeError):
            if me == 0:
                _say(text, out)
                if store is not None:
                    store.set(_key("rank0"), text)
            else:
                theirs = None
                if store is not None:
                    key = _key("rank0")
                    if _until(lambda: store.check([key])):
                        theirs = store.get(key).decode("utf-8", errors="replace")
                pending[0] = ""
                if theirs != text:
                    _say(mine, f"rank {me}: {out}" if out else "")
            if store is not None:  # every rank refusing (or passed) before any leaves: torchrun's SIGTERM
                arrived = _key("arrived")  # then finds each under its handler
                store.add(arrived, 1)
                _until(lambda: store.add(arrived, 0) >= n)
        if pending[0]:
            _say(pending[0], "")
        _leave(code)


def _say(text: str, out: str) -> None:
    if out:
        print(out, end="" if out.endswith("\n") else "\n", flush=True)
    print(text, file=sys.stderr, flush=True)


def parsed(parse: Callable[[], T]) -> T:
    """``parse()`` (an argparse parse): on several processes its output is held back, and a refusal of
    argparse's (SystemExit with its status) is said by ``refuse``; ``--help`` by rank 0 alone."""
    if world() == 1:
        return parse()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return parse()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
        if code == 0:  # --help
            if rank() == 0:
                sys.stdout.write(out.getvalue())
            raise SystemExit(0) from None
        refuse(err.getvalue().rstrip("\n"), code, out.getvalue())
