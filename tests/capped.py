"""A recipe run whose training steps are capped in memory: ``python -m tests.capped RECIPE ARGS...`` (under
torchrun too) runs ``recipes.RECIPE`` with ``ARGS``; every training step after the first two (the warm-up: the
first learns the order grads arrive in, the second builds the buffers a sharded step keeps in that order) runs
with the process's data segment (``RLIMIT_DATA``) capped at ``ZFUNC_TEST_CAP_MB`` MiB above what it holds as the
step starts (the interpreter, torch, the data, params, optimizer state, threads), as
``benchmarks/long_sequence.py`` caps its steps; evaluation, checkpoints and the plot run uncapped. A step that
needs more fails with torch's "can't allocate memory" and the process exits non-zero. Set
``MALLOC_MMAP_THRESHOLD_`` low and ``ZFUNC_HEAP_REUSE=off`` so that glibc returns freed blocks at once (what
``RLIMIT_DATA`` counts then follows what is in use)."""
import os
import resource
import runpy
import sys


def _data_segment() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


def _capped(build_step, cap: int):
    def build(*args, **kwargs):
        step, mesh = build_step(*args, **kwargs)
        plain_call, calls = type(step).__call__, []

        def call(self, state, batch):
            calls.append(1)
            if len(calls) <= 2:
                return plain_call(self, state, batch)
            soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
            resource.setrlimit(resource.RLIMIT_DATA, (_data_segment() + cap, hard))
            try:
                return plain_call(self, state, batch)
            finally:
                resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))

        step.__class__ = type(f"Capped{type(step).__name__}", (type(step),), {"__call__": call})
        return step, mesh

    return build


def main() -> None:
    from recipes import engine

    recipe, *argv = sys.argv[1:]
    engine.build_step = _capped(engine.build_step, int(float(os.environ["ZFUNC_TEST_CAP_MB"]) * 2**20))
    sys.argv = [f"recipes.{recipe}", *argv]
    runpy.run_module(f"recipes.{recipe}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
