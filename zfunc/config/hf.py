"""A transformers model config from someone else's file: read within bounds, every value checked,
and nothing in it able to run code.

``read(spec)`` gives the config as a dict: ``spec`` is a dict, a JSON object string, a config.json
path, or a folder holding one (``zfunc.config.json_file``'s bounds: nesting, size, duplicate keys, NaN).
``checked(cfg, where)`` gives the ``transformers`` config it makes, each value checked:
- Type and range, for the keys in the table below; type alone for every other key the model
  type's own config has: the type of that config's default (a bool default takes a bool, an int
  default an int and never a bool, a float default a number, a str default a str). A key that
  names a method of the config class (``to_dict``) is refused.
- The table goes by the standard attribute names every model type maps its keys to (gpt2's ``n_layer`` is
  ``num_hidden_layers``), so one table serves gpt2, llama, mistral, bert and the rest: layers,
  heads, hidden size, vocabulary >= 1; positions, intermediate size, kv heads, head dim >= 1 where
  the model has them; dropouts in [0, 1]; epsilons and rope theta > 0; the activation one
  transformers has; token ids >= 0, the padding id inside the vocabulary.
- Together, with transformers' defaults for the keys left out: the heads divide the hidden size
  (unless the config gives ``head_dim``), the kv heads divide the heads.
Errors are ``ValueError("<key>: expected ..., got <value> (<where>)")``, the key as the config
spells it (``n_layer`` for gpt2), "(the default)" where the value is transformers' own.

Nothing here runs code from the config, wherever in it the key stands: ``auto_map`` (transformers'
pointer to a model's own Python, run under ``trust_remote_code``) and a true
``trust_remote_code`` are refused, as are attention or experts implementations other than
transformers' built-in ones (a name such as ``kernels-community/flash-attn`` fetches a kernel from
the Hub and runs it). Callers build with ``trust_remote_code=False``. ``dtype``/``torch_dtype``
must name a float type and are left out of the config: the trainer's precision decides, and the
model is built in fp32. Cost: one JSON parse, one default config of the model type, one config.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zfunc.config import json_file

REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code")
LOCAL_IMPLEMENTATIONS = {"attn_implementation": (None, "eager", "sdpa", "flex_attention"),
                         "experts_implementation": (None, "eager", "batched_mm", "grouped_mm")}
DTYPES = (None, "float32", "float16", "bfloat16")
COUNTS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")  # every model has them
OPTIONAL_COUNTS = ("max_position_embeddings", "intermediate_size", "num_key_value_heads", "head_dim", "n_inner",
                   "type_vocab_size", "sliding_window", "num_local_experts", "num_experts_per_tok")
_MISSING = object()


def where(spec: Any) -> str:
    """Where ``spec`` came from, for error messages: "in '<file>'", "in the JSON string ..."."""
    if isinstance(spec, dict):
        return "in the config dict"
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        return f"in the JSON string {spec[:60] + ('...' if len(spec) > 60 else '')!r}"
    path = Path(spec)
    return f"in {str(path / 'config.json' if path.is_dir() else path)!r}"


def read(spec: str | os.PathLike | dict) -> dict[str, Any]:
    """The config as a dict (see the module docstring), its remote-code keys refused. Raises
    FileNotFoundError / ValueError saying what was given and what was expected."""
    if isinstance(spec, dict):
        json_file.check_depth(spec)
        cfg = dict(spec)
    elif isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            cfg = json_file.parse(spec)
        except ValueError as e:
            raise ValueError(f"{e} ({where(spec)})") from None
    else:
        p = Path(spec)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"expected a config.json path, a folder holding one, or a JSON object string, "
                                    f"got {str(spec)!r} (no such file: {str(p)!r})")
        try:
            cfg = json_file.read(p)
        except ValueError as e:
            raise ValueError(f"{e} ({where(spec)})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"expected a JSON object, got a {type(cfg).__name__} ({where(spec)})")
    if "model_type" not in cfg:
        raise ValueError(f"the config has no \"model_type\" (such as \"gpt2\", \"llama\", \"bert\"); keys given: "
                         f"{sorted(cfg)} ({where(spec)})")
    refuse_code(cfg, where(spec))
    return cfg


def refuse_code(cfg: dict, at: str) -> None:
    """Raise ValueError for anything in ``cfg`` (sub-configs included) that would run code it names."""
    stack = [("", cfg)]
    while stack:
        prefix, section = stack.pop()
        for key, value in section.items():
            key = str(key)
            path = f"{prefix}{key}"
            if key in REMOTE_CODE_KEYS and value not in (None, False, {}):
                raise ValueError(f"{path}: a config from a file never runs code; {key} points transformers at a "
                                 f"model's own Python, refused (remove it and use a model_type transformers has), "
                                 f"got {value!r} ({at})")
            name = key.lstrip("_").removesuffix("_internal")
            if name in LOCAL_IMPLEMENTATIONS and value not in LOCAL_IMPLEMENTATIONS[name]:
                raise ValueError(f"{path}: expected one of transformers' built-in implementations "
                                 f"{list(LOCAL_IMPLEMENTATIONS[name])} (another name may fetch and run a kernel "
                                 f"from the Hub), got {value!r} ({at})")
            if isinstance(value, dict):
                stack.append((f"{path}.", value))


# ----------------------------------------------------------------------------- value rules


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_id(value: Any) -> bool:
    ids = value if isinstance(value, list) else [value]
    return all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)


def _rule(name: str) -> tuple[Callable[[Any], bool], str] | None:
    """(ok, what is expected) for the standard attribute ``name``, None where nothing is known."""
    if name in COUNTS or name in OPTIONAL_COUNTS:
        return _count, "an int >= 1"
    if name.endswith(("dropout", "pdrop", "dropout_prob", "dropout_rate")):
        return (lambda v: _number(v) and 0 <= v <= 1), "a number in [0, 1]"
    if name.endswith(("_eps", "epsilon")) or name == "rope_theta":
        return (lambda v: _number(v) and v > 0), "a number > 0"
    if name in ("initializer_range", "initializer_factor"):
        return (lambda v: _number(v) and v >= 0), "a number >= 0"
    if name in ("hidden_act", "activation_function"):
        from transformers.activations import ACT2FN

        return (lambda v: isinstance(v, str) and v in ACT2FN), f"one of transformers' activations {sorted(ACT2FN)}"
    if name.endswith("_token_id"):
        return _token_id, "an int >= 0 (or a list of them)"
    if name in ("dtype", "torch_dtype"):
        return (lambda v: v in DTYPES), f"one of {list(DTYPES)}"
    return None


def _type_rule(default: Any) -> tuple[Callable[[Any], bool], str] | None:
    """The type a key takes, from its default in the model type's config (None: no default to go by)."""
    if isinstance(default, bool):
        return (lambda v: isinstance(v, bool)), "true or false"
    if isinstance(default, int):
        return (lambda v: isinstance(v, int) and not isinstance(v, bool)), "an int"
    if isinstance(default, float):
        return _number, "a number"
    if isinstance(default, str):
        return (lambda v: isinstance(v, str)), "a string"
    return None


def _check(key: str, value: Any, rule, at: str, required: bool = False) -> None:
    """``rule`` holds for ``value`` (None passes, unless ``required``)."""
    if rule is not None and (value is not None or required) and not rule[0](value):
        raise ValueError(f"{key}: expected {rule[1]}, got {value!r} ({at})")


def checked(cfg: dict[str, Any], at: str = "in the config dict"):
    """The ``transformers`` config ``cfg`` makes, every value checked (module docstring); ``at`` says
    where ``cfg`` came from, for the errors. Raises ValueError; ImportError without transformers."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("a transformers config needs the `transformers` package (pip install transformers)") from e
    refuse_code(cfg, at)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"model_type: transformers {transformers.__version__} knows no model_type {model_type!r} "
                         f"({at})")
    config_class = transformers.CONFIG_MAPPING[model_type]
    try:
        defaults = config_class()
    except Exception:  # a config class that needs arguments: no defaults to take types from
        defaults = None
    standard = {alias: name for name, alias in config_class.attribute_map.items()}  # n_layer -> num_hidden_layers
    kwargs = {}
    for key, value in cfg.items():
        if key in ("model_type", "architectures"):  # the task decides the head here
            continue
        if key.startswith("__") or callable(getattr(config_class, key, None)):
            raise ValueError(f"{key}: names an attribute of {config_class.__name__} itself, not a setting; got "
                             f"{value!r} ({at})")
        default = getattr(defaults, key, _MISSING)
        name = standard.get(key, key)
        rule = _rule(name)  # a named rule says what the key takes; else its default's type does
        _check(key, value, rule or _type_rule(default), at, required=name in COUNTS)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # JSON's 1 for a float setting; transformers' strict configs want 1.0
        if key not in ("dtype", "torch_dtype"):  # the trainer's precision decides; built in fp32
            kwargs[key] = value
    # what the config gives, before transformers' own checks can answer first; then all, defaults included
    _check_together(lambda name: _given(name, cfg, config_class.attribute_map), cfg, config_class.attribute_map, at,
                    complete=False)
    try:
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
    except Exception as e:  # transformers' own checks raise ValueError, TypeError or its validation errors
        raise ValueError(f"transformers {transformers.__version__} refuses the {model_type} config: "
                         f"{' '.join(str(e).split())} ({at})") from None
    _check_together(lambda name: getattr(config, name, None), cfg, config_class.attribute_map, at, complete=True)
    return config


def _given(name: str, cfg: dict, attribute_map: dict[str, str]) -> Any:
    """Standard attribute ``name`` as ``cfg`` gives it (by its own key or the standard one), else None."""
    for key in (attribute_map.get(name, name), name):
        if key in cfg:
            return cfg[key]
    return None


def _check_together(value: Callable[[str], Any], cfg: dict, attribute_map: dict[str, str], at: str,
                    complete: bool) -> None:
    """The standard attributes (``value(name)``, None where unknown) each in range and fitting
    together; ``complete``: every model has the COUNTS, so None there is an error."""
    def key_of(name: str) -> str:
        key = attribute_map.get(name, name)
        return key if key in cfg or name in cfg else f"{key} (the default)"

    for name in COUNTS + OPTIONAL_COUNTS:
        _check(key_of(name), value(name), (_count, "an int >= 1"), at, required=complete and name in COUNTS)
    heads, hidden, kv = value("num_attention_heads"), value("hidden_size"), value("num_key_value_heads")
    if "head_dim" not in cfg and None not in (hidden, heads) and hidden % heads:
        raise ValueError(f"{key_of('hidden_size')}, {key_of('num_attention_heads')}: expected heads that divide the "
                         f"hidden size (or an explicit head_dim), got {hidden} and {heads} ({at})")
    if None not in (heads, kv) and heads % kv:
        raise ValueError(f"{key_of('num_key_value_heads')}: expected a divisor of {key_of('num_attention_heads')} = "
                         f"{heads} (each kv head serves a whole group of heads), got {kv} ({at})")
    pad, vocab = value("pad_token_id"), value("vocab_size")
    if isinstance(pad, int) and isinstance(vocab, int) and not pad < vocab:
        raise ValueError(f"{key_of('pad_token_id')}: expected an id inside the vocabulary, below "
                         f"{key_of('vocab_size')} = {vocab}, got {pad} ({at})")
    rope = value("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        _check(f"{key_of('rope_parameters')}.rope_theta", rope["rope_theta"], _rule("rope_theta"), at)
