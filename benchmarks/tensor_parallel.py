"""Tensor parallelism on 2 gloo ranks of this CPU: zf.tensor_parallel vs torch's parallelize_module.

    python benchmarks/tensor_parallel.py [--dim 256] [--n-layers 4] [--batch 8] [--block-size 128]
                                         [--steps 3] [--rounds 5]

One spawn of 2 ranks; every rank builds the same Llama (recipes/llama.py: separate q, k, v
projections, grouped-query attention, SwiGLU, untied head) twice and slices both copies over tp=2:

- zfunc: ``zf.tensor_parallel(model, mesh, gather_logits=False)`` (its plan found from the module
  graph), the loss ``zf.tensor_parallel.cross_entropy`` on the vocab-sliced logits, stepped by
  ``zf.tensor_parallel.step(zf.train_step(loss, AdamW))``;
- torch: ``parallelize_module`` with ``ColwiseParallel`` (q, k, v, gate, up), ``RowwiseParallel``
  (o, down), a row-parallel embedding and a colwise LM head whose logits stay sharded, the loss
  under ``loss_parallel()``, ``torch.optim.AdamW`` (foreach; one for the DTensor params, one for
  the plain norm weights, which foreach cannot mix); the attention's head counts divided by tp,
  as torch's tutorial does.

Both train with AdamW (lr 1e-3, no clipping), fp32. They run interleaved, ``--steps`` steps each
per round, after a warm-up step; the printed ratio is the median over rounds of the paired
(torch time / zfunc time) per step, rank 0's clock, so > 1 means zfunc is faster. Memory: the
bytes each rank holds of params, grads and AdamW moments (16 bytes per local param, both sides)
against the unsliced model's. Comm: the bytes zfunc's tp group moved in one step (``Comm``'s
count) against ``zfunc.tensor.transform``'s formula. On this shared 2-core machine compare
ratios, not absolute times.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from recipes.llama import Llama, LlamaConfig  # noqa: E402

LR = 1e-3


def batches(args, n):
    g = torch.Generator().manual_seed(1)
    shape = (args.batch, args.block_size)
    return [(torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)) for _ in range(n)]


def zfunc_trainer(model, mesh):
    zf.tensor_parallel(model, mesh, gather_logits=False)
    apply, params = zf.functionalize(model)

    def loss_fn(p, batch):
        return zf.tensor_parallel.cross_entropy(apply(p, batch[0]), batch[1], mesh)

    step = zf.tensor_parallel.step(zf.train_step(loss_fn, zf.optim.adamw(LR, weight_decay=0.0), grad_norm=False),
                                   model)
    box = {"state": step.init(params)}

    def run(batch):
        box["state"], m = step(box["state"], batch)
        return m["loss"].item()

    local = sum(p.numel() for p in box["state"].params.values())
    return run, local


def torch_trainer(model, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (tp,))
    plan = {"embed": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, layer in enumerate(model.layers):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.down"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
        layer.attn.n_heads //= tp
        layer.attn.n_kv_heads //= tp
    parallelize_module(model, mesh, plan)
    sliced = [p for p in model.parameters() if hasattr(p, "to_local")]  # foreach needs one kind per call
    plain = [p for p in model.parameters() if not hasattr(p, "to_local")]  # the norms: plain tensors
    opts = [torch.optim.AdamW(ps, lr=LR, weight_decay=0.0, foreach=True) for ps in (sliced, plain) if ps]

    def run(batch):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with loss_parallel():
            logits = model(batch[0])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
            loss.backward()
        for opt in opts:
            opt.step()
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return run, local


def expected_comm_bytes(cfg: LlamaConfig, args, tp: int) -> int:
    """zfunc.tensor.transform's formula for one step: per block two regions, each an all-reduce of the
    activation in forward and one in backward (2A each, A = B T d fp32); the embedding's forward
    all-reduce and the LM head's input grad (2A each); the vocab-parallel loss: an all-gather of the
    B T maxima (tp copies) and two all-reduces of B T floats; the grad norm is off."""
    tokens = args.batch * args.block_size
    activation = tokens * cfg.dim * 4
    return cfg.n_layers * 2 * 2 * (2 * activation) + 2 * (2 * activation) + tp * tokens * 4 + 2 * (2 * tokens * 4)


def rank_main(rank, args):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.n_layers, n_heads=8, n_kv_heads=4,
                      ffn_dim=args.dim * 11 // 4, max_seq_len=args.block_size)
    base = Llama(cfg)
    whole = sum(p.numel() for p in base.parameters())
    mesh = zf.Mesh(tp=2)
    zrun, zlocal = zfunc_trainer(copy.deepcopy(base), mesh)
    trun, tlocal = torch_trainer(copy.deepcopy(base), 2)
    data = batches(args, 1 + args.rounds * args.steps)
    zrun(data[0])
    trun(data[0])
    mesh.tp_comm.bytes.clear()
    zrun(data[0])
    comm = sum(mesh.tp_comm.bytes.values())
    ratios, zt, tt = [], [], []
    i = 1
    for _ in range(args.rounds):
        for run, times in ((zrun, zt), (trun, tt)):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for k in range(args.steps):
                run(data[i + k])
            torch.distributed.barrier()
            times.append((time.perf_counter() - t0) / args.steps)
        ratios.append(tt[-1] / zt[-1])
        i += args.steps
    return dict(ratio=statistics.median(ratios), zfunc_s=statistics.median(zt), torch_s=statistics.median(tt),
                whole_bytes=16 * whole, zfunc_bytes=16 * zlocal, torch_bytes=16 * tlocal, comm=comm,
                expected_comm=expected_comm_bytes(cfg, args, 2))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    r = zf.dist.spawn(rank_main, 2, args, timeout_s=1800)[0]
    print(f"tp=2 on 2 gloo ranks, Llama dim {args.dim} x {args.n_layers} layers, batch {args.batch} x "
          f"{args.block_size} tokens, fp32 AdamW")
    print(f"step time: zfunc {r['zfunc_s'] * 1e3:.1f} ms, torch parallelize_module {r['torch_s'] * 1e3:.1f} ms "
          f"(medians); paired ratio torch/zfunc: {r['ratio']:.2f}x")
    print(f"bytes per rank (params, grads, AdamW moments): zfunc {r['zfunc_bytes'] / 2**20:.1f} MiB, torch "
          f"{r['torch_bytes'] / 2**20:.1f} MiB, unsliced {r['whole_bytes'] / 2**20:.1f} MiB "
          f"(saving: zfunc {r['whole_bytes'] / r['zfunc_bytes']:.2f}x, "
          f"torch {r['whole_bytes'] / r['torch_bytes']:.2f}x)")
    print(f"tp comm bytes per step: measured {r['comm']:,}, formula {r['expected_comm']:,}")


if __name__ == "__main__":
    main()
