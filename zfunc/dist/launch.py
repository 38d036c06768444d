"""How ranks start: under ``torchrun`` (``init_from_env``) or spawned on this machine (``spawn``).

``spawn(fn, n)`` runs ``fn`` on ``n`` gloo ranks in child processes, every socket of the run bound
to loopback (the rendezvous store this process serves, each rank's gloo sockets), and returns their
results by rank; a failing or hanging rank stops the run with its traceback. The ranks fork from a
server process that has imported torch and zfunc once (multiprocessing's "forkserver", started at
the first spawn): a 2-rank spawn takes ~0.1 s instead of the ~3 s a fresh interpreter takes to
import torch. A forked rank has the server's environment, so a spawn whose environment differs
from the one the server started with (a variable set since) starts fresh interpreters ("spawn"),
as ``ZFUNC_SPAWN_METHOD=spawn`` does for every spawn: what zfunc and torch read from the
environment at import always follows the caller's. (A fork server that something else in this
process started before zfunc's first spawn is taken to have the environment of that spawn, and
lacks the preload.) ``free_port`` and ``loopback_interface`` are for launches of one's own
(``torchrun`` on this machine).
"""
from __future__ import annotations

import datetime
import io
import os
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection, forkserver
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zfunc.core import env

# "forkserver": ranks fork from a server that imported these once; "spawn": fresh interpreters
SPAWN_METHOD = env.choice("ZFUNC_SPAWN_METHOD", "forkserver", ("forkserver", "spawn"))
PRELOAD = ("torch", "torch.distributed", "torch.multiprocessing", "zfunc")  # zfunc reads ZFUNC_* at import
# Variables nothing reads at import (a rank forks whatever they say, and takes the caller's values):
# pytest's per-test name; the cache folder torch's inductor puts in os.environ on its first use (a
# Hugging Face model's import does it), after which every spawn would start fresh interpreters.
VOLATILE = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Initialise the default process group from torchrun's env vars (no-op if already done).

    ``backend``: "gloo" or "nccl"; default NCCL when CUDA is available, else gloo. ``timeout_s``
    bounds how long a collective waits for a peer before failing. The sockets are the launcher's
    choice, not zfunc's: torchrun's rendezvous store listens on every interface, and gloo on the
    address of ``GLOO_SOCKET_IFNAME`` or else the hostname's (``GLOO_SOCKET_IFNAME=lo`` keeps a
    one-machine run on loopback).
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound and closed, never listened on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_interface() -> str:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS and the BSDs).

    Raises ``RuntimeError`` naming the interfaces there are when neither exists: a run that would
    otherwise listen on another interface is not started.
    """
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(f"spawn: no loopback interface ('lo' or 'lo0') among this machine's interfaces {names}")


def _loopback_store(timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store of a spawn, served by this process on 127.0.0.1 only.

    torch's TCPStore server listens on every interface whatever host it is given, so the socket is
    bound here and handed over (``master_listen_fd``), on a port the OS picks that stays bound
    until the run ends: a port "free a moment ago" could be taken by a run starting beside this one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        handed = os.dup(sock.fileno())  # the store closes the fd it serves on when it is destroyed
        try:
            return dist.TCPStore("127.0.0.1", sock.getsockname()[1], None, is_master=True, wait_for_workers=False,
                                 timeout=timeout, master_listen_fd=handed)
        except BaseException:
            # One of torch's two store backends closes the fd when it fails, the other does not.
            if _same_file(handed, sock.fileno()):
                os.close(handed)
            raise


def _same_file(fd: int, other: int) -> bool:
    try:
        a, b = os.fstat(fd), os.fstat(other)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


_server_environ: dict[str, str] | None = None  # the environment the fork server started with


def _context():
    """The multiprocessing context ranks start in: the fork server while this process's environment is
    the one the server started with, else (or where there is none, or ``SPAWN_METHOD`` says) "spawn"."""
    global _server_environ
    if SPAWN_METHOD == "forkserver" and "forkserver" in mp.get_all_start_methods():
        if _server_environ is None:
            mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
            try:
                forkserver.ensure_running()
                _server_environ = dict(os.environ)
            except OSError:  # no server (e.g. no room for its socket): fresh interpreters from now on
                _server_environ = {}
        if _server_environ and _without_volatile(_server_environ) == _without_volatile(os.environ):
            return mp.get_context("forkserver")
    return mp.get_context("spawn")


def _without_volatile(environ) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in VOLATILE}


def _worker(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable, args: tuple, results,
            loopback: str, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's (a forked rank has the fork server's; they differ only in VOLATILE)
    os.environ.update(environ)
    # gloo listens for its peers on the address GLOO_SOCKET_IFNAME names, else on the one the hostname
    # resolves to (often the LAN's); every rank of a spawn is on this machine, so loopback it is, for
    # the groups ``fn`` creates too.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      GLOO_SOCKET_IFNAME=loopback)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        results.put((rank, True, _to_bytes(fn(rank, *args))))
    except BaseException:  # report every failure to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_bytes(value: Any) -> bytes:
    # Tensors sent through a torch.multiprocessing queue travel as shared-memory handles that die
    # with the sending process; plain bytes outlive it.
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks over loopback; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Each rank gets
    ``cpu_count // world_size`` threads. If a rank raises, the others are stopped and a
    ``RuntimeError`` carries the first failing rank's traceback; if the whole run exceeds
    ``timeout_s`` every rank is stopped and ``TimeoutError`` is raised.

    Every socket the run listens on is bound to loopback: the rendezvous store this process serves
    (127.0.0.1) and each rank's gloo sockets (``GLOO_SOCKET_IFNAME`` is set to the loopback
    interface in the ranks, whatever it was). Other machines cannot reach the run; other users of
    this machine can, as they can any loopback port.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    ctx = _context()
    results = ctx.SimpleQueue()
    collective_timeout = max(5.0, timeout_s / 2)
    loopback = loopback_interface()
    store = _loopback_store(datetime.timedelta(seconds=collective_timeout))
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, store.port, collective_timeout, fn, args, results, loopback,
                               dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        del store


def _collect(procs, results, world_size: int, timeout_s: float) -> list[Any]:
    """Each rank's result, by rank. Sleeps until a result arrives, a rank exits or a second passes
    (``multiprocessing.connection.wait``): a long run costs this process no CPU (a run per thread of
    ten spawns polling every 10 ms took ~10% of a core)."""
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    while True:
        codes = [p.exitcode for p in procs]  # before the drain: a rank that has exited has sent its result
        while not results.empty():
            rank, ok, value = results.get()
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            # Trusted as the caller's own objects: the queue is a pipe only this process and its
            # children (running the caller's ``fn``) hold, and ``get()`` has already unpickled the
            # message around these bytes; weights_only would refuse results that are not tensors.
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        if len(out) == world_size:
            return [out[r] for r in range(world_size)]
        gone = [i for i, code in enumerate(codes) if i not in out and code is not None]
        if gone and codes[gone[0]] == 0:
            raise RuntimeError(f"rank {gone[0]} of {world_size} exited (code 0) without a result")
        if gone:
            raise RuntimeError(f"rank {gone[0]} of {world_size} died with exit code {codes[gone[0]]}"
                               + _survivors(procs, results, out, world_size))
        left = deadline - time.monotonic()
        if left < 0:
            late = sorted(set(range(world_size)) - set(out))
            raise TimeoutError(f"spawn: ranks {late} did not finish in {timeout_s} s")
        running = [p.sentinel for i, p in enumerate(procs) if i not in out and codes[i] is None]
        connection.wait([results._reader, *running], timeout=min(1.0, left))  # SimpleQueue's read end


def _survivors(procs, results, out: dict, world_size: int, grace_s: float = 20.0) -> str:
    """What the other ranks reported after one died (they should fail fast, not hang)."""
    reports = []
    deadline = time.monotonic() + grace_s
    waiting = {i for i, p in enumerate(procs) if i not in out and p.exitcode is None}
    while waiting and time.monotonic() < deadline:
        while not results.empty():
            rank, ok, value = results.get()
            waiting.discard(rank)
            reports.append(f"rank {rank} {'finished' if ok else 'failed'}:\n{value if not ok else ''}")
        waiting = {i for i in waiting if procs[i].exitcode is None}
        time.sleep(0.05)
    if waiting:
        reports.append(f"ranks {sorted(waiting)} still running after {grace_s:.0f} s")
    return "".join("\n" + r for r in reports)
