"""`--hf-config`: any Hugging Face `transformers` causal or masked LM, built from its config alone.

The model is randomly initialized from the config (no weights, no downloads: nothing here touches the
hub), and wrapped so that ``model(idx) -> logits`` like the recipes' own models. `transformers` is an
optional extra: it is imported only inside these functions, when the flag is used.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from recipes import recipe
from zfunc.config import hf as hf_config

TASKS = ("causal-lm", "masked-lm")


def read_config(spec: str | os.PathLike | dict) -> dict[str, Any]:
    """The config as a dict, from a dict, a JSON object string, a config.json path, or a folder holding
    one, every value checked and nothing in it able to run code (``zfunc.config.hf``). Raises
    ValueError / FileNotFoundError naming --hf-config, where the config came from, the key, its value
    and what was expected."""
    try:
        cfg = hf_config.read(spec)
        hf_config.checked(cfg, hf_config.where(spec))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--hf-config: {e}") from None
    except (ValueError, ImportError) as e:
        raise ValueError(f"--hf-config: {e}") from None
    return cfg


def build(spec: str | os.PathLike | dict, task: str = "causal-lm", **overrides) -> "HFModel":
    """A randomly initialized `transformers` model of ``task`` from config ``spec`` (see read_config),
    with ``overrides`` set on the config (e.g. ``vocab_size=256``), wrapped as an ``HFModel``: fp32
    whatever the config's ``dtype``, and never with remote code (``trust_remote_code=False``).

    Raises ValueError naming the model type and task when transformers has no such model.
    """
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    try:
        import transformers
    except ImportError as e:
        raise ImportError("--hf-config needs the `transformers` package (pip install transformers)") from e
    cfg = read_config(spec)  # the config's own values, checked before overrides can hide one
    try:
        config = hf_config.checked({**cfg, **overrides}, hf_config.where(spec))
    except ValueError as e:
        raise ValueError(f"--hf-config: {e}") from None
    if task == "causal-lm":
        config.use_cache = False  # training: no key/value cache in the outputs
    auto = transformers.AutoModelForCausalLM if task == "causal-lm" else transformers.AutoModelForMaskedLM
    try:
        model = auto.from_config(config, trust_remote_code=False)
    except ValueError as e:
        raise ValueError(f"--hf-config: transformers {transformers.__version__} has no {task} model for "
                         f"model_type {config.model_type!r} ({str(e).splitlines()[0]})") from e
    return HFModel(model)


class HFModel(nn.Module):
    """A `transformers` LM as ``forward(idx, token_types=None, pad_mask=None) -> logits (B, T, vocab)``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def config(self):
        return self.model.config

    def forward(self, idx, token_types=None, pad_mask=None):
        kwargs = {} if token_types is None else dict(token_type_ids=token_types)
        return self.model(input_ids=idx, attention_mask=pad_mask, **kwargs).logits

    def layer_classes(self) -> tuple[type, ...]:
        """The classes of the model's repeated blocks (transformers' ``_no_split_modules``, e.g.
        GPT2Block): the units for ZeRO-3 and offload (``zf.units.by_class(*model.layer_classes())``)."""
        wanted = set(getattr(self.model, "_no_split_modules", None) or ())
        found = {type(m) for m in self.model.modules() if type(m).__name__ in wanted}
        return tuple(sorted(found, key=lambda c: c.__name__))


@contextmanager
def params_on_meta():
    """Parameters made inside go to the meta device as they are registered (one at a time on the CPU
    first: the largest param is the peak); buffers stay where they are made, as accelerate's
    ``init_empty_weights(include_buffers=False)``: a model's computed buffers keep their values."""
    register = nn.Module.register_parameter

    def to_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def built(args, vocab_size: int, task: str):
    """``--hf-config`` for a recipe: the model (built under the caller's device context: the meta
    device) as a ``recipes.recipe.Built``, its vocabulary widened to ``vocab_size`` when the config's is
    smaller (the data's ids must fit), initialized by the model's own ``_init_weights`` per submodule
    (``zf.materialize.from_module``), its units transformers' repeated blocks."""
    import zfunc as zf

    cfg = read_config(args.hf_config)  # checked: a vocab_size given is an int >= 1
    overrides = {} if cfg.get("vocab_size", 0) >= vocab_size else {"vocab_size": vocab_size}
    with torch.device("cpu"), params_on_meta():  # buffers (rotary inv_freq, position ids) stay real
        model = build(cfg, task, **overrides)
    config = model.config
    context = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions", "n_ctx")
                    if isinstance(getattr(config, k, None), int)), 1 << 30)
    units = "class:" + ",".join(c.__name__ for c in model.layer_classes()) if model.layer_classes() else None
    n = recipe.n_params(model)
    init = model.model._init_weights
    return recipe.Built(model, {**cfg, **overrides}, context,
                        materialize=lambda seed: zf.materialize.from_module(model, seed, init=init),
                        units=units, flops_per_token=6 * n)
