"""A stage's backward split in two (zero-bubble schedules): the grad of its input first, the
grads of its params later, without computing any grad twice.

``input_grad(root, grad_out, act_in, weights)`` walks the autograd graph once: the nodes on a
path from ``root`` to ``act_in`` form the input closure; for each weight, the first nodes of that
closure its paths reach are its *intermediates* (weights sharing one are one group). A pre-hook on
each intermediate keeps the grads flowing into it while ``torch.autograd.grad`` computes the
input's grad alone (the graph retained). ``weight_grads(pending)`` then differentiates each group
from its intermediates, with the kept grads, down to its weights (``GradientEdge``), a hook
clamping each intermediate to its kept grads so that none counts twice. This is torch's
``stage_backward_input`` / ``stage_backward_weight`` (``torch.distributed.pipelining``), with
groups merged transitively and weights no path from the input reaches (a term of the loss on
params alone) differentiated from ``root``.

**Law.** The input grad and the weight grads equal one ``torch.autograd.grad(root, [act_in,
*weights], grad_out)`` up to the order of float sums. **Cost.** The backward's compute once
(input-grad matmuls in the first call, weight-grad matmuls in the second); one Python walk over the
stage's graph per microbatch; the graph and the intermediates' grads held from the first call to
the second (what a zero-bubble schedule's peak of live microbatches counts).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

Node = Any


def _node(t: torch.Tensor) -> Node:
    """``t``'s grad_fn, or for a leaf its grad accumulator (made through a view, as torch does)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """For each node of ``root``'s graph, the nodes that feed it its grads (the reversed edges)."""
    edges: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for fn, _ in node.next_functions:
            if fn is None:
                continue
            if fn not in edges:
                edges[fn] = []
                queue.append(fn)
            edges[fn].append(node)
    return edges


def _closure(starts: list[Node], stop: set[Node], edges: dict[Node, list[Node]]) -> tuple[set[Node], set[Node]]:
    """The nodes reached from ``starts`` along reversed edges without entering ``stop``, and the
    nodes of ``stop`` met at its border."""
    seen, met = set(starts), set()
    queue = deque(starts)
    while queue:
        for fn in edges.get(queue.popleft(), ()):
            if fn in seen or fn in met:
                continue
            if fn in stop:
                met.add(fn)
                continue
            seen.add(fn)
            queue.append(fn)
    return seen, met


@dataclass
class _Group:
    weights: set[int]
    intermediates: set[Node]
    nodes: list[Node] = field(default_factory=list)
    kept: list[Any] = field(default_factory=list)


@dataclass
class PendingWeights:
    """What ``weight_grads`` needs: the graph's root and its incoming grad, the weights, their
    groups with the grads kept at their intermediates, and the weights to differentiate from the root."""

    root: torch.Tensor
    grad_out: list[torch.Tensor] | None
    weights: list[torch.Tensor]
    groups: list[_Group]
    from_root: list[int]


def _leaves(edges: dict[Node, list[Node]]) -> set[int]:
    """The ids of the leaf tensors whose grad accumulators are in the graph ``edges``."""
    return {id(v) for n in edges if not n.next_functions and (v := getattr(n, "variable", None)) is not None}


def _groups(weights: list[torch.Tensor], inputs: set[Node], edges: dict[Node, list[Node]]):
    by_node: dict[Node, _Group] = {}
    from_root = []
    leaves = _leaves(edges)
    for j, w in enumerate(weights):
        if w.grad_fn is None and id(w) not in leaves:
            continue  # a leaf not in this graph (another stage's param, a stand-in): no grad, and no node made
        node = _node(w)
        if node not in edges:
            continue  # not in this graph: no grad
        _, met = _closure([node], inputs, edges)
        if not met:
            from_root.append(j)
            continue
        merged = _Group({j}, set(met))
        for other in {id(by_node[n]): by_node[n] for n in met if n in by_node}.values():
            other.weights |= merged.weights
            other.intermediates |= merged.intermediates
            merged = other
        for n in merged.intermediates:
            by_node[n] = merged
    return list({id(g): g for g in by_node.values()}.values()), from_root


def input_grad(root: torch.Tensor, grad_out: list[torch.Tensor] | None, act_in: torch.Tensor,
               weights: list[torch.Tensor]) -> tuple[torch.Tensor | None, PendingWeights]:
    """The grad of ``act_in`` (None where ``root`` does not depend on it) and what ``weight_grads``
    needs for ``weights``' (module docstring)."""
    edges = _consumers(root.grad_fn)
    start = _node(act_in)
    inputs, _ = _closure([start], set(), edges) if start in edges else (set(), set())
    groups, from_root = _groups(weights, inputs, edges) if inputs else ([], list(range(len(weights))))
    handles = []
    for group in groups:
        group.nodes = list(group.intermediates)
        group.kept = [None] * len(group.nodes)
        for k, node in enumerate(group.nodes):
            def keep(grads, group=group, k=k):
                group.kept[k] = grads
            handles.append(node.register_prehook(keep))
    try:
        (dinput,) = torch.autograd.grad([root], [act_in], grad_out, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return dinput, PendingWeights(root, grad_out, weights, groups, from_root)


def weight_grads(pending: PendingWeights) -> list[torch.Tensor | None]:
    """The grads of ``pending``'s weights (None where a weight has none), in their order; the
    graph is freed when ``pending`` is dropped."""
    out: list[torch.Tensor | None] = [None] * len(pending.weights)
    for group in pending.groups:
        outputs, grads = [], []
        for node, kept in zip(group.nodes, group.kept):
            for k, g in enumerate(kept or ()):
                if g is not None:
                    outputs.append(GradientEdge(node, k))
                    grads.append(g)
        if not outputs:
            continue
        handles = []
        if len(group.nodes) > 1:  # an intermediate below another gets its kept grads, not theirs again
            handles = [node.register_prehook(lambda _, kept=kept: kept) for node, kept in zip(group.nodes, group.kept)
                       if kept is not None]
        order = sorted(group.weights)
        try:
            found = torch.autograd.grad(outputs, [GradientEdge(_node(pending.weights[j]), 0) for j in order], grads,
                                        retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for j, g in zip(order, found):
            out[j] = g
    if pending.from_root:
        found = torch.autograd.grad([pending.root], [pending.weights[j] for j in pending.from_root],
                                    pending.grad_out, retain_graph=True, allow_unused=True)
        for j, g in zip(pending.from_root, found):
            out[j] = g
    return out
