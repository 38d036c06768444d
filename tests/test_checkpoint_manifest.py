"""A checkpoint from someone else: every manifest field is checked before a tensor file is opened,
a broken or hostile field is refused by name, and nothing outside the checkpoint is read."""
import json
import os
import re
import struct
import sys
import zlib

import pytest
import torch

import zfunc as zf
from zfunc import checkpoint as ck

_opened = None  # the paths opened while recording (sys.audit's "open" event), else None


def _audit(event, args):
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def opened_during(fn):
    """Run ``fn``; return what it raised (or None) and the paths it opened."""
    global _opened
    _opened = []
    try:
        fn()
        raised = None
    except Exception as e:  # noqa: BLE001 -- the test inspects it
        raised = e
    finally:
        paths, _opened = _opened, None
    return raised, paths


def small():
    return zf.TrainState({"w": torch.arange(10.0)}, (), 3, 0, None)


@pytest.fixture
def saved(tmp_path):
    """A valid one-rank checkpoint and its manifest (a dict)."""
    directory = tmp_path / "ckpt" / "000003"
    ck.save(small(), directory)
    return directory, json.loads((directory / "manifest.json").read_text())


def w(manifest):
    return next(e for e in manifest["leaves"] if e["path"] == "params/w")


def edit(**fields):
    def apply(m):
        m.update(fields)
    return apply


def drop(key):
    def apply(m):
        del m[key]
    return apply


def edit_w(**fields):
    def apply(m):
        w(m).update(fields)
    return apply


def edit_piece(**fields):
    def apply(m):
        w(m)["pieces"][0].update(fields)
    return apply


def two_pieces(first, second):
    def apply(m):
        piece = w(m)["pieces"][0]
        w(m)["pieces"] = [{**piece, "rows": first}, {**piece, "rows": second}]
    return apply


SLICED = {"dim": 0, "tp": 2, "padded": 10, "parts": 1}  # w's 10 rows: 5 a slice


def both(*breaks):
    def apply(m):
        for b in breaks:
            b(m)
    return apply


def leaf(entry):
    def apply(m):
        m["leaves"].append(entry)
    return apply


M = r"manifest\.json: "
W = M + r"leaves\[\d+\] \(params/w\)\."
BROKEN = {  # name: (how the manifest is broken, what the error says)
    "missing format": (drop("format"), M + r"format is missing, expected one of \(1, 2, 3\)"),
    "missing world": (drop("world"), M + r"world is missing"),
    "missing step": (drop("step"), M + r"step is missing"),
    "missing files": (drop("files"), M + r"files is missing"),
    "missing leaves": (drop("leaves"), M + r"leaves is missing"),
    "format a str": (edit(format="2"), M + r"format is '2', expected one of"),
    "format 4": (edit(format=4), M + r"format is 4, expected one of"),
    "world a str": (edit(world="1"), M + r"world is '1', expected an int in \[1, 100000\]"),
    "world a bool": (edit(world=True), M + r"world is True, expected an int"),
    "world 0": (edit(world=0), M + r"world is 0, expected an int in \[1, 100000\]"),
    "world huge": (edit(world=10**18), M + r"world is 1000000000000000000, expected an int in"),
    "step negative": (edit(step=-1), M + r"step is -1, expected an int >= 0"),
    "step a float": (edit(step=1.5), M + r"step is 1.5, expected an int >= 0"),
    "pipeline not dividing world": (edit(pipeline=2), M + r"pipeline is 2, expected None or an int >= 1 dividing"),
    "stage 7": (edit(stage=7), M + r"stage is 7, expected None or a ZeRO stage 0-3"),
    "run a number": (edit(run=5), M + r"run is 5, expected a str"),
    "rng a str": (edit(rng="seed"), M + r"rng is 'seed', expected an int"),
    "extra a list": (edit(extra=[1]), M + r"extra is \[1\], expected an object"),
    "files a list": (edit(files=["rank00000.safetensors"]), M + r"files is \['rank00000.safetensors'\], expected an "
                                                                r"object naming the rank files"),
    "files naming a path out": (edit(files={"rank00000.safetensors": 1, "../../etc/passwd": 2}), M + r"files is"),
    "files crc negative": (edit(files={"rank00000.safetensors": -1}),
                           M + r"files\['rank00000.safetensors'\] is -1, expected a crc32"),
    "files crc huge": (edit(files={"rank00000.safetensors": 2**40}), M + r"files\['rank00000.safetensors'\] is"),
    "leaves an object": (edit(leaves={}), M + r"leaves is \{\}, expected a list of leaf entries"),
    "a leaf a str": (leaf("params/x"), M + r"leaves\[\d+\] is 'params/x', expected an object"),
    "a leaf without path": (leaf({"value": 1}), M + r"leaves\[\d+\]\.path is missing"),
    "a leaf named twice": (leaf({"path": "params/w", "value": 1}), M + r"leaves\[\d+\]\.path is 'params/w', "
                                                                      r"expected a str naming a leaf not named before"),
    "a leaf with value and dtype": (leaf({"path": "x", "value": 1, "dtype": "float32"}), r"\(x\)\.value/dtype is"),
    "a value a dict": (leaf({"path": "x", "value": {"a": 1}}), r"\(x\)\.value is \{'a': 1\}, expected None"),
    "dtype naming a torch function": (edit_w(dtype="load"), W + r"dtype is 'load', expected one of \['bfloat16'"),
    "dtype a number": (edit_w(dtype=5), W + r"dtype is 5, expected one of"),
    "shape negative": (edit_w(shape=[-1]), W + r"shape is \[-1\], expected a list of at most 64 ints"),
    "shape huge": (edit_w(shape=[10**30]), W + r"shape is \[1000000000000000000000000000000\], expected"),
    "shape a str": (edit_w(shape="ab"), W + r"shape is 'ab', expected a list"),
    "full_shape huge": (edit_w(full_shape=[2**40, 2**40]), W + r"full_shape is \[1099511627776, 1099511627776\]"),
    "full_shape missing": (edit_w(full_shape=None), W + r"full_shape is None, expected a list"),
    "split_like a number": (edit_w(split_like=5), W + r"split_like is 5, expected None or the str naming a param"),
    "a params leaf unsplit": (edit_w(split_like=None), W + r"split_like is None, expected a str: a params leaf"),
    "chunk negative": (edit_w(chunk=-1), W + r"chunk is -1, expected an int >= 0"),
    "pieces missing": (edit_w(pieces=None), W + r"pieces is None, expected a list of pieces"),
    "a piece a str": (edit_w(pieces=["rank00000.safetensors"]), W + r"pieces\[0\] is 'rank00000.safetensors'"),
    "piece file a path": (edit_piece(file="../../etc/passwd"),
                          W + r"pieces\[0\]\.file is '../../etc/passwd', expected a rank in \[0, 1\)"),
    "piece file absolute": (edit_piece(file="/etc/passwd"), W + r"pieces\[0\]\.file is '/etc/passwd', expected a rank"),
    "piece file negative": (edit_piece(file=-1), W + r"pieces\[0\]\.file is -1, expected a rank in \[0, 1\)"),
    "piece file beyond world": (edit_piece(file=1), W + r"pieces\[0\]\.file is 1, expected a rank in \[0, 1\)"),
    "piece file huge": (edit_piece(file=10**20), W + r"pieces\[0\]\.file is 100000000000000000000, expected a rank"),
    "piece crc a str": (edit_piece(crc="x"), W + r"pieces\[0\]\.crc is 'x', expected a crc32"),
    "piece crc missing": (lambda m: w(m)["pieces"][0].pop("crc"), W + r"pieces\[0\]\.crc is missing"),
    "piece rows huge": (edit_piece(rows=[0, 10**20]), W + r"pieces\[0\]\.rows is \[0, 100000000000000000000\], "
                                                          r"expected \[a, b\] with 0 <= a < b <= 10"),
    "piece rows negative": (edit_piece(rows=[-5, 10]), W + r"pieces\[0\]\.rows is \[-5, 10\]"),
    "piece rows short": (edit_piece(rows=[0, 5]), W + r"pieces is .*expected pieces whose rows partition \[0, 10\)"),
    "pieces overlapping": (two_pieces([4, 10], [0, 6]), W + r"pieces is .*expected pieces whose rows partition"),
    "pieces with a gap": (two_pieces([6, 10], [0, 5]), W + r"pieces is .*expected pieces whose rows partition"),
    "slicing in format 2": (edit_w(slicing=SLICED), W + r"slicing is \{'dim': 0, .*\}, expected \(format 3\)"),
    "slicing padded below its size": (both(edit(format=3), edit_w(slicing={**SLICED, "padded": 8})),
                                      W + r"slicing is .*'padded': 8.*, expected \(format 3\) an object of ints"),
    "a slice out of range": (both(edit(format=3), edit_w(slicing=SLICED), edit_piece(slice=2, rows=[0, 5])),
                             W + r"pieces\[0\]\.slice is 2, expected a slice in \[0, 2\)"),
    "a slice missing": (both(edit(format=3), edit_w(slicing=SLICED), edit_piece(slice=0, rows=[0, 5])),
                        W + r"pieces is .*expected pieces of every slice 0 \.\. 1"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_or_hostile_manifest_is_refused_by_name_before_any_tensor_file_is_opened(saved, name):
    directory, manifest = saved
    breaks, says = BROKEN[name]
    breaks(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    raised, paths = opened_during(lambda: ck.load(directory, small()))
    assert isinstance(raised, ck.CheckpointError), f"{name}: {raised!r}"
    assert re.search(says, str(raised)), f"{name}: {raised}"
    assert str(directory) in str(raised)
    assert not [p for p in paths if p.endswith(".safetensors")], f"{name}: opened {paths}"


@pytest.mark.parametrize("text, says", [
    ("[1, 2]", "the JSON is a list, expected an object"),
    ('"a string"', "the JSON is a str, expected an object"),
    ("null", "the JSON is null, expected an object"),
    ("[" * 100_000 + "]" * 100_000, "its JSON nests too deeply to parse"),
    ('{"format": 2, "extra": ' + "[" * 100_000 + "]" * 100_000 + "}", "its JSON nests too deeply to parse"),
], ids=["a list", "a str", "null", "nested lists", "nested extra"])
def test_a_manifest_that_is_not_an_object_or_nests_too_deeply_is_refused(saved, text, says):
    directory, _ = saved
    (directory / "manifest.json").write_text(text)
    for call in (lambda: ck.read_manifest(directory), lambda: ck.load(directory, small())):
        with pytest.raises(ck.CheckpointError, match=re.escape(f"{directory / 'manifest.json'}: ") + ".*" + says):
            call()


def test_the_valid_manifest_loads(saved):
    directory, _ = saved
    assert torch.equal(ck.load(directory, small()).params["w"], torch.arange(10.0))


def test_a_rank_file_linking_out_of_the_checkpoint_is_not_read(saved, tmp_path):
    directory, _ = saved
    secret = tmp_path / "elsewhere" / "secret.safetensors"
    secret.parent.mkdir()
    os.replace(directory / "rank00000.safetensors", secret)  # a valid file: read, it would load
    os.symlink(secret, directory / "rank00000.safetensors")
    raised, paths = opened_during(lambda: ck.load(directory, small()))
    assert isinstance(raised, ck.CheckpointError) and "outside the checkpoint's directory" in str(raised), raised
    assert "rank00000.safetensors: a link to" in str(raised)
    assert not [p for p in paths if "elsewhere" in p or os.path.realpath(p) == str(secret)], paths


def test_a_manifest_linking_out_of_the_checkpoint_is_not_read(saved, tmp_path):
    directory, _ = saved
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(directory / "manifest.json", elsewhere)
    os.symlink(elsewhere, directory / "manifest.json")
    for call in (lambda: ck.read_manifest(directory), lambda: ck.load(directory, small()),
                 lambda: ck.latest(directory.parent)):
        raised, paths = opened_during(call)
        assert isinstance(raised, ck.CheckpointError) and "outside the checkpoint's directory" in str(raised), raised
        assert not [p for p in paths if "elsewhere" in p], paths


def test_a_rank_file_that_is_not_a_regular_file_is_refused(saved):
    directory, _ = saved
    (directory / "rank00000.safetensors").unlink()
    (directory / "rank00000.safetensors").mkdir()
    with pytest.raises(ck.CheckpointError, match=r"rank00000.safetensors: not a regular file"):
        ck.load(directory, small())


def test_a_latest_pointer_naming_the_parent_is_refused(saved):
    directory, _ = saved
    root = directory / "inner"  # latest is ".." here: the checkpoint above root
    root.mkdir()
    (root / "latest").write_text("..")
    with pytest.raises(ck.CheckpointError, match=r"inner/latest is not zfunc's pointer file"):
        ck.latest(root)


def rewrite_header(directory, change):
    """Rewrite rank 0's safetensors header entry of params/w with ``change``, its crc32 in the manifest
    updated (so the refusal is the header's, not the checksum's)."""
    path = directory / "rank00000.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header = change(header)
    blob = (header if isinstance(header, bytes) else json.dumps(header).encode())
    blob += b" " * (-(8 + len(blob)) % 8)
    prefix = struct.pack("<Q", len(blob)) + blob
    path.write_bytes(prefix + data[8 + n :])
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"]["rank00000.safetensors"] = zlib.crc32(prefix)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def entry(**fields):
    def change(header):
        header["params/w"].update(fields)
        return header
    return change


@pytest.mark.parametrize("change, says", [
    (entry(dtype="F128"), r"tensor params/w's header entry .*: expected an object with a dtype in"),
    (entry(shape=[10**15]), r"expected as many bytes between its data_offsets as its shape and dtype take"),
    (entry(shape=[-10]), r"expected a shape: a list of ints >= 0"),
    (entry(data_offsets=[0, 2**40]), r"expected data_offsets \[start, stop\] with 0 <= start <= stop <= \d+"),
    (entry(data_offsets=[-40, 0]), r"expected data_offsets"),
    (lambda header: {**header, "params/w": "here"}, r"header entry 'here': expected an object"),
    (lambda header: b"[" * 50_000 + b"]" * 50_000, r"not a safetensors file \(its header nests too deeply\)"),
    (lambda header: b"[1]", r"not a safetensors file \(its header is list, not an object\)"),
], ids=["dtype unknown", "shape huge", "shape negative", "offsets beyond the file", "offsets negative",
        "entry a str", "nested", "a list"])
def test_a_hostile_safetensors_header_is_refused_before_a_buffer_is_allocated(saved, change, says):
    directory, _ = saved
    rewrite_header(directory, change)
    with pytest.raises(ck.CheckpointError, match=r"rank00000.safetensors: .*" + says):
        ck.load(directory, small())
