"""A whole CPU train step that is all optimizer: zfunc's step vs torch AdamW(fused=True) and DeepSpeedCPUAdam.

    python benchmarks/step_cpu.py [--sizes 1e6 2e7 1e8] [--rounds 15] [--steps 0] [--no-deepspeed]
                                  [--grad-norm {off,on,both}] [--offload-params 2e7] [--no-offload-step]
                                  [--threads 0] [--one-at-a-time 5e7] [--processes {shared,own}]

Each trainer trains one fp32 param vector ``w`` of ``n`` elements on the loss ``(w * c).sum()``
(``c`` fixed): forward and backward are two cheap elementwise passes, so the step time is the
optimizer's plus the engine's own work per step. The trainers:
- zfunc, grad norm on: the default step, ``zf.train_step(loss, zf.optim.adamw(...))`` on a CPU state
  (the backend "auto" picks zfunc's Numba CPU-Adam there), ``state, metrics = step(state, c)``: the
  global grad norm in the metrics and a step with a nan/inf grad skipped, which costs one read of
  the grad before the update (zfunc's CPU norm kernel, ``zfunc.ops.cpu.norm``); every other check
  stays on (donation, the loss's finiteness, the RNG seeded from the state);
- zfunc, grad norm off: the same with ``train_step(grad_norm=False)``: no norm, only the loss checked;
  ``--grad-norm`` picks the rows (default both; each zfunc row is paired against every peer, and
  the two zfunc rows against each other: what the norm's read costs a step);
- torch: ``opt.zero_grad(set_to_none=True); loss.backward(); opt.step()`` with
  ``torch.optim.AdamW(fused=True)``;
- DeepSpeed: the same loop with ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (``DS_ACCELERATOR=cpu``,
  set here; its C++ extension JIT-builds on first use).
Rounds are interleaved (each round runs every trainer for ``--steps`` steps, the order rotating);
the ratio printed is the median over rounds of peer time / zfunc time (paired medians; > 1: zfunc
is faster). Memory: ~16 B/param per trainer (param, grad, two moments) plus ``w0`` and ``c``; from
``--one-at-a-time`` params (default 5e7) each trainer is built for its own sample and dropped
after it (building and one warm-up step untimed), so only one is held: ~3.5 GB at 1e8.

Where the trainers run (``--processes``): ``shared`` (default), all in this process, whose heap
and pages they share (memory one trainer's step left free in the heap serves the next trainer's
grads: the engines' own work compared); ``own``, each in a process of its own, as its users run it
(this script with ``--serve``, one trainer stepping at a time, the order rotating as above; every
trainer held at once, ~2.4 GB each at 1e8): what an engine does to its process's memory then
serves only itself. The first line of each size says whether torch put big tensors on huge pages
(``hostmem.torch_on_huge_pages``: where ``THP_MEM_ALLOC_ENABLE=1`` is set for the run, every
trainer's process).

Where a step's time goes (CPU time per step from ``time.thread_time`` around the pieces):
- forward + backward: the same two elementwise passes and a fresh grad in every trainer;
- the update: zfunc's kernel is one pass (p, g, m, v read once; p, m, v written once, in place:
  donation), AVX-512 where the CPU has it (a sqrt and a division per vector, as DeepSpeed's); with
  the grad norm on, the grad is read once more before it (4 B/param on the update's 28: a skipped
  step must write nothing, so every grad is read before the first write), at DRAM rate wherever the
  cache does not keep the fresh grad (here already at 1M); ``--grad-norm both`` prints what it costs;
- the engine's own work per step: zfunc calls torch's autograd engine directly on a CPU-only
  process; at small sizes Python runs from DRAM after each step's arrays stream through the cache,
  so the shortest path wins;
- page faults: glibc returns the top of its heap to the OS once more than twice its largest freed
  block lies free there, and the next step faults it back in; a CPU step's ``init`` sets glibc to
  keep freed memory (``zfunc.ops.cpu.hostmem.reuse_freed_memory``), for every trainer of the
  process. Blocks of 32 MiB or more (a 20M-param grad) are mapped and unmapped on every step in
  every trainer unless ``ZFUNC_HEAP_REUSE=all``. Each trainer's line ends with its system time and
  minor page faults per step (``getrusage``, medians): the same faults in every trainer show that
  none allocates more than the others.
The README's results hold the figures of the reference command (``--threads 1``); use it on a
loaded machine, where a 2-thread team waits for its slowest thread and paired ratios drift.

``--offload-params N`` adds the optimizer phase of a bf16 offloaded step over GPT-shaped leaves
of N params in all, the grads arriving in bf16, interleaved likewise:
- two passes: the grads upcast to fp32, torch's fused AdamW on each leaf, then the bf16 compute
  copy cast from the master (the baseline every speedup below is paired against);
- one pass, fp32 grads: the upcast, then zfunc's kernel writing the bf16 copy while it updates
  (``optim.apply(..., out=)``);
- one pass, bf16 grads: the kernel reading the bf16 grads themselves, the phase alone;
- offloaded step (update_s): a real ``zf.offload(zf.train_step(..., "bf16", grad_norm=False),
  "cpu")`` step (one process, state in RAM, overlap on, loss ``sum((p * c).sum())`` over the same
  shapes), its own ``update_s`` (the leaf updates during backward: reads, CPU-Adam, writes),
  reading autograd's bf16 grads (``GradReducer(own_grads=)``); "fp32-packed grads": the same step
  with the sink's ``own`` off, so the reducer packs fresh fp32 copies (its update_s leaves the pack
  out: the whole-step line shows it). ``--no-offload-step`` skips both.
The real step's update trails the bare kernel by its per-leaf engine work (reads, writes and the
leaf's bookkeeping, ~10 us a leaf beyond ``optim.apply``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before any deepspeed import
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import zfunc as zf  # noqa: E402
from zfunc import optim  # noqa: E402
from zfunc.ops.cpu import hostmem  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.1


ZFUNC = {"on": "zfunc (grad norm on)", "off": "zfunc (grad norm off)"}


def zfunc_trainer(w0: torch.Tensor, c: torch.Tensor, grad_norm: bool = True):
    step = zf.train_step(lambda p, c: (p["w"] * c).sum(), optim.adamw(LR, *BETAS, EPS, weight_decay=WD),
                         grad_norm=grad_norm)
    box = [step.init({"w": w0})]

    def run(k: int) -> None:
        state = box[0]
        for _ in range(k):
            state, _ = step(state, c)
        box[0] = state
    return run


def torch_loop(make_opt, w0: torch.Tensor, c: torch.Tensor):
    w = torch.nn.Parameter(w0.clone())
    opt = make_opt([w])

    def run(k: int) -> None:
        for _ in range(k):
            opt.zero_grad(set_to_none=True)
            (w * c).sum().backward()
            opt.step()
    return run


def deepspeed_adam(params):
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # only here: importing deepspeed is slow

    return DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)


def interleaved(trainers: dict, rounds: int, steps: int, one_at_a_time: bool = False,
                cpu: dict | None = None, kernel: dict | None = None) -> dict[str, list[float]]:
    """Seconds per step of each trainer, one sample per round, the order rotating each round.
    ``one_at_a_time``: ``trainers`` are factories, each trainer built for its sample and dropped
    after it (only one trainer's memory at once; building and a warm-up step are not timed).
    ``cpu``: a dict that receives the process's CPU seconds per step likewise (steadier than the
    wall clock on a loaded machine, where a sample's wall time is mostly when it was scheduled).
    ``kernel``: a dict that receives per sample ``(system seconds, minor page faults)`` per step
    (``getrusage``: the kernel's share of the CPU time, mostly faulting in fresh pages)."""
    if not one_at_a_time:
        for run in trainers.values():
            run(2)  # warm up: JIT load, page faults, lazy state
    names, times = list(trainers), {name: [] for name in trainers}
    cpu = {} if cpu is None else cpu
    kernel = {} if kernel is None else kernel
    for r in range(rounds):
        for name in rotated(names, r):
            run = trainers[name]
            if one_at_a_time:
                run = run()
                run(1)
            record(name, sample(run, steps), times, cpu, kernel)
            del run
    return times


def rotated(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``names`` rotated by ``r``."""
    return names[r % len(names):] + names[: r % len(names)]


def sample(run, steps: int) -> dict[str, float]:
    """``run(steps)`` timed, per step: wall seconds ``s``, this process's CPU seconds ``cpu``, its
    system seconds ``sys`` and minor page faults ``faults`` (``getrusage``)."""
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    t0, c0 = time.perf_counter(), time.process_time()
    run(steps)
    t1, c1 = time.perf_counter(), time.process_time()
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"s": (t1 - t0) / steps, "cpu": (c1 - c0) / steps, "sys": (u1.ru_stime - u0.ru_stime) / steps,
            "faults": (u1.ru_minflt - u0.ru_minflt) / steps}


def record(name: str, got: dict[str, float], times: dict, cpu: dict, kernel: dict) -> None:
    """Append a ``sample`` of trainer ``name`` to the three series ``interleaved`` fills."""
    times[name].append(got["s"])
    cpu.setdefault(name, []).append(got["cpu"])
    kernel.setdefault(name, []).append((got["sys"], got["faults"]))


def paired(peer: list[float], ours: list[float]) -> float:
    return statistics.median(p / o for p, o in zip(peer, ours))


TORCH_FUSED, DEEPSPEED = "torch AdamW(fused=True)", "DeepSpeedCPUAdam"


def trainer_names(grad_norm: str, with_deepspeed: bool) -> tuple[list[str], list[str]]:
    """(zfunc's rows, every trainer's name) for ``--grad-norm`` and ``--no-deepspeed``."""
    ours = [ZFUNC[k] for k in (("on", "off") if grad_norm == "both" else (grad_norm,))]
    return ours, ours + [TORCH_FUSED] + ([DEEPSPEED] if with_deepspeed else [])


def make_trainer(name: str, n: int):
    """Trainer ``name`` on the ``n``-element problem every trainer shares (seeded: the same in any process)."""
    gen = torch.Generator().manual_seed(0)
    w0, c = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    if name in ZFUNC.values():
        return zfunc_trainer(w0, c, name == ZFUNC["on"])
    if name == TORCH_FUSED:
        return torch_loop(lambda ps: torch.optim.AdamW(ps, LR, BETAS, EPS, WD, fused=True), w0, c)
    if name == DEEPSPEED:
        return torch_loop(deepspeed_adam, w0, c)
    raise ValueError(f"name: expected one of {[*ZFUNC.values(), TORCH_FUSED, DEEPSPEED]}, got {name!r}")


def step_rows(n: int, rounds: int, steps: int, with_deepspeed: bool, one_at_a_time: bool,
              grad_norm: str = "both", processes: str = "shared") -> None:
    ours, names = trainer_names(grad_norm, with_deepspeed)
    steps = steps or max(1, 2 * 10**7 // n)
    cpu: dict[str, list[float]] = {}
    kernel: dict[str, list[tuple[float, float]]] = {}
    pages = {}
    if processes == "own":
        times = own_processes(names, n, rounds, steps, cpu, kernel, pages)
    elif one_at_a_time:
        factories = {name: (lambda name=name: make_trainer(name, n)) for name in names}
        times = interleaved(factories, rounds, steps, one_at_a_time=True, cpu=cpu, kernel=kernel)
    else:
        times = interleaved({name: make_trainer(name, n) for name in names}, rounds, steps, cpu=cpu, kernel=kernel)
    layout = ("each trainer in a process of its own, torch's huge pages " +
              ", ".join(f"{k}: {'on' if v else 'off'}" for k, v in pages.items())) if pages else (
        f"one process{', trainers built one at a time' if one_at_a_time else ''}, torch's huge pages "
        f"{'on' if hostmem.torch_on_huge_pages() else 'off'}")
    print(f"n={n:.0e}: {rounds} rounds x {steps} steps, {torch.get_num_threads()} threads, {layout}")

    def faults(name: str) -> str:  # the kernel's part of a step: system time and minor page faults (medians)
        return (f"sys {statistics.median(s for s, _ in kernel[name]) * 1e3:.3f} ms, "
                f"{statistics.median(f for _, f in kernel[name]):.0f} faults/step")
    for zname in ours:
        mine = times[zname]
        print(f"  {zname}: {statistics.median(mine) * 1e3:.3f} ms/step (median), "
              f"{statistics.median(cpu[zname]) * 1e3:.3f} ms CPU; {faults(zname)}")
        for name, t in times.items():
            if name not in ours:
                ratios = sorted(p / o for p, o in zip(t, mine))
                print(f"    vs {name:<24} {statistics.median(t) * 1e3:8.3f} ms/step   speedup {paired(t, mine):.3f}x "
                      f"(rounds {ratios[0]:.2f}-{ratios[-1]:.2f}); CPU time {statistics.median(cpu[name]) * 1e3:.3f} "
                      f"ms, speedup {paired(cpu[name], cpu[zname]):.3f}x; {faults(name)}")
    if len(ours) == 2:  # what the norm costs: the paired difference of the two zfunc rows
        on, off = cpu[ZFUNC["on"]], cpu[ZFUNC["off"]]
        extra = statistics.median(a - b for a, b in zip(on, off))
        print(f"  the grad norm's read (on - off, paired CPU time): {extra * 1e3:.3f} ms/step, "
              f"{extra / statistics.median(on) * 100:.1f}% of the default step")


def own_processes(names: list[str], n: int, rounds: int, steps: int, cpu: dict, kernel: dict,
                  pages: dict) -> dict[str, list[float]]:
    """``--processes own``: each trainer served by a process of its own (this script with ``--serve``,
    over its stdin and stdout), the rounds interleaved as in ``interleaved``: one trainer steps at a
    time, the order rotating; every process has this one's environment. Fills ``cpu`` and ``kernel``
    as ``interleaved`` does, and ``pages`` with each trainer's ``hostmem.torch_on_huge_pages()``."""
    procs = {}
    try:
        for name in names:
            procs[name] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve", name, "--sizes", str(n), "--steps", str(steps),
                 "--threads", str(torch.get_num_threads())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True)
        for name, proc in procs.items():  # built and warmed up, one after another
            pages[name] = _reply(name, proc)["huge_pages"]
        times = {name: [] for name in names}
        for r in range(rounds):
            for name in rotated(names, r):
                procs[name].stdin.write("step\n")
                procs[name].stdin.flush()
                record(name, _reply(name, procs[name]), times, cpu, kernel)
        return times
    finally:  # end of input: each server returns; one that does not within a minute is killed
        for proc in procs.values():
            proc.stdin.close()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _reply(name: str, proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"trainer {name!r}: its process ended (exit code {proc.wait()}) without a reply")
    return json.loads(line)


def serve(name: str, n: int, steps: int) -> None:
    """``--serve``: build trainer ``name``, warm it up, say so; then ``steps`` timed steps per line read."""
    run = make_trainer(name, n)
    run(2)
    print(json.dumps({"huge_pages": hostmem.torch_on_huge_pages()}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(sample(run, steps)), flush=True)


def gpt_leaf_shapes(total: int, d: int = 768) -> list[tuple[int, ...]]:
    """A GPT's leaves (per block: qkv, proj, two MLP matrices, biases, norms) up to ``total`` params."""
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    shapes, n = [], 0
    while n < total:
        for s in block:
            shapes.append(s)
            n += torch.Size(s).numel()
    return shapes


def offload_rows(total: int, rounds: int, real_step: bool = True) -> None:
    """The optimizer phase of a bf16 offloaded step, leaf by leaf as offload runs it, the grads
    arriving in bf16 (the compute dtype): three paths (module docstring)."""
    shapes = gpt_leaf_shapes(total)
    gen = torch.Generator().manual_seed(0)
    leaves = []
    for i, s in enumerate(shapes):
        p = torch.randn(s, generator=gen)
        g = (torch.randn(s, generator=gen) * 1e-2).to(torch.bfloat16)
        leaves.append((f"p{i}", p, g, torch.empty(s, dtype=torch.bfloat16)))
    tx_torch, tx_zfunc = (optim.adamw(LR, *BETAS, EPS, weight_decay=WD, backend=b) for b in ("torch", "auto"))
    paths = {"two passes": tx_torch, "one pass, fp32 grads": tx_zfunc, "one pass, bf16 grads": tx_zfunc}
    states = {path: [tx.init({name: p}) for name, p, _, _ in leaves] for path, tx in paths.items()}
    masters = {path: [p.clone() for _, p, _, _ in leaves] for path in paths}

    def phase(path: str):
        tx, upcast, fused = paths[path], path != "one pass, bf16 grads", path != "two passes"

        def run(k: int) -> None:
            for _ in range(k):
                for j, (name, _, g, out) in enumerate(leaves):
                    p, st = masters[path][j], states[path][j]
                    g = g.float() if upcast else g  # the one-rank reducer's fp32 pack
                    if fused:
                        _, states[path][j] = optim.apply(tx, {name: g}, st, {name: p}, out={name: out})
                    else:
                        _, states[path][j] = optim.apply(tx, {name: g}, st, {name: p})
                        out.copy_(p)  # the compute copy, cast in a second pass
        return run

    trainers = {path: phase(path) for path in paths}
    updates: dict[str, list[float]] = {}
    if real_step:
        for name, packed in (("offloaded step", False), ("offloaded step, fp32-packed grads", True)):
            updates[name] = []
            trainers[name] = offloaded_step(shapes, packed, updates[name])
    times = interleaved(trainers, rounds, 1)
    base = times["two passes"]
    print(f"bf16 offload optimizer phase, {sum(torch.Size(s).numel() for s in shapes):.2e} params in "
          f"{len(shapes)} GPT leaves, bf16 grads, {rounds} rounds, {torch.get_num_threads()} threads: "
          f"two passes {statistics.median(base) * 1e3:.1f} ms")
    for path in ("one pass, fp32 grads", "one pass, bf16 grads"):
        print(f"  {path:<26} {statistics.median(times[path]) * 1e3:8.1f} ms   speedup {paired(base, times[path]):.2f}x")
    if real_step:
        for name, upd in updates.items():
            print(f"  {name + ' (update_s)':<38} {statistics.median(upd[2:]) * 1e3:8.1f} ms   speedup "
                  f"{paired(base, upd[2:]):.2f}x")  # the 2 warm-up steps' updates are not paired
        own, packed = times["offloaded step"], times["offloaded step, fp32-packed grads"]
        print(f"  whole offloaded step: {statistics.median(own) * 1e3:.1f} ms, with fp32-packed grads "
              f"{statistics.median(packed) * 1e3:.1f} ms: speedup {paired(packed, own):.2f}x")


def offloaded_step(shapes: list[tuple[int, ...]], packed: bool, updates: list[float]):
    """A real bf16 offloaded step (optimizer state in RAM, one process, overlap on) whose loss is
    ``sum((p * c).sum())`` over leaves of ``shapes``: its ``run(k)`` appends each step's
    ``update_s`` (the leaf updates' seconds) to ``updates``. ``packed``: the grads reach the update
    packed into fresh fp32 copies (the sink's ``own`` off) instead of as autograd's own."""
    from zfunc.offloading import grads as offload_grads

    gen = torch.Generator().manual_seed(1)
    params = {f"p{i:03d}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    consts = {k: (torch.randn(p.shape, generator=gen) * 1e-2).to(torch.bfloat16) for k, p in params.items()}
    loss = lambda p, c: sum((p[k] * c[k]).float().sum() for k in p)  # noqa: E731
    step = zf.offload(zf.train_step(loss, optim.adamw(LR, *BETAS, EPS, weight_decay=WD), "bf16", grad_norm=False),
                      "cpu")
    box = [step.init(params)]

    def run(k: int) -> None:
        offload_grads.UpdateOnArrival.own = not packed
        try:
            state = box[0]
            for _ in range(k):
                state, _ = step(state, consts)
                updates.append(step.update_s)
            box[0] = state
        finally:
            offload_grads.UpdateOnArrival.own = True
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="*", default=[1e6, 2e7, 1e8],
                    help="params per run; none: the offload phase only")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=0, help="steps per sample (0: ~2e7 params' worth)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--grad-norm", choices=("off", "on", "both"), default="both",
                    help="zfunc's rows: the default step (grad norm on), grad_norm=False, or both")
    ap.add_argument("--offload-params", type=float, default=2e7, help="0: skip the offload phase")
    ap.add_argument("--no-offload-step", action="store_true", help="the offload phase without the real offloaded steps")
    ap.add_argument("--one-at-a-time", type=float, default=5e7, help="sizes from this many params build each trainer "
                    "for its own sample, so only one trainer's memory (~20 B/param) is held at once")
    ap.add_argument("--threads", type=int, default=0, help="torch (and so zfunc's kernel) threads; 0: torch's default. "
                    "On a loaded machine 1 is steadier: a team of threads waits for its slowest")
    ap.add_argument("--processes", choices=("shared", "own"), default="shared",
                    help="shared: every trainer in this process; own: each in a process of its own")
    ap.add_argument("--serve", metavar="TRAINER", help=argparse.SUPPRESS)  # one trainer of --processes own
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.serve:
        serve(args.serve, int(args.sizes[0]), args.steps)
        return
    for n in args.sizes:
        step_rows(int(n), args.rounds, args.steps, not args.no_deepspeed, n >= args.one_at_a_time, args.grad_norm,
                  args.processes)
    if args.offload_params:
        offload_rows(int(args.offload_params), args.rounds, not args.no_offload_step)


if __name__ == "__main__":
    main()
