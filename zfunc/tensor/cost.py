"""What tensor parallelism costs per rank: bytes held and bytes moved per step (``Comm``'s counts).

Memory (fp32 AdamW: param, grad and two moments, 16 bytes per param a rank holds): a sliced param
holds ``padded / tp`` of its rows (or columns) on each rank, a replicated one all of them, so

    bytes per rank = 16 * (sum over sliced params of numel / tp, padding included
                           + sum over replicated params of numel)

Sequence parallelism divides the activations between the regions (norm inputs and outputs,
dropout masks, residual adds: about ``(2 + dropouts) * A`` per block) by tp as well.

Communication per microbatch, ``A = tokens * d * 4`` bytes (the whole activation, fp32; all-reduce
counted twice its tensor, all-gather its output, reduce-scatter its input):

- each region (a rowwise projection's output and its colwise inputs: attention, MLP): ``2A`` in
  forward (all-reduce) and ``2A`` in backward (the input's grad, one all-reduce however many
  projections read it); sequence-parallel: the same ``4A``, as an all-gather and a reduce-scatter
  of ``A`` each way (the saving is in memory, not bytes).
- a replicated grouped-query key or value projection (``replicated_kv``): ``2 * 4 * numel`` in backward
  (its weight's grads all-reduced; sequence-parallel: part of the replicated params' all-reduce);
- the vocab-parallel embedding: ``2A`` forward (sequence-parallel: a reduce-scatter, ``A``, and
  its grad's all-gather, ``A``);
- the vocab-parallel head: ``2A`` backward for its input (sequence-parallel: ``A`` forward and
  ``A`` backward) and, with the logits gathered, ``tokens * V_padded * 4`` forward;
- a head and embedding ``zf.tile`` split into vocab tiles (``zfunc.tensor.transform.tiled_styles``):
  the same, ``V_padded`` the sum of the tiles' padded rows (each tile pads to a multiple of tp);

and per step: the grad norm's scalar all-reduce (8 bytes), and, sequence-parallel, the all-reduce
of the replicated params' grads (``2 * 4 * replicated numel``).
"""
from __future__ import annotations

from zfunc.tensor.layout import Layout


def params_per_rank(whole_shapes: dict[str, tuple[int, ...]], layout: Layout) -> int:
    """The params a rank holds, from the whole model's shapes (name -> shape): a sliced param's
    numel padded and divided by tp, a replicated one's whole (see the module docstring)."""
    total = 0
    for name, shape in whole_shapes.items():
        numel = 1
        for n in shape:
            numel *= n
        s = layout.slicings.get(name)
        total += numel if s is None else numel // s.size * s.padded // layout.tp
    return total


def bytes_per_rank(whole_shapes: dict[str, tuple[int, ...]], layout: Layout) -> int:
    """Param, grad and AdamW moment bytes a rank holds: 16 per fp32 param it holds."""
    return 16 * params_per_rank(whole_shapes, layout)


def comm_bytes_per_step(layout: Layout, tokens: int, width: int, vocab_padded: int, microbatches: int = 1,
                        gathered_logits: bool = True, norm: bool = True, replicated_numel: int = 0,
                        replicated_kv_numel: int = 0) -> int:
    """The tp group's bytes in one step (see the module docstring): ``tokens`` per microbatch,
    ``width`` the model's hidden size, ``vocab_padded`` the vocab rounded up to a multiple of tp,
    ``replicated_kv_numel`` the params of the replicated grouped-query kv projections."""
    a = tokens * width * 4
    regions = sum(1 for s in layout.styles.values() if s == "rowwise")
    embeddings = len({_layer(n, layout) for n, s in layout.styles.items() if s == "vocab" and n in layout.embeddings})
    heads = len({_layer(n, layout) for n, s in layout.styles.items() if s == "vocab" and n not in layout.embeddings})
    per_micro = (regions * 4 + embeddings * 2 + heads * 2) * a
    if not layout.sequence_parallel:
        per_micro += 2 * 4 * replicated_kv_numel
    if gathered_logits:
        per_micro += heads * tokens * vocab_padded * 4
    per_step = microbatches * int(per_micro) + (8 if norm else 0)
    if layout.sequence_parallel:
        per_step += 2 * 4 * replicated_numel
    return per_step


def _layer(name: str, layout: Layout) -> str:
    """The layer a module is: a tile of a ``zf.tile``d layer is its layer (its tiles' lookups and logits
    together move what the whole layer's do; the head's tiles share one input grad all-reduce)."""
    owner, _, index = name.rpartition(".tiles.")
    return owner if owner in layout.tiled and index.isdigit() else name
