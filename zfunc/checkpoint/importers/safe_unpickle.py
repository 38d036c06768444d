"""Read the pickles of another tool's checkpoint without running any of its code.

**Law.** A pickle read here becomes only:

- what pickle builds by itself: None, bools, numbers, strings, bytes, tuples, lists, dicts, sets;
- the objects an ``Allowlist`` names, each by its exact ``"module.name"``;
- inert stand-ins (``Opaque``) for the classes of the packages an allowlist names as such
  (DeepSpeed's enums, its loss scaler): an instance keeps the arguments and state the pickle
  gave it and runs no code, so the package need not be installed and none of it is imported.

Any other global -- ``posix.system``, ``builtins.exec`` or ``getattr``, ``torch.serialization.os``,
``torch.load``, anything of numpy's or copyreg's, a dotted name under an allowed class -- is refused
when the opcode naming it is read, before anything can call it: ``Refused`` (an
``UnpicklingError``) names it. Every object the pickle can call is then an allowlisted one, or a
method of an object built from them (a dict's ``__setitem__``, a dataclass's ``__setstate__``),
and each of those does no I/O, imports nothing and calls nothing but what the pickle built: the
only code that runs is Python's, torch's and zfunc's own.

The allowlists hold what the formats need and no more:

- ``TENSORS``: dense tensors as ``torch.save`` writes them, the part of torch's own
  ``weights_only`` allowlist (``torch/_weights_only_unpickler.py``) they use: ``torch._utils``'s
  ``_rebuild_tensor(_v2, _v3)`` and ``_rebuild_parameter(_with_state)``,
  ``torch._tensor._rebuild_from_type_v2``, ``torch.Tensor``, ``Parameter``, ``torch.Size``,
  ``torch.device``, the dtypes, ``torch.serialization._get_layout``, ``OrderedDict``, ``set``,
  ``frozenset``, ``bytearray``, ``bytes``, ``complex``, and ``_codecs.encode`` for protocol 2's
  ``bytes`` (only its ``"latin1"``: another codec's lookup may import a module). Storages are
  torch's own (``torch.load`` gives a ``StorageType`` for every ``*Storage`` name).
- ``DEEPSPEED``: ``TENSORS``, stand-ins for ``deepspeed.*``, and stand-ins for exactly the
  objects Megatron-DeepSpeed keeps in a checkpoint's client state (``CLIENT_STATE``: its
  ``argparse.Namespace`` of args, numpy's RNG state as arrays and dtypes).
- ``dcp_metadata()``: a ``torch.distributed.checkpoint`` ``.metadata``: DCP's metadata
  dataclasses (``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``,
  ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``, the filesystem's ``_StorageInfo``;
  also under the names older torch wrote), dtypes, ``torch.Size``, ``_get_layout``, and
  ``pathlib``'s concrete paths read as pure ones (no I/O).

It is CPython's own unpickler with ``find_class`` overridden (the "Restricting Globals" recipe of
the ``pickle`` docs), passed to ``torch.load`` as its ``pickle_module`` so that ``mmap=True``
still holds. Not torch's ``weights_only=True`` with ``safe_globals``: that unpickler reads
protocol 2 only (a DCP ``.metadata`` is protocol 4), takes no package prefix for stand-ins, and
its allowlist is process-wide, so an ``add_safe_globals`` elsewhere in the process would widen
what a foreign checkpoint may hold.

Not covered: a pickle built to be slow or huge (it can exhaust memory, as any file can), and
values that are wrong (the readers check shapes and sizes against each other).

Cost: the C unpickler's, plus one dict lookup per global the pickle names.
"""
from __future__ import annotations

import _compat_pickle
import functools
import io
import pathlib
import pickle
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Mapping

import torch


class Refused(pickle.UnpicklingError):
    """A pickle names a global its allowlist does not hold; ``name`` is the global."""

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        super().__init__(f"refuses to load global {name!r}: {why}")


class Opaque:
    """An object of a class of a package the reader does not import (a DeepSpeed enum, its loss
    scaler): it keeps what the pickle gave it and runs no code. ``value`` is an enum's value."""

    _name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __reduce__(self):
        raise TypeError(f"{self._name}: a stand-in for a class the checkpoint reader did not import")

    @property
    def value(self) -> Any:
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<{self._name} {self.args}>"


@functools.lru_cache(maxsize=256)
def stand_in(module: str, name: str) -> type:
    """The ``Opaque`` class standing in for ``module.name`` (one per name)."""
    return type(name.rpartition(".")[2], (Opaque,), {"_name": f"{module}.{name}", "__module__": __name__})


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity (``unpickler``'s cache)
class Allowlist:
    """What a kind of file may hold: ``what`` it is and what it ``holds`` (for errors), the
    ``globals`` by exact name, and the packages whose classes are read as ``Opaque`` stand-ins."""

    what: str
    holds: str
    globals: Mapping[str, Any]
    stand_ins: tuple[str, ...] = field(default=())

    def find(self, module: str, name: str) -> Any:
        """The object ``module.name`` stands for here, else ``Refused``."""
        if (module, name) in _compat_pickle.NAME_MAPPING:  # protocol 2's Python 2 names (__builtin__.set)
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        if full in self.globals:
            return self.globals[full]
        if any(module == p or module.startswith(p + ".") for p in self.stand_ins):
            return stand_in(module, name)
        raise Refused(full, f"{self.what} may hold only {self.holds}; none of its code runs")


class _Unpickler(pickle.Unpickler):
    allowlist: Allowlist  # set by ``unpickler``

    def find_class(self, module: str, name: str) -> Any:
        return self.allowlist.find(module, name)


@functools.lru_cache(maxsize=None)
def unpickler(allowlist: Allowlist) -> type[pickle.Unpickler]:
    """A ``pickle.Unpickler`` class reading with ``allowlist`` (no ``persistent_load``: give one)."""
    return type("SafeUnpickler", (_Unpickler,), {"allowlist": allowlist})


def pickle_module(allowlist: Allowlist) -> Any:
    """``torch.load``'s ``pickle_module`` reading with ``allowlist`` (torch subclasses its
    ``Unpickler`` and calls ``find_class``; ``weights_only=False`` is then what lets it)."""
    cls = unpickler(allowlist)
    return types.SimpleNamespace(__name__=f"{__name__}.{allowlist.what}", Unpickler=cls,
                                 UnpicklingError=pickle.UnpicklingError,
                                 load=lambda f, **kw: cls(f, **kw).load())


def load(file: BinaryIO, allowlist: Allowlist) -> Any:
    """The object pickled in ``file``; ``Refused`` for a global ``allowlist`` does not hold."""
    return unpickler(allowlist)(file).load()


def loads(data: bytes, allowlist: Allowlist) -> Any:
    return load(io.BytesIO(data), allowlist)


# ----------------------------------------------------------------------------- the allowlists


def _latin1(text: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as protocol 2 writes ``bytes``: ``encode(text, "latin1")``, nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise Refused("_codecs.encode", f"called with encoding {encoding!r}; only protocol 2's bytes "
                                        "(encoding 'latin1') are read")
    return text.encode("latin1")


def _dtypes() -> dict[str, torch.dtype]:
    return {str(t): t for t in vars(torch).values() if isinstance(t, torch.dtype)}


def _tensor_globals() -> dict[str, Any]:
    out: dict[str, Any] = {
        "collections.OrderedDict": OrderedDict,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.bytearray": bytearray,
        "builtins.bytes": bytes, "builtins.complex": complex, "_codecs.encode": _latin1,
        "torch.Size": torch.Size, "torch.Tensor": torch.Tensor, "torch.device": torch.device,
        "torch.nn.parameter.Parameter": torch.nn.Parameter,
        "torch.serialization._get_layout": torch.serialization._get_layout,
        "torch._tensor._rebuild_from_type_v2": torch._tensor._rebuild_from_type_v2,
    }
    for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                 "_rebuild_parameter_with_state"):
        if hasattr(torch._utils, name):
            out[f"torch._utils.{name}"] = getattr(torch._utils, name)
    return {**out, **_dtypes()}


# Megatron-DeepSpeed's client state: ``args`` (a Namespace) and ``np.random.get_state()`` (an array,
# rebuilt through numpy's ``_reconstruct``, ``ndarray`` and ``dtype``; ``numpy._core`` from numpy 2 on).
CLIENT_STATE = ("argparse.Namespace",
                *(f"numpy.{core}.multiarray.{n}" for core in ("core", "_core") for n in ("_reconstruct", "scalar")),
                "numpy.ndarray", "numpy.dtype")


def _stand_ins(names: tuple[str, ...]) -> dict[str, type]:
    return {full: stand_in(*full.rsplit(".", 1)) for full in names}


TENSORS = Allowlist("a torch file", "tensors and containers", types.MappingProxyType(_tensor_globals()))
DEEPSPEED = Allowlist("a DeepSpeed checkpoint file",
                      "tensors, containers, DeepSpeed's own classes and Megatron-DeepSpeed's client state "
                      "(read as inert stand-ins)",
                      types.MappingProxyType({**TENSORS.globals, **_stand_ins(CLIENT_STATE)}), ("deepspeed",))


@functools.lru_cache(maxsize=None)
def dcp_metadata() -> Allowlist:
    """A DCP ``.metadata`` file's allowlist (imports ``torch.distributed.checkpoint``)."""
    from torch.distributed.checkpoint import filesystem, metadata

    dcp = "torch.distributed.checkpoint.metadata."
    names = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
             "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")
    out: dict[str, Any] = {dcp + n: getattr(metadata, n) for n in names if hasattr(metadata, n)}
    older = "torch.distributed._shard.sharded_tensor.metadata."  # where torch < 2.3 pickled these two
    out.update({older + "TensorProperties": metadata.TensorProperties,
                older + "MEM_FORMAT_ENCODING": metadata._MEM_FORMAT_ENCODING,
                "torch.distributed.checkpoint.filesystem._StorageInfo": filesystem._StorageInfo,
                "collections.OrderedDict": OrderedDict, "torch.Size": torch.Size,
                "torch.serialization._get_layout": torch.serialization._get_layout})
    for module in ("pathlib", "pathlib._local"):  # StorageMeta.checkpoint_id, unused: a path, read as text
        out.update({f"{module}.PosixPath": pathlib.PurePosixPath, f"{module}.PurePosixPath": pathlib.PurePosixPath,
                    f"{module}.WindowsPath": pathlib.PureWindowsPath,
                    f"{module}.PureWindowsPath": pathlib.PureWindowsPath})
    return Allowlist("a torch.distributed.checkpoint .metadata file", "DCP's metadata classes, dtypes and sizes",
                     types.MappingProxyType({**out, **_dtypes()}))
