"""zfunc.config.json_file: JSON from someone else's file, read within bounds, each broken bound named."""
import re

import pytest

from zfunc.config import json_file


def test_depth_counts_containers_without_recursion():
    assert [json_file.depth(v) for v in (1, {}, [], {"a": [1, {"b": 2}]})] == [0, 1, 1, 3]
    deep = inner = []
    for _ in range(100_000):
        inner.append(inner := [])
    assert json_file.depth(deep) > json_file.MAX_DEPTH  # stops early, never recurses


def test_a_config_within_bounds_reads_as_json_does(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"a": [1, 2.5, {"b": null}], "c": "d"}')
    assert json_file.read(path) == {"a": [1, 2.5, {"b": None}], "c": "d"}


@pytest.mark.parametrize("text, message", [
    ('{"a": 1, "a": 2}', "duplicate keys ['a']"),
    ('{"a": Infinity}', "Infinity is not a JSON number"),
    ('{"a": -Infinity}', "-Infinity is not a JSON number"),
    ("[" * 33 + "]" * 33, f"nested more than {json_file.MAX_DEPTH} levels deep"),
    ("[" * 100_000 + "]" * 100_000, f"nested more than {json_file.MAX_DEPTH} levels deep"),
    ('{"a": 1', "not valid JSON: Expecting ',' delimiter at line 1 column 8"),
])
def test_each_bound_is_named(text, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        json_file.parse(text)


def test_a_file_too_large_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(json_file, "MAX_BYTES", 10)
    path = tmp_path / "big.json"
    path.write_text('{"a": "0123456789"}')
    with pytest.raises(ValueError, match="19 bytes, more than the 10 a config may have"):
        json_file.read(path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        json_file.read(tmp_path / "missing.json")
