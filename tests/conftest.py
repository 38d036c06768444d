"""Fixtures shared by the test files, and the ``multiprocess`` marker's guard.

A test that starts a process (ranks by ``zf.dist.spawn``, torchrun, a fresh interpreter, a fork)
carries ``@pytest.mark.multiprocess``, so ``pytest -m "not multiprocess"`` is a fast inner loop.
The guard below makes that a law rather than a habit: a test without the marker that starts a
process errors in its teardown, naming what it started. A ``-m`` expression that names neither
``slow`` nor ``gpu`` keeps the default's deselection of both (a later ``-m`` replaces addopts').
"""
import multiprocessing.process
import re
import sys

import pytest

pytest_plugins = ["pytester"]

_PROCESS_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.system",
                   "os.spawn", "os.exec"}


class _Started:
    """What the running test (``item``) started, if it is not marked ``multiprocess``."""

    item = None
    what: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event in _PROCESS_EVENTS and _Started.item is not None:
        _Started.what.append(f"{event} {args[1] if event == 'subprocess.Popen' else args[:1]!r}"[:300])


def _recording_start(start):
    def started(self):
        if _Started.item is not None:
            _Started.what.append(f"multiprocessing {type(self).__name__} target={self._target!r}"[:300])
        return start(self)

    return started


def pytest_configure(config):
    expr = config.option.markexpr
    if expr and not re.search(r"\b(slow|gpu)\b", expr):
        config.option.markexpr = f"({expr}) and not slow and not gpu"
    sys.addaudithook(_audit)  # subprocess, fork, exec, system, spawn: each raises an audit event
    base = multiprocessing.process.BaseProcess  # its start raises none: wrapped
    if not hasattr(base.start, "__wrapped_start__"):
        base.start = _recording_start(base.start)
        base.start.__wrapped_start__ = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _Started.item = None if item.get_closest_marker("multiprocess") else item
    _Started.what = []
    yield
    _Started.item = None


@pytest.fixture(autouse=True)
def _fork_server_with_the_sessions_environment(request):
    """zfunc forks ranks from its fork server only while the environment is the one the server
    started with (``zfunc.dist.launch``), else starts fresh interpreters. Started here, before the
    first test that starts processes sets any variable (``monkeypatch.setenv``), the server holds
    the session's environment, whichever test comes first."""
    if request.node.get_closest_marker("multiprocess"):
        from zfunc.dist import launch

        launch._context()


@pytest.fixture(autouse=True)
def _processes_need_the_multiprocess_marker(request):
    """Errors (at teardown) when a test without the marker started a process, in its setup or call."""
    yield
    if _Started.item is request.node and _Started.what:
        started, _Started.what = _Started.what, []
        pytest.fail(f"{request.node.nodeid} started processes without @pytest.mark.multiprocess: "
                    + "; ".join(started[:3]), pytrace=False)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog.\n" * 400)
    return path
