"""Named model sizes: the GPT flavors, and the lookup every recipe's `--flavor` uses.

A flavor is the published shape of a real model (vocabulary, context, depth, width, heads), so a GPU
user picks a real size with one flag. Each recipe keeps its table at the top of its own file
(Llama: recipes/llama.py, BERT: recipes/bert.py); GPT's is here, as ``GPTConfig`` keyword arguments
(recipes/gpt.py holds the model). A string value is an alias: the common names
(debug|small|125M|350M|1B|7B|13B|70B) map onto the nearest published model of each family.

GPT mapping (published shape -> name):
  GPT-2 (openai/gpt-2, HF configs gpt2*, vocab 50257, context 1024): small 124M, medium 355M,
    large 774M, xl 1558M.
  GPT-3 (Brown et al. 2020, arXiv:2005.14165, Table 2.1, vocab 50257, context 2048): 125M, 350M, 760M,
    1.3B, 2.7B, 6.7B, 13B, 175B.
  70B: no GPT-3 row is near 70B; the 76.1B GPT of Megatron-LM (Narayanan et al. 2021,
    arXiv:2104.04473, Table 1: 60 layers, hidden 10240, 80 heads, vocab 51200, sequence 2048).
  Aliases: 1B -> 1.3B (GPT-3 XL), 7B -> 6.7B, 70B -> 76B.
The recipe's GPT has no biases in its linear layers (GPT-2/3 have them): 9 * n_embd per layer fewer
parameters, under 0.1% of any flavor here.
"""
from __future__ import annotations

from typing import Any

GPT_FLAVORS: dict[str, Any] = {
    # Not a published model: the smallest shape that still has every part, for tests and smoke runs.
    "debug": dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    # GPT-2: openai/gpt-2 model names 124M/355M/774M/1558M; shapes from the HF configs gpt2, gpt2-medium,
    # gpt2-large, gpt2-xl (n_positions 1024, vocab 50257).
    "small": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "medium": dict(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "large": dict(vocab_size=50257, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "xl": dict(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    # GPT-3, Table 2.1 (n_ctx 2048 for all sizes; the GPT-2 BPE vocabulary of 50257).
    "125M": dict(vocab_size=50257, block_size=2048, n_layer=12, n_head=12, n_embd=768),
    "350M": dict(vocab_size=50257, block_size=2048, n_layer=24, n_head=16, n_embd=1024),
    "760M": dict(vocab_size=50257, block_size=2048, n_layer=24, n_head=16, n_embd=1536),
    # XL: the table prints 24 heads of d_head 128 beside d_model 2048 (24 x 128 = 3072); 16 heads of 128
    # fill 2048, as the GPT-3 XL reproduction GPT-Neo 1.3B has. Heads do not change the count.
    "1.3B": dict(vocab_size=50257, block_size=2048, n_layer=24, n_head=16, n_embd=2048),
    "2.7B": dict(vocab_size=50257, block_size=2048, n_layer=32, n_head=32, n_embd=2560),
    "6.7B": dict(vocab_size=50257, block_size=2048, n_layer=32, n_head=32, n_embd=4096),
    # The table prints d_model 5140 beside 40 heads of d_head 128; 40 x 128 = 5120, the width
    # reproductions use (OPT-13B, Megatron): 5140 is not divisible into 40 heads.
    "13B": dict(vocab_size=50257, block_size=2048, n_layer=40, n_head=40, n_embd=5120),
    "175B": dict(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, n_embd=12288),
    # Megatron-LM's 76.1B GPT (GPT-3 architecture), the published GPT shape nearest 70B.
    "76B": dict(vocab_size=51200, block_size=2048, n_layer=60, n_head=80, n_embd=10240),
    "1B": "1.3B",
    "7B": "6.7B",
    "70B": "76B",
}


def lookup(table: dict[str, Any], name: str, recipe: str) -> dict[str, Any]:
    """The config keyword arguments of flavor ``name`` in ``table`` (aliases followed), as a new dict.

    Raises ValueError naming the recipe, the flavor asked for and every flavor it has.
    """
    seen = []
    entry: Any = name
    while isinstance(entry, str):
        if entry in seen or entry not in table:
            known = ", ".join(f"{k} (= {v})" if isinstance(v, str) else k for k, v in table.items())
            raise ValueError(f"--flavor: the {recipe} recipe has no flavor {name!r}; expected one of: {known}")
        seen.append(entry)
        entry = table[entry]
    return dict(entry)


def gpt_flavor(name: str) -> dict[str, Any]:
    """``GPTConfig`` keyword arguments of GPT flavor ``name`` (see the module docstring)."""
    return lookup(GPT_FLAVORS, name, "gpt")
