"""What rank 0 says of a run: the data line, the model, the layout and the plan's bytes per rank before
training, the dry run's verdict, and the final numbers after.

The plan's bytes are zfunc.plan's accounting of the meta-device leaves (what ``step.memory(state)``
would report after a step): computed from shapes alone, nothing allocated. ``--dry-run`` stops after
them and the verdict on this machine (recipes/verdict.py: fits or not, what binds, a layout that
fits).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn

from recipes import data_cap, layout, verdict
from recipes import data as data_mod
from recipes.recipe import Built, n_params

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12}  # dense


def data_line(corpus: data_mod.Corpus, baseline: dict, unit: str) -> str:
    """What was read of --data, the splits' sizes, and the baselines the model must beat."""
    return (f"data: {data_cap.used(corpus)}; {len(corpus.train):,} train / {len(corpus.val):,} val {unit}s; "
            + ", ".join(f"{k.replace('_', ' ')} of val {v:.3f}" for k, v in baseline.items())
            + (" nats/byte" if unit == "byte" and "unigram_entropy" in baseline else ""))


def plan_bytes(params: dict, plan, model: nn.Module | None = None) -> dict[str, int]:
    """Bytes the busiest rank (rank 0) keeps by place -- "device", "cpu", "nvme" -- after a step, in
    zfunc.plan's accounting of these exact leaves (what step.memory(state) would report; stage 3's
    gathered units on top, bounded by zp.working_bound): with --pp, of the leaves pipeline stage 0
    keeps (``model`` tells which). Computed from shapes alone: nothing allocated."""
    from zfunc import plan as zp

    mine = params if model is None else layout.rank0_params(model, params, plan)
    leaves = [tuple(p.shape) for p in mine.values()]
    if plan.offload_optimizer != "none":  # zfunc.offloading.accounting: the state, and the grads held for the norm
        return zp.offload_bytes(leaves, plan.dp, 0, optimizer=plan.offload_optimizer, precision=plan.precision,
                                params=None if plan.offload_params == "none" else plan.offload_params,
                                held=zp.offload_holds_grads(plan), accum=plan.accum)
    engine = _engine_bytes(leaves, plan)
    return {"device": sum(engine.values()), "cpu": 0, "nvme": 0}


def _engine_bytes(leaves: list[tuple[int, ...]], plan) -> dict[str, int]:
    """zp.engine_bytes of rank 0's leaves at the stage the engine runs (layout.engine_stage)."""
    from zfunc import plan as zp

    accum = plan.microbatches if plan.pp > 1 else plan.accum  # a pipeline sums its microbatches' grads
    return zp.engine_bytes(leaves, plan.dp, 0, layout.engine_stage(plan), precision=plan.precision, accum=accum)


def zero_alone(params: dict, plan) -> str:
    """Why ZeRO 1 or 2 on one process holds more than ZeRO 0 ("" where it does not): it shards over
    one rank, so nothing is split, and its step still gathers a whole copy of the params (ZeRO 0
    computes on the fp32 masters themselves; below fp32 both make a compute copy) and keeps whole
    grads beside the fp32 grad slice the optimizer reads (ZeRO 0 sums them straight into it)."""
    if plan.dp > 1 or plan.pp > 1 or plan.zero_stage not in (1, 2):
        return ""
    zero0 = dataclasses.replace(plan, zero_stage=0)
    extra = plan_bytes(params, plan)["device"] - plan_bytes(params, zero0)["device"]
    leaves = [tuple(p.shape) for p in params.values()]
    mine, theirs = _engine_bytes(leaves, plan), _engine_bytes(leaves, zero0)
    held = [what for key, what in (("whole_params", "a whole copy of the params"),
                                   ("whole_grads", "whole grads beside the fp32 grad slice"))
            if mine.get(key, 0) > theirs.get(key, 0)]
    if extra <= 0 or not held:
        return ""
    return (f"; ZeRO {plan.zero_stage} on one process shards nothing and holds {extra / 1e9:.3g} GB more than "
            f"--zero 0: {' and '.join(held)} in each step")


def describe(args, plan, launch, built: Built, device, params: dict) -> list[str]:
    """What rank 0 says about the model, the layout and the plan's bytes per rank before training."""
    gb = lambda n: f"{n / 1e9:.3g} GB"  # noqa: E731
    where = plan_bytes(params, plan, built.module)
    ranks = f"rank 0 of {launch.world}" + (f", pipeline stage 0 of {plan.pp}" if plan.pp > 1 else "")
    return [f"model: {n_params(built.module) / 1e6:.2f}M params {built.config}; device {device}, "
            f"precision {plan.precision}; {args.steps} steps x {args.batch_size * args.block_size:,} tokens",
            f"layout: {launch.world} process{'es' * (launch.world > 1)}"
            + (" (planned in one process: a dry run)" if launch.planned else "") + f", dp={plan.dp} pp={plan.pp}"
            + (f" ({plan.pipeline_schedule} schedule" + (f", {plan.virtual_stages} virtual stages per rank"
                                                         if plan.virtual_stages > 1 else "") + ")"
               if plan.pp > 1 else "")
            + (f" sp={plan.sp_size} ({plan.sp_kind})" if plan.sp_size > 1 else "")
            + (f" tp={plan.tp}" if plan.tp > 1 else "") + (" (sequence parallel)" if plan.sp else "") + ", ZeRO "
            f"{plan.zero_stage}, offload optimizer {plan.offload_optimizer} params {plan.offload_params}, remat "
            f"{plan.remat}; per rank {args.batch_size // plan.dp} sequences in "
            f"{plan.microbatches if plan.pp > 1 else plan.accum} microbatches",
            f"plan (zfunc.plan, {ranks}, model states after a step): device {gb(where['device'])}, "
            f"cpu {gb(where['cpu'])}, nvme {gb(where['nvme'])}" + zero_alone(params, plan)]


def vocab_note(args: argparse.Namespace, model: nn.Module, model_vocab: Any, data_vocab: int, unit: str,
               special: int = 0) -> str:
    """One line when the model has more token ids than the data (a --flavor or --hf-config made for
    a tokenizer, trained on bytes): its embedding and head (their params, and bytes at 16 a param:
    fp32 weights and grads, Adam's two moments), the logits per token, and how to shrink them; ""
    otherwise. The model is kept as asked: its shape is the config's or the flavor's."""
    if not isinstance(model_vocab, int) or model_vocab <= data_vocab:
        return ""
    unique = {id(p): p for p in model.parameters()}.values()  # a tied head is the embedding
    rows = sum(p.numel() for p in unique if p.dim() and p.shape[0] == model_vocab)
    what = f"{unit}s" + (f" and {special} special tokens" if special else "")
    fix = (f'"vocab_size": {data_vocab} in the --hf-config shrinks them' if args.hf_config is not None else
           f"a --tokenizer with {model_vocab:,} tokens uses them; the model flags in place of --flavor {args.flavor} "
           "size them to the data")
    return (f"vocab: the model has {model_vocab:,} token ids, the data {data_vocab:,} ({what}): its embedding and "
            f"head ({rows / 1e6:.2f}M params, {16 * rows / 1e9:.3g} GB of weights, grads and Adam state) and "
            f"{model_vocab:,} logits per token serve {model_vocab - data_vocab:,} ids the data never holds; {fix}")


def peak_flops(device) -> float | None:
    """The dense bf16 peak FLOP/s of a known GPU (None: a CPU, or a GPU not on record)."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def dry_run(recipe_name: str, args: argparse.Namespace, plan, built: Built, params: dict, device: torch.device,
            launch: layout.Launch, say: Callable[[str], None]) -> dict:
    """``--dry-run``'s end: rank 0 judges the plan against this machine and says its verdict; the
    numbers ``train`` returns for it (``fits`` and ``needs`` on rank 0, None on the others)."""
    found = verdict.of_run(recipe_name, args, plan, built, device, launch.world) if launch.rank == 0 else None
    for line in found.lines if found is not None else []:
        say(line)
    return dict(rank=launch.rank, n_params=n_params(built.module), plan_bytes=plan_bytes(params, plan, built.module),
                config=built.config, fits=found.fits if found else None, needs=found.needs if found else None)


def mfu(flops_per_token: float, tokens_per_s: float, device: torch.device, world: int) -> float | None:
    """Model FLOP/s utilization: the model's FLOP/s over the peak of ``world`` devices (None: no peak
    on record, or not a GPU)."""
    peak = peak_flops(device)
    return flops_per_token * tokens_per_s / (peak * world) if peak else None


def mfu_line(value: float | None, device: torch.device) -> str:
    """The MFU line a run on a GPU ends with."""
    peak = peak_flops(device)
    if value is None:
        return f"MFU unknown: no peak FLOP/s on record for {torch.cuda.get_device_name(device)}"
    return f"MFU {value:.1%} of {peak / 1e12:.0f} TFLOP/s bf16 peak per GPU"
