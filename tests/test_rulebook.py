"""compose's rulebook is the one place composition rules live: every rule is refused alike by
``zf.config.Plan``, ``zf.config.check`` / ``zf.parallelize``, the estimator (``zf.plan``: a note,
and its search skips it) and the DeepSpeed reader, in the rulebook's words; a rule taken out of
the rulebook is refused by none of them (so none keeps a copy), and a rule registered is refused by
all of them."""
import re
import warnings

import pytest
import torch.nn.functional as F

import zfunc as zf
from tests.models import Tiny
from zfunc import plan as zp
from zfunc.config import deepspeed as D
from zfunc.core import compose
from zfunc.core.transformed import Transformed

# rule name -> plan fields that break that rule alone
CASES = {
    "microbatches without a pipeline": dict(microbatches=4),
    "params offload below stage 3": dict(zero_stage=2, offload_optimizer="cpu", offload_params="cpu"),
    "accumulation under a pipeline": dict(pp=2, accum=2),
    "sequence without tensor parallelism": dict(sp=True),
    "optimizer offload of replicas": dict(dp=2, offload_optimizer="cpu"),
    "params offload without optimizer offload": dict(zero_stage=3, offload_params="cpu"),
    "pipeline over replicas": dict(dp=2, pp=2, microbatches=2),
    "tensor parallelism with what it does not yet run": dict(tp=2, sp=True, dp=2),
    "1-bit optimizer with ZeRO 1-3": dict(dp=2, zero_stage=1, optimizer="onebit_adam"),
    "sequence parallelism under a pipeline at stage 0": dict(pp=2, microbatches=2, sp_size=2),
    "Ulysses or ring with Megatron's sequence parallelism": dict(tp=2, sp=True, sp_size=2),
}
RULES = {rule.name: rule for rule in compose.RULES}


class Fields:
    """Plan's fields as plain data, unchecked: what the rulebook reads."""

    def __init__(self, **fields):
        import dataclasses

        defaults = {f.name: f.default for f in dataclasses.fields(zf.config.Plan)
                    if f.default is not dataclasses.MISSING}
        vars(self).update(defaults, **fields)


SPEC = zp.from_shape(4, 64, 4, vocab=128, max_seq=32)


def estimated(plan) -> list[str]:
    """The notes of the estimate of ``plan`` on as many GPUs as it has ranks."""
    return zp.plan(SPEC, zp.cluster("A100-80GB", plan.dp * plan.pp * plan.tp * plan.sp_size), plan).notes


def noted(notes: list[str], text: str) -> bool:
    return any(note.startswith(text) for note in notes)


def refusal_of(name: str) -> str:
    return RULES[name].refuses(Fields(**CASES[name]))


def test_every_rule_has_a_case_that_breaks_it_alone():
    assert set(CASES) == set(RULES)
    for name, fields in CASES.items():
        found = compose.broken(Fields(**fields))
        assert [rule.name for rule, _ in found] == [name], (name, found)
        text = found[0][1]  # it names the field, its value and what was expected
        field = text.partition(": ")[0]
        assert hasattr(zf.config.Plan, field) and repr(getattr(Fields(**fields), field)) in text, text
        assert re.search(r"(expected|needs?|composes with) .*got", text), text


def refused_by_the_run(plan, text):
    """``zf.config.check``, ``zf.config.prepare`` and ``zf.parallelize`` refuse ``plan`` with ``text``."""
    for call in (lambda: zf.config.check(plan), lambda: zf.config.prepare(None, plan),
                 lambda: zf.parallelize(None, None, plan)):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == text


@pytest.mark.parametrize("name", list(CASES))
def test_each_rule_is_refused_in_its_words_by_plan_parallelize_and_the_estimator(name):
    text = refusal_of(name)
    if RULES[name].kind == compose.INCONSISTENT:  # no Plan holds it, so nothing downstream sees it
        with pytest.raises(ValueError) as e:
            zf.config.Plan(**CASES[name])
        assert str(e.value) == text
    else:
        plan = zf.config.Plan(**CASES[name])
        refused_by_the_run(plan, text)
        assert noted(estimated(plan), text)


@pytest.mark.parametrize("name", list(CASES))
def test_a_rule_out_of_the_rulebook_is_refused_by_none(monkeypatch, name):
    monkeypatch.setattr(compose, "RULES", [rule for rule in compose.RULES if rule.name != name])
    plan = zf.config.Plan(**CASES[name])
    zf.config.check(plan)
    assert not noted(estimated(plan), refusal_of(name))


def read_ds(config, world_size=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", D.IgnoredKeysWarning)
        return D.from_deepspeed({"train_micro_batch_size_per_gpu": 2, **config}, world_size=world_size)


def test_the_deepspeed_reader_asks_the_rulebook(monkeypatch):
    """DeepSpeed takes params offload without optimizer offload; zfunc does not run it, and the
    reader says so by key path in the rulebook's words; without the rule it reads the config."""
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    text = refusal_of("params offload without optimizer offload").partition(": ")[2]
    with pytest.raises(ValueError) as e:
        read_ds(config)
    assert str(e.value) == f"zero_optimization.offload_param.device (plan offload_params): {text}"
    monkeypatch.setattr(compose, "RULES", [r for r in compose.RULES if r.name != "params offload without optimizer "
                                                                                   "offload"])
    assert read_ds(config).offload_params == "cpu"


def no_remat_at_stage_2(plan):
    if plan.remat and plan.zero_stage == 2:
        return "remat: the probe refuses remat at ZeRO stage 2; expected remat=False with zero_stage=2, got True"
    return None


@pytest.fixture
def probe():
    """A step transformation registered for the test: it wraps a plain or sharded step, zf.offload
    may wrap it, and it brings a plan rule of its own."""
    compose.register("probe", wraps={"train_step": None, "shard": None}, wrapped_by={"offload": None},
                     rules=[compose.Rule("no remat at stage 2", compose.UNSUPPORTED, no_remat_at_stage_2)])

    def apply(step):
        compose.check("probe", step)
        return Transformed(step, "probe")

    yield apply
    compose.unregister("probe")


def plain_step(**kw):
    apply, _ = zf.functionalize(Tiny())
    return zf.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]).flatten(0, 1), b[1].flatten()),
                         zf.optim.adamw(1e-2), **kw)


def test_a_registered_rule_is_refused_by_every_reader(probe):
    plan = zf.config.Plan(zero_stage=2, remat=True)
    text = no_remat_at_stage_2(plan)
    refused_by_the_run(plan, text)
    with pytest.raises(ValueError) as e:
        read_ds({"zero_optimization": {"stage": 2}, "activation_checkpointing": {}})
    assert str(e.value) == "activation_checkpointing (plan remat): " + text.partition(": ")[2]
    assert noted(estimated(plan), text)
    found = zp.search(SPEC, zp.cluster("A100-80GB", 1), zf.config.Plan(), top=1 << 30)
    assert found and not [e for e in found if e.plan.remat and e.plan.zero_stage == 2]
    compose.unregister("probe")
    zf.config.check(plan)
    assert not noted(estimated(plan), text)
    found = zp.search(SPEC, zp.cluster("A100-80GB", 1), zf.config.Plan(), top=1 << 30)
    assert [e for e in found if e.plan.remat and e.plan.zero_stage == 2]

def test_a_registered_transformation_has_a_row_and_a_column(probe):
    step, mesh = plain_step(), zf.Mesh()
    assert compose.layers(probe(step)) == ("train_step", "probe")
    assert compose.layers(probe(zf.shard(step, mesh, 1))) == ("train_step", "shard", "probe")
    compose.check("offload", probe(step))
    for outer in compose.STEP_TRANSFORMS:  # every pair has a verdict, the new ones included
        for inner in ("train_step", *compose.STEP_TRANSFORMS):
            assert (outer, inner) in compose.TABLE, (outer, inner)
    for build, outer, inner in ((lambda: zf.shard(probe(step), mesh, 1), "shard", "probe"),
                                (lambda: probe(zf.offload(step)), "probe", "offload"),
                                (lambda: probe(probe(step)), "probe", "probe")):
        with pytest.raises(ValueError, match=re.escape(f"zf.{outer} cannot wrap zf.{inner}: the rulebook has no row")):
            build()
    with pytest.raises(ValueError, match="name: 'shard' is a built-in transformation"):
        compose.register("shard", wraps={})
    with pytest.raises(ValueError, match=re.escape("wraps: expected names among")):
        compose.register("probe2", wraps={"nothing": None})
    compose.unregister("probe")
    assert "probe" not in compose.STEP_TRANSFORMS and not [p for p in compose.TABLE if "probe" in p]
    with pytest.raises(ValueError, match="outer: expected one of"):
        probe(step)


class MeshShape:
    """What the rulebook reads of a mesh (its sizes), without a process group."""

    def __init__(self, dp, pp):
        self.dp, self.pp = dp, pp


def test_the_step_rules_on_options_live_in_the_rulebook(monkeypatch):
    """offload(params=, units=) of a sharded step, a pipeline of an accumulating step, over a dp
    mesh or another mesh than its sharded step's, are the rulebook's verdicts: with the first two out
    of the table, the transformations refuse neither."""
    step, accumulating, mesh = plain_step(), plain_step(accum=2), zf.Mesh()
    with pytest.raises(ValueError, match="params: offloading params needs stage 3"):
        zf.offload(zf.shard(step, mesh, 2), params="cpu")
    with pytest.raises(ValueError, match="step: accum=2; the pipeline splits the batch"):
        zf.pipeline(accumulating, 1, 2, model=Tiny(), units=zf.units.auto())
    with pytest.raises(ValueError, match="units: a sharded step brings its own units"):
        zf.offload(zf.shard(step, mesh, 3), units=zf.units.auto())
    with pytest.raises(ValueError, match="mesh: a sharded step pipelines over its own mesh"):
        zf.pipeline(zf.shard(step, zf.Mesh(pp=1), 1), 1, 2, model=Tiny(), units=zf.units.auto(), mesh=zf.Mesh(pp=1))
    with pytest.raises(ValueError, match="mesh: dp=2; shard the step over the dp axis first"):
        zf.pipeline(step, 1, 2, model=Tiny(), units=zf.units.auto(), mesh=MeshShape(dp=2, pp=1))
    monkeypatch.setitem(compose.TABLE, ("offload", "shard"), None)
    monkeypatch.setitem(compose.TABLE, ("pipeline", "train_step"), None)
    for build in (lambda: zf.offload(zf.shard(step, mesh, 2), params="cpu"),
                  lambda: zf.pipeline(accumulating, 1, 2, model=Tiny(), units=zf.units.auto())):
        try:
            build()
        except ValueError as e:  # whatever else the build meets, not the rule taken out
            assert "needs stage 3" not in str(e) and "accum=2" not in str(e), e
