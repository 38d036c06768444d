"""Long sequences: the longest sequence one training step of a small Llama takes within a memory cap per rank.

    python benchmarks/long_sequence.py [--cap-mb 24] [--layers 12] [--tiles 8] [--configs plain,remat,...]

The model: recipes/llama.py, ``--layers`` blocks of width 64 (4 heads, 2 key/value heads, SwiGLU 256),
256-token vocabulary, fp32, AdamW, one sequence a step. Each config trains one step of ``T`` tokens in a
fresh process (two ranks for sp=2, ``zf.dist.spawn``) after two warm-up steps at 64 tokens (the steady
state: the first learns the order grads arrive in, the second builds sp's stage-0 grad buckets in it, which
``zf.shard`` keeps from step to step as DDP does); then each rank caps its data segment (``RLIMIT_DATA``) at
``--cap-mb`` above what it holds (the interpreter, torch, params, optimizer state, kept grad buckets,
threads), with glibc told to return freed blocks at once
(``MALLOC_MMAP_THRESHOLD_``, ``ZFUNC_HEAP_REUSE=off``), one thread per rank (``OMP_NUM_THREADS=1``: on a
shared machine the OpenMP threads of small tiles spin more than they compute). ``T`` doubles from 256
until a step fails, then is bisected to within 1/16 (64 tokens at least). The configs:

- ``plain``: the stock step (the model as torch runs it, the loss over whole logits);
- ``remat``: every block rematerialized;
- ``all``: remat with activation offload (``zf.remat(offload=True)``; on a CPU it moves nothing), every MLP
  over ``--tiles`` token tiles (``zf.tiling.tile_tokens``) and the loss over as many (``zf.sequence.loss_head``);
- ``ulysses``, ``ring``: sp=2 (``zf.sequence_parallel``), grads all-reduced over the two ranks (ZeRO-0);
- ``sp2-all``: sp=2 Ulysses with everything of ``all``.

Printed per config: the longest ``T``, each rank's peak RSS growth at that length (max over ranks) and
the ratio to ``plain``; then tokens/s at a common length (``--common``, default the plain maximum) for
plain, Ulysses and ring, the configs interleaved for ``--rounds`` rounds (medians; the machine is shared:
compare ratios). Targets: sp=2 >= 1.8x the same config at sp=1; ``all`` at sp=2 >= 16x ``plain``.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = ("plain", "remat", "all", "ulysses", "ring", "sp2-all")
SP = {"ulysses": "ulysses", "ring": "ring", "sp2-all": "ulysses"}
GRAIN = 64  # tokens: the bisection's finest step (a multiple of 2 sp)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _build(config: str, layers: int, tiles: int, mesh=None):
    """(step, state, loss layout) of ``config``'s Llama on ``mesh`` (None: one process)."""
    import torch

    import zfunc as zf
    from recipes.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=256,
                              max_seq_len=1 << 22))
    everything = config in ("all", "sp2-all")
    for block in model.layers:
        if everything:
            zf.tiling.tile_tokens(block.mlp, tiles=tiles)
        if config != "plain" and config not in ("ulysses", "ring"):
            block.forward = zf.remat(block.forward, offload=everything)
    if everything:
        zf.sequence.loss_head(model, tiles=tiles)
    layout = None
    if config in SP:
        zf.sequence_parallel(model, mesh, SP[config])
        layout = zf.sequence.layout_of(model)
    apply, params = zf.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        if everything:
            with zf.sequence.targets(y, layout):
                return apply(p, x)
        return zf.sequence.cross_entropy(apply(p, x), y, layout)

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-3), grad_norm=False)
    if mesh is not None:
        step = zf.shard(step, mesh.dp_sp, 0)
    return step, step.init(params)


def _batch(T: int):
    import torch

    g = torch.Generator().manual_seed(T)
    x = torch.randint(0, 256, (1, T), generator=g)
    return x, torch.roll(x, -1, 1)


def _one_rank(config: str, T: int, cap: int, layers: int, tiles: int, steps: int, mesh=None) -> dict:
    """Warm up at 64 tokens (two steps), cap this process's data segment at ``cap`` bytes more (0: no cap),
    time ``steps`` steps of ``T`` tokens: peak RSS growth and step times."""
    step, state = _build(config, layers, tiles, mesh)
    for _ in range(2):  # the steady state (module docstring)
        state, _ = step(state, _batch(64))
    if cap:
        limit = _status("VmData") + cap
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS (VmHWM) starts again from here
    base, times = _status("VmRSS"), []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = step(state, _batch(T))
        times.append(time.perf_counter() - t)
    return {"peak": _status("VmHWM") - base, "times": times, "loss": float(m["loss"])}


def _rank(rank: int, config: str, T: int, cap: int, layers: int, tiles: int, steps: int) -> dict:
    import zfunc as zf

    return _one_rank(config, T, cap, layers, tiles, steps, zf.Mesh(sp=2))


def child(config: str, T: int, cap: int, layers: int, tiles: int, steps: int) -> None:
    if config in SP:
        import zfunc as zf

        ranks = zf.dist.spawn(_rank, 2, config, T, cap, layers, tiles, steps, timeout_s=1800)
        out = {"peak": max(r["peak"] for r in ranks), "times": ranks[0]["times"], "loss": ranks[0]["loss"]}
    else:
        out = _one_rank(config, T, cap, layers, tiles, steps)
    print(json.dumps(out))


def run(config: str, T: int, cap: int, args, steps: int = 1) -> dict | None:
    """One trial in a fresh process; None when the step did not fit (or failed)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17), "ZFUNC_HEAP_REUSE": "off",
           "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, __file__, "--child", config, str(T), str(cap), str(args.layers), str(args.tiles), str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def longest(config: str, cap: int, args) -> tuple[int, dict | None]:
    """The longest multiple of GRAIN tokens whose step fits, within 1/16: doubling from 256, then bisection."""
    good, info, bad, T = 0, None, None, 4 * GRAIN
    while bad is None and T <= args.max_tokens:
        result = run(config, T, cap, args)
        print(f"  {config:8s} {T:7d} tokens: " + (f"fits, peak {result['peak'] / 2**20:.1f} MiB" if result
                                                   else "does not fit"), flush=True)
        if result is None:
            bad = T
        else:
            good, info, T = T, result, 2 * T
    while bad is not None and bad - good > max(GRAIN, good // 16):
        T = (good + bad) // 2 // GRAIN * GRAIN
        result = run(config, T, cap, args)
        print(f"  {config:8s} {T:7d} tokens: " + (f"fits, peak {result['peak'] / 2**20:.1f} MiB" if result
                                                   else "does not fit"), flush=True)
        if result is None:
            bad = T
        else:
            good, info = T, result
    return good, info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-mb", type=float, default=24.0, help="data-segment cap per rank above the warm process")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tiles", type=int, default=8, help="token tiles of the MLP and the loss (config all)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--max-tokens", type=int, default=1 << 17)
    ap.add_argument("--common", type=int, default=0, help="tokens for the speed table (default: plain's longest)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        config, *numbers = args.child
        child(config, *map(int, numbers))
        return
    cap = int(args.cap_mb * 2**20)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; expected some of {CONFIGS}")
    print(f"longest sequence of one step within {args.cap_mb:g} MiB per rank ({args.layers}-layer Llama, d=64):",
          flush=True)
    found = {c: longest(c, cap, args) for c in configs}
    print(f"\n{'config':10s} {'tokens':>8s} {'peak MiB/rank':>14s} {'x plain':>8s}")
    plain = found.get("plain", (0, None))[0]
    for c, (T, info) in found.items():
        peak = f"{info['peak'] / 2**20:.1f}" if info else "-"
        print(f"{c:10s} {T:8d} {peak:>14s} {T / plain if plain else float('nan'):8.1f}")
    pairs = [("ulysses", "plain"), ("ring", "plain"), ("sp2-all", "all")]
    for sp2, sp1 in pairs:
        if sp2 in found and sp1 in found and found[sp1][0]:
            print(f"{sp2} / {sp1}: {found[sp2][0] / found[sp1][0]:.2f}x (target >= 1.8x)")
    if "sp2-all" in found and plain:
        print(f"sp2-all / plain: {found['sp2-all'][0] / plain:.1f}x (target >= 16x)")
    common = args.common or plain or 1024
    speed = [c for c in ("plain", "ulysses", "ring") if c in configs]
    times: dict[str, list[float]] = {c: [] for c in speed}
    for _ in range(args.rounds):
        for c in speed:
            result = run(c, common, 0, args, steps=3)
            if result:
                times[c].append(statistics.median(result["times"][1:] or result["times"]))
    print(f"\ntokens/s at {common} tokens (medians of {args.rounds} interleaved rounds):")
    for c in speed:
        if times[c]:
            rate = common / statistics.median(times[c])
            ref = common / statistics.median(times["plain"]) if times.get("plain") else float("nan")
            print(f"  {c:8s} {rate:9.0f} tokens/s  {rate / ref:5.2f}x plain")


if __name__ == "__main__":
    main()
