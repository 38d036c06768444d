"""How a run is judged: the task's eval on the whole params, and the sample it ends with.

Rank 0 evaluates (every rank first takes part in making the params whole: recipes/layout.py's
``whole_params``), in the run's precision, on the same val batches every time (a generator seeded
0), with the model in eval mode (dropout off) and back in train mode after.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn as nn

from recipes import data as data_mod
from recipes import task as task_mod
from recipes.task import Task


def evaluator(task: Task, apply: Callable, loss: Callable, model: nn.Module, val, vocab_size: int,
              args: argparse.Namespace, device: torch.device, precision: str) -> Callable[[dict], dict]:
    """``evaluate(params) -> {"val_loss": ..., and the task's other metrics}``: ``task.evaluate`` on
    the ``val`` split, its ``forward(batch)`` the ``loss``, ``forward.outputs(batch)`` the model's
    output and ``forward.logits(batch)`` its logits, under autocast to ``precision`` below fp32."""
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def autocast():
        return torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None)

    @torch.no_grad()
    def evaluate(params: dict) -> dict:
        import zfunc as zf

        model.eval()

        def forward(batch):
            batch = tuple(t.to(device) for t in batch)
            with autocast():
                return loss(params, batch)

        def outputs(batch):
            with autocast():
                return apply(params, *(t.to(device) for t in batch[:task.inputs]))

        forward.outputs, forward.logits = outputs, lambda batch: task_mod.logits_of(outputs(batch))
        with zf.sequence.whole(model):  # one rank: whole sequences (--sp: as if on one rank)
            out = task.evaluate(forward, val, args, torch.Generator().manual_seed(0), vocab_size)
        model.train()
        return out

    return evaluate


def sample(apply: Callable, params: dict, model: nn.Module, args: argparse.Namespace,
           device: torch.device) -> bytes | str:
    """--sample-len tokens after "def ", drawn at --temperature from the --top-k likeliest (seeded by
    --seed): bytes, or with --tokenizer their text. Leaves the model in eval mode."""
    import zfunc as zf

    model.eval()
    codec = data_mod.codec(args.tokenizer)
    with zf.sequence.whole(model):
        ids = task_mod.generate(lambda idx: apply(params, idx), codec.encode("def "), args.sample_len,
                                args.block_size, args.temperature, args.top_k,
                                torch.Generator().manual_seed(args.seed), device)
    return bytes(ids) if args.tokenizer is None else codec.decode(ids)


def sample_text(sampled: bytes | str) -> str:
    """The sample as printed: after its prompt, bytes decoded as UTF-8 (replacing what is not)."""
    return (b"def " + sampled).decode("utf-8", errors="replace") if isinstance(sampled, bytes) else "def " + sampled
