"""units: selectors cover every parameter once and list the modules that read a unit's params."""
import pytest
from torch import nn

import zfunc as zf


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def as_dict(units):
    return {u.name: (set(u.params), set(u.users)) for u in units}


def test_by_class_gives_blocks_and_leftovers_with_tied_users():
    units = as_dict(zf.units.by_class(Block)(Model()))
    assert units["blocks.0"] == ({"blocks.0.fc.weight", "blocks.0.fc.bias"}, {"blocks.0"})
    assert units["emb"] == ({"emb.weight"}, {"emb", "head"})  # the tied head gathers the embedding
    assert units["ln_f"][0] == {"ln_f.weight", "ln_f.bias"}
    assert set(units) == {"blocks.0", "blocks.1", "emb", "ln_f"}


def test_by_names_checks_coverage():
    with pytest.raises(ValueError, match=r"units: parameters \['emb.weight', 'ln_f.bias'"):
        zf.units.by_names(["blocks.0", "blocks.1"])(Model())
    units = as_dict(zf.units.by_names(["blocks.0", ""])(Model()))
    assert units["blocks.0"][0] == {"blocks.0.fc.weight", "blocks.0.fc.bias"}
    assert "blocks.1.fc.weight" in units[""][0] and "emb.weight" in units[""][0]
    with pytest.raises(ValueError, match="no modules named"):
        zf.units.by_names(["nope"])(Model())


def test_auto_picks_largest_subtrees_under_the_limit():
    units = as_dict(zf.units.auto(max_params=25)(Model()))
    # blocks (20 params) and ln_f (8) fit; "blocks" (40) and the root do not; the embedding (40)
    # is left over and gets a unit of its own module
    assert set(units) == {"blocks.0", "blocks.1", "ln_f", "emb"}
    assert set(as_dict(zf.units.auto(max_params=10**6)(Model()))) == {""}


def test_by_class_errors():
    with pytest.raises(ValueError, match="no module of class Conv2d"):
        zf.units.by_class(nn.Conv2d)(Model())
    with pytest.raises(TypeError, match="by_class: expected module classes"):
        zf.units.by_class("Block")
