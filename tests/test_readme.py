"""The README's examples against the code: every name they use exists, every flag they pass parses,
and the examples that need one process run.

Rules (what a README author needs to know):
- Every ```python block must compile, and every ``zf.a.b`` / ``zfunc.a.b`` / ``zp.a.b`` name in the
  README (code and prose) must resolve.
- A ```python block *runs* unless the line before its opening fence is an HTML comment
  ``<!-- not run: WHY -->`` (several processes, a checkpoint on disk, minutes of compute). A block
  that runs gets a fresh namespace holding tiny stand-ins for the names a reader brings
  (``_standins``: a 2-layer GPT as ``model``, ``loss_fn``, ``opt``, ``batches``, ``world_size=1``,
  ``cfg``, ...); ``/scratch/zf`` becomes a temporary folder.
- In ```bash blocks, every ``--flag`` after ``-m recipes.NAME`` must be one of that recipe's flags,
  and every one after ``-m zfunc.plan`` one of the planner's.
Runs in about 3-5 s (most of it the first train steps of the 20-line example).
"""
from __future__ import annotations

import importlib
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from zfunc import plan as zp

README = Path(__file__).resolve().parent.parent / "README.md"
SKIP = re.compile(r"<!--\s*not run:.*-->")


def _blocks(lang: str) -> list[tuple[int, str, bool]]:
    """(line number, dedented code, marked not-run) of each fenced block in ``lang``, indented ones included."""
    lines = README.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^( *)```" + lang + r"\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, start = m.group(1), i
        i += 1
        body = []
        while not re.match(r"^" + indent + r"```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        skipped = start > 0 and bool(SKIP.search(lines[start - 1]))
        out.append((start + 1, textwrap.dedent("\n".join(body)) + "\n", skipped))
        i += 1
    return out


PYTHON = _blocks("python")
RUN = [(line, code) for line, code, skipped in PYTHON if not skipped]


def _resolve(dotted: str):
    """The object ``zf.a.b`` names: attributes, else submodules (``zfunc.ops.cpu.adam``)."""
    head, *rest = dotted.split(".")
    obj, path = {"zf": zf, "zfunc": zf, "zp": zp}[head], {"zf": "zfunc", "zfunc": "zfunc", "zp": "zfunc.plan"}[head]
    for part in rest:
        path += "." + part
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(path)  # raises ModuleNotFoundError naming it
    return obj


def test_readme_has_python_examples_and_some_run():
    assert len(PYTHON) >= 6 and len(RUN) >= 3, (len(PYTHON), len(RUN))


@pytest.mark.parametrize("line,code", [(line, code) for line, code, _ in PYTHON], ids=lambda v: str(v)[:12])
def test_every_python_block_compiles(line, code):
    compile(code, f"README.md:{line}", "exec")


def test_every_zfunc_name_in_the_readme_exists():
    names = sorted(set(re.findall(r"\b(?:zf|zfunc|zp)(?:\.[A-Za-z_]\w*)+", README.read_text())))
    missing = []
    for name in names:
        name = re.sub(r"\.(py|md|json)$", "", name)  # file names in prose: zfunc/plan.py reads as zfunc.plan
        try:
            _resolve(name)
        except (AttributeError, ModuleNotFoundError):
            missing.append(name)
    assert not missing, f"README names that do not exist: {missing}"


def _standins(tmp_path: Path) -> dict:
    from recipes.gpt import GPT, GPTConfig

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    model = GPT(cfg)
    apply, params = zf.functionalize(model)

    def loss_fn(params, batch):
        x, y = batch
        return F.cross_entropy(apply(params, x).flatten(0, 1).float(), y.flatten())

    opt = zf.optim.adamw(1e-3)
    data = torch.randint(0, 256, (1, 2, 17), generator=torch.Generator().manual_seed(0))
    return dict(torch=torch, F=F, math=math, zf=zf, zp=zp, GPT=GPT, GPTConfig=GPTConfig, cfg=cfg, model=model,
                apply=apply, params=params, loss_fn=loss_fn, opt=opt, seed=0, world_size=1,
                batches=[(t[:, :-1], t[:, 1:]) for t in data],
                step=zf.offload(zf.train_step(loss_fn, opt)),  # a step whose init takes materialize=
                hidden=torch.randn(16, 32), weight=torch.randn(256, 32), targets=torch.randint(0, 256, (16,)))


@pytest.mark.parametrize("line,code", RUN, ids=lambda v: str(v)[:12])
def test_python_block_runs(line, code, tmp_path):
    torch.manual_seed(0)
    code = code.replace("/scratch/zf", str(tmp_path / "swap"))
    exec(compile(code, f"README.md:{line}", "exec"), _standins(tmp_path))


def _flags_of(target: str) -> set[str]:
    if target in ("zfunc.plan", "recipes.plan"):  # recipes.plan: zfunc.plan's flags, the recipes' flavors known
        parser = importlib.import_module("zfunc.plan.__main__").parser()
        extra = set()
    else:
        from recipes import cli

        recipe = importlib.import_module(target).RECIPE
        parser = cli.parser(recipe)
        extra = {"--scaling", "--nsp"} if target == "recipes.bert" else set()  # read before the parser (bert.main)
    return set(parser._option_string_actions) | extra


def test_every_flag_in_the_readme_commands_exists():
    unknown = []
    for line, code, _ in _blocks("bash"):
        for command in code.replace("\\\n", " ").splitlines():
            m = re.search(r"-m (recipes\.\w+|zfunc\.plan)\b(.*)", command.split("#")[0])
            if m:
                known = _flags_of(m.group(1))
                unknown += [f"{m.group(1)} {f} (README.md:{line})"
                            for f in re.findall(r"(?<!\S)--[a-z][\w-]*", m.group(2)) if f not in known]
    assert not unknown, f"flags the README passes that do not exist: {unknown}"
