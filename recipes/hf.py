"""`--hf-config`: any Hugging Face `transformers` causal or masked LM, built from its config alone.

The model is randomly initialized from the config (no weights, no downloads: nothing here touches the
hub), and wrapped so that ``model(idx) -> logits`` like the recipes' own models. `transformers` is an
optional extra: it is imported only inside these functions, when the flag is used.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

TASKS = ("causal-lm", "masked-lm")


def read_config(spec: str | os.PathLike | dict) -> dict[str, Any]:
    """The config as a dict, from a dict, a JSON object string, a config.json path, or a folder holding
    one. Raises ValueError / FileNotFoundError naming --hf-config, what was given and what was expected."""
    if isinstance(spec, dict):
        cfg = dict(spec)
    elif isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            cfg = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--hf-config: the JSON string does not parse ({e}): {spec[:80]!r}") from e
    else:
        p = Path(spec)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"--hf-config: expected a config.json path, a folder holding one, or a JSON "
                                    f"object string, got {str(spec)!r} (no such file: {str(p)!r})")
        try:
            cfg = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--hf-config: {str(p)!r} is not a JSON file ({e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"--hf-config: expected a JSON object, got a {type(cfg).__name__}")
    if "model_type" not in cfg:
        raise ValueError(f"--hf-config: the config has no \"model_type\" (such as \"gpt2\", \"llama\", \"bert\"); "
                         f"keys given: {sorted(cfg)}")
    return cfg


def build(spec: str | os.PathLike | dict, task: str = "causal-lm", **overrides) -> "HFModel":
    """A randomly initialized `transformers` model of ``task`` from config ``spec`` (see read_config),
    with ``overrides`` set on the config (e.g. ``vocab_size=256``), wrapped as an ``HFModel``.

    Raises ValueError naming the model type and task when transformers has no such model.
    """
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    cfg = {**read_config(spec), **overrides}
    try:
        import transformers
    except ImportError as e:
        raise ImportError("--hf-config needs the `transformers` package (pip install transformers)") from e
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)  # the config's own head choice; the task decides here
    try:
        config = transformers.AutoConfig.for_model(model_type, **cfg)
    except ValueError as e:
        raise ValueError(f"--hf-config: transformers {transformers.__version__} knows no model_type "
                         f"{model_type!r} ({e})") from e
    if task == "causal-lm":
        config.use_cache = False  # training: no key/value cache in the outputs
    auto = transformers.AutoModelForCausalLM if task == "causal-lm" else transformers.AutoModelForMaskedLM
    try:
        model = auto.from_config(config)
    except ValueError as e:
        raise ValueError(f"--hf-config: transformers {transformers.__version__} has no {task} model for "
                         f"model_type {model_type!r} ({str(e).splitlines()[0]})") from e
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
    device) as a ``recipes.loop.Built``, its vocabulary widened to ``vocab_size`` when the config's is
    smaller (the data's ids must fit), initialized by the model's own ``_init_weights`` per submodule
    (``zf.materialize.from_module``), its units transformers' repeated blocks."""
    import zfunc as zf
    from recipes import loop

    cfg = read_config(args.hf_config)
    overrides = {} if cfg.get("vocab_size", 0) >= vocab_size else {"vocab_size": vocab_size}
    with torch.device("cpu"), params_on_meta():  # buffers (rotary inv_freq, position ids) stay real
        model = build(cfg, task, **overrides)
    config = model.config
    context = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions", "n_ctx")
                    if isinstance(getattr(config, k, None), int)), 1 << 30)
    units = "class:" + ",".join(c.__name__ for c in model.layer_classes()) if model.layer_classes() else None
    n = loop.n_params(model)
    return loop.Built(model, {**cfg, **overrides}, context,
                      materialize=lambda seed: zf.materialize.from_module(model, seed, init=model.model._init_weights),
                      units=units, flops_per_token=6 * n)
