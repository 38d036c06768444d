"""Loading someone else's checkpoint never runs their code: every pickle in a DeepSpeed or DCP
checkpoint is read by ``zfunc.checkpoint.importers.safe_unpickle``, which refuses any global outside its
allowlist, naming the file and the global, before anything calls it.

Each payload below is a working checkpoint with a few opcodes put in front of its pickle that
would create a marker file (``os.system``, ``exec``, a ``getattr`` chain to ``os`` through
``torch.serialization``, numpy's ``runstring``); the test checks the marker never appears and the
``CheckpointError`` names the refused global, for every file kind and every public load path.
"""
import pickle
import re
import shutil
import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import zfunc as zf
from fixtures.make_deepspeed_checkpoints import model
from tests.models import fixtures_step as make  # the fixtures' model and AdamW, a plain step
from zfunc.checkpoint import CheckpointError
from zfunc.checkpoint.importers import load_foreign

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"


# ----------------------------------------------------------------------------- payloads, as opcodes


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


TUPLE1, TUPLE2, REDUCE, MARK, EMPTY_DICT = b"\x85", b"\x86", b"R", b"(", b"}"


def shell(marker: Path) -> str:
    return f"touch {marker}"


def python(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


# name -> (opcodes making the marker, the global refused); protocol 4 lets GLOBAL take a dotted name
PAYLOADS = {
    "os.system through torch.serialization": (
        lambda m: b"\x80\x04" + glob("torch.serialization", "os.system") + text(shell(m)) + TUPLE1 + REDUCE,
        "torch.serialization.os.system"),
    "getattr chain": (
        lambda m: glob("builtins", "getattr") + glob("torch.serialization", "os") + text("system") + TUPLE2 + REDUCE
        + text(shell(m)) + TUPLE1 + REDUCE, "builtins.getattr"),
    "posix.system": (lambda m: glob("posix", "system") + text(shell(m)) + TUPLE1 + REDUCE, "posix.system"),
    "builtins.exec": (lambda m: glob("builtins", "exec") + text(python(m)) + TUPLE1 + REDUCE, "builtins.exec"),
    "python 2's __builtin__.eval": (lambda m: glob("__builtin__", "eval") + text(python(m)) + TUPLE1 + REDUCE,
                                    "builtins.eval"),
    "INST opcode": (lambda m: MARK + text(shell(m)) + b"i" + b"posix\nsystem\n", "posix.system"),
    "numpy runstring": (lambda m: glob("numpy.testing._private.utils", "runstring") + text(python(m)) + EMPTY_DICT
                        + TUPLE2 + REDUCE, "numpy.testing._private.utils.runstring"),
    "copyreg": (lambda m: glob("copyreg", "_reconstructor") + glob("torch", "Tensor") + glob("torch", "Tensor")
                + b"N" + b"\x87" + REDUCE, "copyreg._reconstructor"),
    "dotted name under an allowed class": (
        lambda m: b"\x80\x04" + glob("collections", "OrderedDict.__class__") + b")" + REDUCE,
        "collections.OrderedDict.__class__"),
}


def with_payload(pickled: bytes, payload: bytes) -> bytes:
    """``pickled`` with ``payload`` run (and its result dropped) before it: the checkpoint still loads."""
    return b"\x80\x02" + payload + b"0" + pickled


def inject_pt(path: Path, payload: bytes) -> None:
    """Put ``payload`` in front of the pickle of the torch zip file ``path``, keeping its tensors."""
    with zipfile.ZipFile(path) as z:
        records = {n: z.read(n) for n in z.namelist()}
    prefix = next(iter(records)).split("/")[0] + "/"
    writer = torch._C.PyTorchFileWriter(str(path))
    for name, data in records.items():
        record = name[len(prefix):]
        if record == "data.pkl":
            data = with_payload(data, payload)
        if record not in ("version", ".data/serialization_id"):  # the writer adds these itself
            writer.write_record(record, data, len(data))
    writer.write_end_of_file()


def refused(e: pytest.ExceptionInfo, where: str, name: str) -> bool:
    return where in str(e.value) and f"global {name!r}" in str(e.value)


# ----------------------------------------------------------------------------- DeepSpeed


def deepspeed_copy(tmp_path: Path, stage: int, file: str, payload: bytes) -> Path:
    root = tmp_path / f"zero{stage}"
    shutil.copytree(FIXTURES / f"zero{stage}", root)
    inject_pt(root / "global_step3" / file, payload)
    return root


def test_a_payload_is_a_working_checkpoint(tmp_path):
    """The test's own check: a harmless payload in front of the pickle leaves a loadable checkpoint."""
    root = deepspeed_copy(tmp_path, 1, "zero_pp_rank_0_mp_rank_00_optim_states.pt", text("harmless"))
    step, params = make()
    assert zf.checkpoint.load_deepspeed(root, step, params=params).step == 3


@pytest.mark.parametrize("kind", list(PAYLOADS))
def test_deepspeed_payloads_are_refused(tmp_path, kind):
    make_payload, name = PAYLOADS[kind]
    marker = tmp_path / "pwned"
    root = deepspeed_copy(tmp_path, 1, "zero_pp_rank_0_mp_rank_00_optim_states.pt", make_payload(marker))
    step, params = make()
    with pytest.raises(CheckpointError) as e:
        zf.checkpoint.load_deepspeed(root, step, params=params)
    assert not marker.exists()
    assert refused(e, "zero_pp_rank_0_mp_rank_00_optim_states.pt", name), str(e.value)


def _load(root, step, params):
    return zf.checkpoint.load(root, step, params=params)


def _load_deepspeed(root, step, params):
    return zf.checkpoint.load_deepspeed(root, step, params=params)


def _load_foreign(root, step, params):
    return load_foreign(root, step, params=params)


def _deepspeed_config(root, step, params):
    return zf.checkpoint.deepspeed_config(root)


# (stage, file): optim states of stage 1 (rank 1), stages 1/2's one model states file, stage 3's per-rank
# model states (rank 0's is read), stage 3's optim states of rank 1 (read when rows are)
FILES = [(1, "zero_pp_rank_1_mp_rank_00_optim_states.pt"), (2, "mp_rank_00_model_states.pt"),
         (3, "zero_pp_rank_0_mp_rank_00_model_states.pt"), (3, "zero_pp_rank_1_mp_rank_00_optim_states.pt")]
PATHS = {"load": _load, "load_deepspeed": _load_deepspeed, "load_foreign": _load_foreign,
         "deepspeed_config": _deepspeed_config}


@pytest.mark.parametrize("stage,file", FILES)
@pytest.mark.parametrize("path", list(PATHS))
def test_every_deepspeed_file_through_every_load_path(tmp_path, stage, file, path):
    if path == "deepspeed_config" and stage == 3 and "optim" in file:
        pytest.skip("deepspeed_config reads no stage-3 optimizer rows")
    marker = tmp_path / "pwned"
    make_payload, name = PAYLOADS["getattr chain"]
    root = deepspeed_copy(tmp_path, stage, file, make_payload(marker))
    step, params = make()
    with pytest.raises(CheckpointError) as e:
        PATHS[path](root, step, params)
    assert not marker.exists()
    assert refused(e, file, name), str(e.value)


@pytest.mark.parametrize("named", ["../elsewhere/global_step3", "/tmp", "global_step3/..", "\udcff"])
def test_deepspeed_latest_naming_a_directory_elsewhere_is_refused(tmp_path, named):
    """``latest`` names a tag: a directory beside it, not one reached through ``..`` or from ``/``."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "zero1", tmp_path / "elsewhere")
    root.mkdir()
    (root / "latest").write_bytes(named.encode("utf-8", "surrogateescape"))
    step, params = make()
    with pytest.raises(CheckpointError, match=r"latest names .*expected the name of a directory in"):
        zf.checkpoint.load_deepspeed(root, step, params=params)


# ----------------------------------------------------------------------------- DCP


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory) -> Path:
    """The fixtures' model, saved alone with ``dcp.save`` in this process."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("dcp") / "weights"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "single process" warning of no_dist
        dcp.save(dict(model().state_dict()), checkpoint_id=str(path), no_dist=True)
    return path


def dcp_copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "dcp"
    shutil.copytree(src, dst)
    return dst


def load_dcp_weights(path: Path, how: str):
    step, params = make()
    if how == "load_dcp":
        return zf.checkpoint.load_dcp(path, step, params=params, model_key=None, optimizer=False)
    return (zf.checkpoint.load if how == "load" else load_foreign)(path, step, params=params)


def test_dcp_loads_from_a_copy(dcp_checkpoint, tmp_path):
    state = load_dcp_weights(dcp_copy(dcp_checkpoint, tmp_path), "load_dcp")
    assert torch.equal(state.params["emb.weight"], model().emb.weight)


@pytest.mark.parametrize("kind", ["posix.system", "getattr chain", "numpy runstring"])
@pytest.mark.parametrize("how", ["load", "load_dcp", "load_foreign"])
def test_dcp_metadata_payloads_are_refused(dcp_checkpoint, tmp_path, kind, how):
    make_payload, name = PAYLOADS[kind]
    marker = tmp_path / "pwned"
    path = dcp_copy(dcp_checkpoint, tmp_path)
    meta = path / ".metadata"
    meta.write_bytes(with_payload(meta.read_bytes(), make_payload(marker)))
    with pytest.raises(CheckpointError) as e:
        load_dcp_weights(path, how)
    assert not marker.exists()
    assert refused(e, ".metadata", name), str(e.value)


def _rewrite_metadata(path: Path, change) -> None:
    meta = path / ".metadata"
    metadata = pickle.loads(meta.read_bytes())  # the test's own file: trusted
    change(metadata)
    meta.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/hostname", "sub/../../outside.distcp"])
def test_dcp_storage_outside_the_checkpoint_is_refused(dcp_checkpoint, tmp_path, where):
    """A ``.metadata`` naming a file outside the checkpoint's directory is not followed."""
    path = dcp_copy(dcp_checkpoint, tmp_path)
    (tmp_path / "outside.distcp").write_bytes((path / "__0_0.distcp").read_bytes())

    def elsewhere(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = where

    _rewrite_metadata(path, elsewhere)
    with pytest.raises(CheckpointError, match=r"\.metadata: .*" + re.escape(where)):
        load_dcp_weights(path, "load_dcp")


def test_dcp_chunk_payload_is_refused(dcp_checkpoint, tmp_path):
    """A tensor's chunk holding a pickle payload: refused (torch's weights_only unpickler reads the
    chunks), as a ``CheckpointError`` naming the tensor."""
    path = dcp_copy(dcp_checkpoint, tmp_path)
    marker = tmp_path / "pwned"
    evil = path / "__0_1.distcp"
    payload = glob("posix", "system") + text(shell(marker)) + TUPLE1 + REDUCE
    torch.save(torch.zeros(12, 5), evil)
    inject_pt(evil, payload)

    def point_at_evil(metadata):
        for index, info in metadata.storage_data.items():
            if index.fqn == "emb.weight":
                info.relative_path, info.offset, info.length = evil.name, 0, evil.stat().st_size

    _rewrite_metadata(path, point_at_evil)
    with pytest.raises(CheckpointError, match="emb.weight"):
        load_dcp_weights(path, "load_dcp")
    assert not marker.exists()


# ----------------------------------------------------------------------------- the unpickler itself


def test_deepspeed_classes_are_inert_stand_ins_and_look_alikes_are_refused():
    from zfunc.checkpoint.importers import safe_unpickle as su

    ran = glob("deepspeed.runtime.zero.config", "ZeroStageEnum") + b"K\x02" + TUPLE1 + REDUCE + b"."
    stand_in = su.loads(b"\x80\x02" + ran, su.DEEPSPEED)
    assert isinstance(stand_in, su.Opaque) and stand_in.value == 2
    with pytest.raises(su.Refused, match="'deepspeedx.evil.f'"):
        su.loads(b"\x80\x02" + glob("deepspeedx.evil", "f") + b")" + REDUCE + b".", su.DEEPSPEED)
    with pytest.raises(su.Refused, match="'_codecs.encode'.*latin1"):  # only protocol 2's bytes: no codec lookup
        su.loads(b"\x80\x02" + glob("_codecs", "encode") + text("x") + text("rot13") + TUPLE2 + REDUCE + b".",
                 su.DEEPSPEED)


def test_megatron_deepspeed_client_state_loads_as_stand_ins(tmp_path):
    """Megatron-DeepSpeed saves its args (a Namespace) and numpy's RNG state beside the weights."""
    import argparse

    import numpy as np

    from zfunc.checkpoint.importers import deepspeed_zero

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "args": argparse.Namespace(hidden_size=8),
                "np_rng_state": np.random.RandomState(0).get_state()}, path)
    sd = deepspeed_zero.torch_load(path)
    assert torch.equal(sd["module"]["w"], torch.ones(2))
    assert type(sd["args"]).__name__ == "Namespace" and sd["args"].state == {"hidden_size": 8}
    assert sd["np_rng_state"][0] == "MT19937"


# ----------------------------------------------------------------------------- zfunc's own checkpoints


def test_zfunc_checkpoints_hold_no_pickle(tmp_path, monkeypatch):
    """zfunc's checkpoints are JSON and safetensors: a load unpickles nothing."""
    step, params = make()
    state = step.init(params)
    zf.checkpoint.save(state, tmp_path / "000003")

    def no_pickle(*args, **kwargs):
        raise AssertionError("a zfunc checkpoint load unpickled something")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, no_pickle)
    monkeypatch.setattr(torch, "load", no_pickle)
    assert sorted(p.name for p in (tmp_path / "000003").iterdir()) == ["manifest.json", "rank00000.safetensors"]
    assert zf.checkpoint.load(tmp_path / "000003", step, params=params).step == 0
