"""``zfunc``: the ``deepspeed`` launcher's common arguments, run as torchrun on this machine.

    zfunc --num_gpus 2 train.py --deepspeed_config ds_config.json
    # runs: python -m torch.distributed.run --standalone --nproc_per_node 2 train.py --deepspeed_config ...

Accepted: ``--num_gpus`` / ``--num_accelerators`` (processes; default: the CUDA devices, else 1),
``--num_nodes`` (1 only), ``--master_port``, ``--master_addr`` (this host), ``--hostfile`` (one
host, whose ``slots=N`` sets the processes when ``--num_gpus`` is not given), ``--no_local_rank``
(torchrun never passes ``--local_rank``; ranks read ``LOCAL_RANK``). Refused, naming the flag:
several nodes or hosts, ``--include`` / ``--exclude``, ``--launcher`` other than pdsh, ``--autotuning``,
``--elastic_training``. The process is replaced by torchrun (``os.execv``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zfunc", description=__doc__.splitlines()[0])
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, dest="num_gpus")
    p.add_argument("--num_nodes", type=int, default=-1)
    p.add_argument("--master_port", type=int, default=None)
    p.add_argument("--master_addr", default="")
    p.add_argument("--hostfile", "-H", default=None)
    p.add_argument("--no_local_rank", action="store_true")
    for flag in ("--include", "-i", "--exclude", "-e", "--launcher", "--autotuning"):
        p.add_argument(flag, default=None, dest=f"refused_{flag.lstrip('-')}")
    p.add_argument("--elastic_training", action="store_true")
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def _hostfile_slots(path: str) -> int | None:
    """The slots of the one host ``path`` lists (None when it gives none)."""
    hosts = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(line)
    if len(hosts) != 1:
        raise SystemExit(f"zfunc: --hostfile {path}: zfunc launches on one host, the file lists {len(hosts)}")
    name, _, rest = hosts[0].partition(" ")
    for part in rest.split():
        if part.startswith("slots="):
            return int(part[len("slots="):])
    return None


def torchrun_command(argv: list[str]) -> list[str]:
    """The torchrun command line the ``zfunc`` launcher runs for ``argv``; ``SystemExit`` naming a refused flag."""
    args = _parser().parse_args(argv)
    for name in ("include", "i", "exclude", "e", "autotuning"):
        if getattr(args, f"refused_{name}") is not None:
            raise SystemExit(f"zfunc: -{'-' if len(name) > 1 else ''}{name}: not supported (one host, all its ranks)")
    if args.refused_launcher not in (None, "pdsh"):
        raise SystemExit(f"zfunc: --launcher {args.refused_launcher}: not supported; zfunc runs torchrun on this host")
    if args.elastic_training:
        raise SystemExit("zfunc: --elastic_training: not supported")
    if args.num_nodes not in (-1, 1):
        raise SystemExit(f"zfunc: --num_nodes {args.num_nodes}: zfunc launches one node; for several, run torchrun "
                         "with its rendezvous on each node")
    nproc = args.num_gpus
    if nproc == -1 and args.hostfile:
        nproc = _hostfile_slots(args.hostfile) or -1
    if nproc == -1:
        nproc = torch.cuda.device_count() or 1
    if nproc < 1:
        raise SystemExit(f"zfunc: --num_gpus {nproc}: expected >= 1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if args.master_port is None and not args.master_addr:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", "1", "--master_addr", args.master_addr or "127.0.0.1",
                "--master_port", str(args.master_port or 29500)]
    return cmd + [args.user_script, *args.user_args]


def main(argv: list[str] | None = None) -> None:
    cmd = torchrun_command(sys.argv[1:] if argv is None else argv)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
