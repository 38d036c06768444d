"""Compressed collectives on a slow network: 1-bit Adam and ZeRO++ against fp32, on 2 gloo ranks.

    python benchmarks/slow_network.py [--rates 1gbit,10gbit] [--delay-ms 0.1] [--rounds 8] [--width 1024]
                                      [--depth 8] [--fallback] [--ranks-per-node 2]

The network: with root, ``ip`` and ``tc``, each rank runs in a network namespace of its own
(``zf35a-<pid>``, ``zf35b-<pid>``) joined by a veth pair (10.235.0.1/30 and .2, addresses that exist
only inside those namespaces), each end's egress shaped by ``tc``: ``netem`` delay, then ``tbf`` at
the rate (``tbf`` alone where the kernel has no ``sch_netem``: the table says so); the script
deletes the namespaces it made (and only those) when it ends. Without them
(or ``--fallback``), a throttled ``Comm`` stands in: every collective sleeps ``counted bytes /
rate + delay`` on the comm thread before it runs over loopback. Every figure names its network.

The model is comm-bound on 1 Gbit/s: ``--depth`` Linear(width, width) layers (8.4M params at the
defaults) on a batch of 4 rows, so a step's compute is a few ms and an fp32 all-reduce of its grads
(67 MB counted) most of a second. Trainers, all on the same model and batch:
  fp32     zf.shard stage 0, adamw: the grads all-reduced in fp32
  1bit     zf.shard stage 0, onebit_adam(freeze_step=1): timed after warm-up, momentum 1-bit compressed
  z3 / z3-int8    stage 3 with fp32 collectives / quantize_weights + quantize_grads=8
  z3-int8-int4    ZeRO++'s own pairing: quantize_weights (int8 all-gather) + quantize_grads=4 (int4 grads)
  z2 / z2-int4    stage 2 with fp32 reduce-scatters / quantize_grads=4 (its param all-gather stays fp32:
                  half the step's bytes are not compressed, so a link-bound step gains at most ~1.8x)
Bytes per step are the mesh's counters after warm-up (``mesh.comm_bytes()``). Times: each round runs
one step of every trainer in a shuffled order (the same on both ranks); a ratio is the median over
rounds of the peer's step time over the trainer's in the same round (paired), so the load of this
shared machine cancels. The CPU columns are rank 0's process CPU time per step (every thread: compute,
codecs, gloo's), paired likewise: on a loaded machine, where wall times wait on the scheduler, they show
what compression costs. Prints a markdown table per network, with the load average.

``--ranks-per-node 2`` (namespaces only): 4 ranks, 2 in each namespace (a "node"): inside a namespace
ranks talk over its loopback, unshaped; across, over the shaped veth pair. Each rank is told its
node (``LOCAL_WORLD_SIZE=2``: ``zf.Mesh``'s ``ranks_per_node``), and the trainers are
  z3 / z3-hpz     stage 3 with fp32 collectives / hpz=2: backward's re-gathers inside the node
  z2 / z2-int4    stage 2 with fp32 reduce-scatters / quantize_grads=4 in two levels (node, then across)
  z2-int4-flat    quantize_grads=4 over a mesh told it is one node: one all-to-all across the link
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402

TRAINERS = ("fp32", "1bit", "z3", "z3-int8", "z3-int8-int4", "z2", "z2-int4")
NODE_TRAINERS = ("z3", "z3-hpz", "z2", "z2-int4", "z2-int4-flat")
PEERS = {"1bit": "fp32", "z3-int8": "z3", "z3-int8-int4": "z3", "z2-int4": "z2", "z3-hpz": "z3", "z2-int4-flat": "z2"}
LR = 1e-5  # small enough that 1-bit Adam, its variance frozen after one update, stays finite for 50+ steps
STAGES = {"fp32": 0, "1bit": 0, "z3": 3, "z3-int8": 3, "z3-int8-int4": 3, "z3-hpz": 3, "z2": 2, "z2-int4": 2,
          "z2-int4-flat": 2}


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _trainer(kind: str, mesh, width: int, depth: int, flat=None):
    apply, params = zf.functionalize(_model(width, depth))

    def loss_fn(p, batch):
        return (apply(p, batch) ** 2).mean()

    opt = zf.optim.onebit_adam(LR, freeze_step=1, comm=mesh.comm) if kind == "1bit" else zf.optim.adamw(LR)
    stage = STAGES[kind]
    units = zf.units.by_class(nn.Linear) if stage == 3 else None
    step = zf.shard(zf.train_step(loss_fn, opt, "fp32", grad_norm=False), flat if kind.endswith("-flat") else mesh,
                    stage, units=units, quantize_weights=kind.startswith("z3-int8"),
                    quantize_grads={"z3-int8": 8, "z3-int8-int4": 4, "z2-int4": 4, "z2-int4-flat": 4}.get(kind, False),
                    hpz=2 if kind == "z3-hpz" else None)
    return step, step.init(params)


def measure(rank: int, world: int, kinds: list[str], rounds: int, width: int, depth: int) -> dict:
    """One rank's bytes per step and step times per trainer (see the module docstring)."""
    mesh = zf.Mesh()
    flat = zf.Mesh(ranks_per_node=world) if any(k.endswith("-flat") for k in kinds) else None  # one "node"
    batch = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
    trainers = {k: _trainer(k, mesh, width, depth, flat) for k in kinds}
    sent, times, cpu = {}, {k: [] for k in kinds}, {k: [] for k in kinds}
    for k, (step, state) in trainers.items():  # warm-up: 1bit leaves its full-precision step behind
        for _ in range(2):
            state, _ = step(state, batch)
        on = flat if k.endswith("-flat") else mesh
        on.clear_comm_bytes()
        state, _ = step(state, batch)
        sent[k] = dict(on.comm_bytes())
        trainers[k] = (step, state)
    order = random.Random(0)
    for _ in range(rounds):
        for k in order.sample(kinds, len(kinds)):
            step, state = trainers[k]
            mesh.comm.all_reduce(torch.zeros(1), label="round barrier")
            t0, c0 = time.perf_counter(), time.process_time()
            state, m = step(state, batch)
            float(m["loss"])
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)  # this process's threads: compute, codec and gloo's
            trainers[k] = (step, state)
    return {"bytes": sent, "times": times, "cpu": cpu}


# ----------------------------------------------------------------------------- the fallback: a throttled Comm
def _throttled_measure(rank, world, rate_bps, delay_s, kinds, rounds, width, depth):
    from zfunc.dist.comm import Comm

    plain = Comm._run

    def run(self, kind, nbytes, label, issue, alone=None, async_op=False, check=None):
        def slow():
            time.sleep(nbytes * 8 / rate_bps + delay_s)
            return issue()
        return plain(self, kind, nbytes, label, slow, alone, async_op, check)

    Comm._run = run
    return measure(rank, world, kinds, rounds, width, depth)


# ----------------------------------------------------------------------------- network namespaces
def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


class Namespaces:
    """Two namespaces joined by a shaped veth pair; ``close()`` deletes them (only these)."""

    def __init__(self, rate: str, delay_ms: float):
        tag = os.getpid() % 100000
        self.names, self.veth = (f"zf35a-{tag}", f"zf35b-{tag}"), (f"zfa{tag}", f"zfb{tag}")
        self.made: list[str] = []
        try:
            for ns in self.names:
                _sh("ip", "netns", "add", ns)
                self.made.append(ns)
            _sh("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
            for k, (ns, dev) in enumerate(zip(self.names, self.veth)):
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"10.235.0.{k + 1}/30", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                tc = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev)
                tbf = ("tbf", "rate", rate, "burst", "1mb", "latency", "100ms")
                try:
                    _sh(*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms")
                    _sh(*tc, "parent", "1:", "handle", "2:", *tbf)
                    self.shaping = f"tc netem {delay_ms} ms + tbf {rate}"
                except subprocess.CalledProcessError:  # a kernel without sch_netem: the rate alone
                    _sh(*tc, "root", *tbf)
                    self.shaping = f"tc tbf {rate} (no netem delay: this kernel has no sch_netem)"
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        for ns in self.made:  # deleting a namespace deletes the veth end in it (and so the pair)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []


def _netns_run(rate: str, delay_ms: float, kinds, rounds, width, depth,
               per_node: int = 1) -> tuple[str, list[dict]]:
    nets = Namespaces(rate, delay_ms)
    world = 2 * per_node
    network = (f"veth pair between 2 network namespaces, {nets.shaping}" if per_node == 1 else
               f"2 'nodes' of {per_node} ranks: network namespaces joined by a veth pair, {nets.shaping}; "
               "unshaped loopback inside each")
    out = Path(tempfile.mkdtemp(prefix="zf35-"))
    try:
        procs = []
        for rank in range(world):
            ns, dev = nets.names[rank // per_node], nets.veth[rank // per_node]
            env = dict(os.environ, GLOO_SOCKET_IFNAME=dev, MASTER_ADDR="10.235.0.1", MASTER_PORT="29535",
                       RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
                       LOCAL_WORLD_SIZE=str(per_node), OMP_NUM_THREADS="1",
                       PYTHONPATH=str(Path(__file__).resolve().parents[1]))
            cmd = ["ip", "netns", "exec", ns, sys.executable, __file__, "--worker", str(out / f"{rank}.json"),
                   "--kinds", ",".join(kinds), "--rounds", str(rounds), "--width", str(width), "--depth", str(depth)]
            procs.append(subprocess.Popen(cmd, env=env))
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise RuntimeError(f"a rank in {rate} namespaces exited with {p.returncode}")
        return network, [json.loads((out / f"{r}.json").read_text()) for r in range(world)]
    finally:
        nets.close()
        shutil.rmtree(out, ignore_errors=True)


def _worker(path: str, kinds, rounds, width, depth) -> None:
    zf.dist.init_from_env()
    result = measure(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), kinds, rounds, width, depth)
    Path(path).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- report
def report(network: str, ranks: list[dict], kinds: list[str]) -> None:
    times = {k: [max(r["times"][k][i] for r in ranks) for i in range(len(ranks[0]["times"][k]))] for k in kinds}
    print(f"\n### {network} (load average {os.getloadavg()[0]:.1f})\n")
    print("| trainer | bytes/step (counted, rank 0) | peer | step bytes: peer / this | compressed collective: "
          "peer's fp32 / this | median ms/step | speed vs peer (paired median) | CPU ms/step (rank 0) | "
          "CPU: peer / this |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in kinds:
        mine = ranks[0]["bytes"][k]
        peer = PEERS.get(k)
        ratio = squeezed = speed = cpu_ratio = ""
        cpu = ranks[0]["cpu"][k]
        if peer in kinds:
            theirs = ranks[0]["bytes"][peer]
            ratio = f"{sum(theirs.values()) / sum(mine.values()):.1f}x"
            pairs = [(c, f) for c, f in (("compressed_all_reduce", "all_reduce"),
                                         ("quantized_all_gather", "all_gather"),
                                         ("quantized_reduce_scatter", "reduce_scatter"),
                                         ("quantized_reduce_scatter_across_nodes", "reduce_scatter")) if mine.get(c)]
            squeezed = ", ".join(f"{f} {theirs[f] / mine[c]:.1f}x" for c, f in pairs)
            speed = f"{statistics.median(p / o for p, o in zip(times[peer], times[k])):.2f}x"
            cpu_ratio = f"{statistics.median(p / o for p, o in zip(ranks[0]['cpu'][peer], cpu)):.2f}x"
        detail = ", ".join(f"{n} {v / 1e6:.2f} MB" for n, v in sorted(mine.items()) if v)
        print(f"| {k} | {detail} | {peer or ''} | {ratio} | {squeezed} | {statistics.median(times[k]) * 1e3:.0f} "
              f"| {speed} | {statistics.median(cpu) * 1e3:.0f} | {cpu_ratio} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1gbit,10gbit", help="shaped links to measure, comma-separated ('': none)")
    p.add_argument("--delay-ms", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--kinds", default=None, help="trainers (default: all of the mode's)")
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="2: 4 ranks, 2 per namespace, for hpZ and the two-level reduce-scatter (needs root and tc)")
    p.add_argument("--fallback", action="store_true", help="throttle Comm instead of building namespaces")
    p.add_argument("--loopback", action="store_true", help="also measure on plain loopback (no throttle)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    kinds = args.kinds.split(",") if args.kinds else list(TRAINERS if args.ranks_per_node == 1 else NODE_TRAINERS)
    if args.worker:
        _worker(args.worker, kinds, args.rounds, args.width, args.depth)
        return
    can_shape = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc") and not args.fallback
    if args.ranks_per_node != 1 and not can_shape:
        raise SystemExit(f"--ranks-per-node: {args.ranks_per_node} needs network namespaces (root, ip and tc); "
                         "the throttled Comm cannot tell a node's links from the network's")
    for rate in [r for r in args.rates.split(",") if r.strip()]:
        if can_shape:
            network, ranks = _netns_run(rate, args.delay_ms, kinds, args.rounds, args.width, args.depth,
                                        args.ranks_per_node)
        else:
            bps = float(rate.lower().replace("gbit", "e9").replace("mbit", "e6"))
            network = f"loopback with a throttled Comm (counted bytes / {rate} + {args.delay_ms} ms per collective)"
            ranks = zf.dist.spawn(_throttled_measure, 2, 2, bps, args.delay_ms / 1e3, kinds, args.rounds,
                                  args.width, args.depth, timeout_s=1800)
        report(network, ranks, kinds)
    if args.loopback:
        ranks = zf.dist.spawn(measure, 2, 2, kinds, args.rounds, args.width, args.depth, timeout_s=1800)
        report("loopback, unthrottled (gloo over lo)", ranks, kinds)


if __name__ == "__main__":
    main()
