"""A whole CPU train step that is all optimizer: zfunc's step vs torch AdamW(fused=True) and DeepSpeedCPUAdam.

    python benchmarks/step_cpu.py [--sizes 1e6 2e7] [--rounds 15] [--steps 0] [--no-deepspeed]
                                  [--offload-params 2e7] [--threads 0]

Each trainer trains one fp32 param vector ``w`` of ``n`` elements on the loss ``(w * c).sum()``
(``c`` fixed): forward and backward are two cheap elementwise passes, so the step time is the
optimizer's plus the engine's own work per step. The trainers:
- zfunc: ``zf.train_step(loss, zf.optim.adamw(...))`` on a CPU state (the backend "auto" picks
  zfunc's Numba CPU-Adam there), ``state, metrics = step(state, c)``;
- torch: ``opt.zero_grad(set_to_none=True); loss.backward(); opt.step()`` with
  ``torch.optim.AdamW(fused=True)``;
- DeepSpeed: the same loop with ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (``DS_ACCELERATOR=cpu``,
  set here; its C++ extension JIT-builds on first use).
Rounds are interleaved (each round runs every trainer for ``--steps`` steps, the order rotating);
the ratio printed is the median over rounds of peer time / zfunc time (paired medians; > 1: zfunc
is faster). Memory: ~16 B/param per trainer (param, grad, two moments) plus ``c``: ~5 GB in all
at 1e8.

``--offload-params N`` adds the optimizer phase of a bf16 offloaded step over GPT-shaped leaves
of N params in all: the current two-pass path (torch's fused AdamW on each leaf, then the bf16
compute copy cast from the master, what offload did before the fused pass was wired in) against
the one pass offload runs now (``optim.apply(..., out=)``: zfunc's kernel writes the bf16 copy
while it updates), interleaved likewise.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before any deepspeed import
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import zfunc as zf  # noqa: E402
from zfunc import optim  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.1


def zfunc_trainer(w0: torch.Tensor, c: torch.Tensor):
    step = zf.train_step(lambda p, c: (p["w"] * c).sum(), optim.adamw(LR, *BETAS, EPS, weight_decay=WD), grad_norm=False)
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


def interleaved(trainers: dict, rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each trainer, one sample per round, the order rotating each round."""
    for run in trainers.values():
        run(2)  # warm up: JIT load, page faults, lazy state
    names, times = list(trainers), {name: [] for name in trainers}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            trainers[name](steps)
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def paired(peer: list[float], ours: list[float]) -> float:
    return statistics.median(p / o for p, o in zip(peer, ours))


def step_rows(n: int, rounds: int, steps: int, with_deepspeed: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    w0, c = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    trainers = {"zfunc": zfunc_trainer(w0, c),
                "torch AdamW(fused=True)": torch_loop(
                    lambda ps: torch.optim.AdamW(ps, LR, BETAS, EPS, WD, fused=True), w0, c)}
    if with_deepspeed:
        trainers["DeepSpeedCPUAdam"] = torch_loop(deepspeed_adam, w0, c)
    steps = steps or max(1, 2 * 10**7 // n)
    times = interleaved(trainers, rounds, steps)
    ours = times["zfunc"]
    print(f"n={n:.0e}: {rounds} rounds x {steps} steps, {torch.get_num_threads()} threads; "
          f"zfunc {statistics.median(ours) * 1e3:.3f} ms/step (median)")
    for name, t in times.items():
        if name != "zfunc":
            print(f"  vs {name:<24} {statistics.median(t) * 1e3:8.3f} ms/step   zfunc speedup {paired(t, ours):.3f}x")


def gpt_leaf_shapes(total: int, d: int = 768) -> list[tuple[int, ...]]:
    """A GPT's leaves (per block: qkv, proj, two MLP matrices, biases, norms) up to ``total`` params."""
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    shapes, n = [], 0
    while n < total:
        for s in block:
            shapes.append(s)
            n += torch.Size(s).numel()
    return shapes


def offload_rows(total: int, rounds: int) -> None:
    """The optimizer phase of a bf16 offloaded step, leaf by leaf as offload runs it."""
    shapes = gpt_leaf_shapes(total)
    gen = torch.Generator().manual_seed(0)
    leaves = []
    for i, s in enumerate(shapes):
        p = torch.randn(s, generator=gen)
        leaves.append((f"p{i}", p, torch.randn(s, generator=gen) * 1e-2, torch.empty(s, dtype=torch.bfloat16)))
    two_pass, one_pass = optim.adamw(LR, *BETAS, EPS, weight_decay=WD, backend="torch"), optim.adamw(
        LR, *BETAS, EPS, weight_decay=WD)
    states = {id(tx): [tx.init({name: p}) for name, p, _, _ in leaves] for tx in (two_pass, one_pass)}
    masters = {id(tx): [p.clone() for _, p, _, _ in leaves] for tx in (two_pass, one_pass)}

    def phase(tx, fused: bool):
        def run(k: int) -> None:
            for _ in range(k):
                for j, (name, _, g, out) in enumerate(leaves):
                    p = masters[id(tx)][j]
                    if fused:
                        _, states[id(tx)][j] = optim.apply(tx, {name: g}, states[id(tx)][j], {name: p}, out={name: out})
                    else:
                        _, states[id(tx)][j] = optim.apply(tx, {name: g}, states[id(tx)][j], {name: p})
                        out.copy_(p)  # the compute copy, cast in a second pass
        return run

    times = interleaved({"one pass": phase(one_pass, True), "two passes": phase(two_pass, False)}, rounds, 1)
    print(f"bf16 offload optimizer phase, {sum(torch.Size(s).numel() for s in shapes):.2e} params in "
          f"{len(shapes)} GPT leaves, {rounds} rounds: one pass {statistics.median(times['one pass']) * 1e3:.1f} ms, "
          f"two passes {statistics.median(times['two passes']) * 1e3:.1f} ms; "
          f"speedup {paired(times['two passes'], times['one pass']):.2f}x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="*", default=[1e6, 2e7], help="params per run; none: the offload phase only")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=0, help="steps per sample (0: ~2e7 params' worth)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--offload-params", type=float, default=2e7, help="0: skip the offload phase")
    ap.add_argument("--threads", type=int, default=0, help="torch (and so zfunc's kernel) threads; 0: torch's default. "
                    "On a loaded machine 1 is steadier: a team of threads waits for its slowest")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for n in args.sizes:
        step_rows(int(n), args.rounds, args.steps, not args.no_deepspeed)
    if args.offload_params:
        offload_rows(int(args.offload_params), args.rounds)


if __name__ == "__main__":
    main()
