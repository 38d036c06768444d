"""``python -m recipes.plan``: zfunc's planner (``python -m zfunc.plan``, the same flags) with the
recipes' named sizes known, so ``--flavor NAME --recipe gpt|llama|bert`` plans a published model as
the recipe builds it (its exact leaves, on the meta device):

    python -m recipes.plan --flavor 7B --recipe llama --gpus 8 --json

The planner itself knows no recipe (the library never imports ``recipes/``); ``register`` hands it
each recipe's flavors through ``zfunc.plan.register_flavors``.
"""
from __future__ import annotations

import sys

from zfunc.plan import register_flavors
from zfunc.plan.__main__ import main as plan_main


def register() -> None:
    """Register the GPT, Llama and BERT recipes' flavors with ``zfunc.plan`` (``from_flavor``)."""
    from recipes import bert, flavors, gpt, llama

    register_flavors("gpt", lambda name: _built(gpt.GPT, gpt.GPTConfig(**flavors.gpt_flavor(name))))
    register_flavors("llama", lambda name: _built(llama.Llama, llama.flavor(name)))
    register_flavors("bert", lambda name: _built(bert.Bert, bert.flavor(name)))


def _built(model_class, config):
    return model_class(config), config


def main(argv: list[str] | None = None) -> int:
    """``python -m zfunc.plan``'s command line, the recipes' flavors registered first."""
    register()
    return plan_main(argv)


if __name__ == "__main__":
    sys.exit(main())
