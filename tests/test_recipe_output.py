"""What a recipe prints before it trains and leaves behind after: --help states each default once,
the plan line counts the ranks and bytes of rank 0's share (a pipeline's stage, ZeRO's shard, and
why ZeRO 1/2 on one process holds more than ZeRO 0), a model vocabulary wider than the data's is
named with its cost, and a clean run's NVMe swap files are removed unless --keep-swap."""
import argparse
import re

import pytest

from recipes import bert, gpt, layout, llama, loop
from tests.recipe_runs import TINY

RECIPES = {"gpt": gpt.RECIPE, "llama": llama.RECIPE, "bert": bert.RECIPE}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog.\n" * 400)
    return path


# ----------------------------------------------------------------------------- --help
@pytest.mark.parametrize("recipe", RECIPES)
def test_help_states_each_options_default_at_most_once(recipe):
    parser = loop.parser(RECIPES[recipe])
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.help or action.help == argparse.SUPPRESS:
            continue
        text = formatter._expand_help(action)
        assert len(re.findall(r"\bdefault\b", text)) <= 1, (action.option_strings, text)
        assert "(default: None)" not in text, (action.option_strings, text)
    steps = next(a for a in parser._actions if "--steps" in a.option_strings)
    assert formatter._expand_help(steps) == f"(default: {RECIPES[recipe].defaults['steps']})"  # still stated


# ----------------------------------------------------------------------------- swap files
def test_a_clean_run_removes_its_swap_files_and_keep_swap_keeps_them(tmp_path, text_file, capsys):
    run = TINY + ["--steps", "1", "--eval-batches", "1", "--sample-len", "1", "--data", str(text_file),
                  "--offload-optimizer", "nvme"]
    (tmp_path / "given").mkdir()
    gpt.main(run + ["--nvme-path", str(tmp_path / "given"), "--out", str(tmp_path / "a")])
    assert list((tmp_path / "given").iterdir()) == []  # a folder zfunc did not make stays, empty
    assert "removed the swap files" in capsys.readouterr().out
    gpt.main(run + ["--nvme-path", str(tmp_path / "made"), "--out", str(tmp_path / "b"), "--keep-swap"])
    kept = [p.name for p in (tmp_path / "made").iterdir()]
    assert any(n.endswith(".swap") for n in kept) and any(n.endswith(".spare") for n in kept)
    assert "removed the swap files" not in capsys.readouterr().out
