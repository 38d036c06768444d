"""recipes/lr_schedule.py: a run's lr schedule is part of its checkpoint, and --resume continues it.
Resumed with a larger --steps, each step's lr is the one the uninterrupted run would have had there
(its final value past its end); --extend-schedule re-lays it over the new --steps, with a warning.
The recipe runs are tiny (a 1-block GPT, 4 steps) and in-process."""
import shutil

import pytest

import zfunc as zf
from recipes import cli, engine, gpt, layout, lr_schedule
from tests.recipe_runs import metrics

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--lr", "1e-2", "--end-lr", "1e-3", "--warmup", "1", "--eval-batches", "1", "--eval-every", "0",
        "--log-every", "1", "--ckpt-every", "2", "--sample-len", "0", "--seed", "0", "--precision", "fp32"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog.\n" * 40)
    return path


def lrs(out, steps) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in metrics(out) if r["step"] in steps}


def back_to_step_2(out):
    """As if the run had died after its checkpoint at step 2."""
    (out / "ckpt" / "000004").rename(out / "moved")
    (out / "ckpt" / "latest").write_text("000002")


def test_resume_with_more_steps_continues_the_schedule_and_extend_schedule_relays_it(tmp_path, text_file, capsys,
                                                                                      recwarn):
    argv = TINY + ["--data", str(text_file)]
    first = gpt.main(argv + ["--steps", "4", "--out", str(tmp_path / "a")])
    saved = zf.checkpoint.read_manifest(first["checkpoint"])["extra"]["schedule"]
    assert saved == dict(kind="warmup_cosine", total_steps=4, peak_lr=1e-2, end_lr=1e-3, warmup_steps=1)
    original = lrs(tmp_path / "a", {3, 4})
    back_to_step_2(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    capsys.readouterr()

    gpt.main(argv + ["--steps", "6", "--out", str(tmp_path / "a"), "--resume"])
    got = lrs(tmp_path / "a", {3, 4, 5, 6})
    assert {3: got[3], 4: got[4]} == original  # the uninterrupted run's lr at those steps
    assert got[5] == got[6] == pytest.approx(1e-3)  # past the schedule's end: its final lr
    printed = capsys.readouterr().out
    assert "schedule: the checkpoint's warmup_cosine over 4 steps continues; past its end (steps 5-6) the lr " \
           "stays at its final value, 0.001" in printed, printed
    assert not [w for w in recwarn if issubclass(w.category, lr_schedule.ScheduleWarning)]
    latest = zf.checkpoint.latest(tmp_path / "a" / "ckpt")
    assert zf.checkpoint.read_manifest(latest)["extra"]["schedule"]["total_steps"] == 4  # still the run's

    with pytest.warns(lr_schedule.ScheduleWarning, match=r"--extend-schedule: the lr schedule is re-laid over 6 "
                                                         r"steps \(the checkpoint's: 4\): the lr of step 3 is"):
        gpt.main(argv + ["--steps", "6", "--out", str(tmp_path / "b"), "--resume", "--extend-schedule"])
    fresh = zf.optim.warmup_cosine(1e-2, 1, 6, end_value=1e-3)  # as a fresh run of 6 steps lays it
    got = lrs(tmp_path / "b", {3, 4, 5, 6})
    assert got == pytest.approx({n: fresh(n - 1) for n in (3, 4, 5, 6)}) and got[3] != original[3]


def test_a_deepspeed_schedule_keeps_its_total_and_an_auto_one_follows_the_runs():
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                            "warmup_num_steps": 2, "total_num_steps": 10}}}
    args = cli.parse_args(gpt.RECIPE, ["--steps", "6"])
    plan = zf.config.from_deepspeed(cfg)
    spec = lr_schedule.spec(args, plan)
    assert spec["kind"] == "WarmupDecayLR" and spec["total_steps"] == 10  # the config's, not --steps
    ours, theirs = lr_schedule.function(spec), zf.config.schedule(plan)
    assert [ours(n) for n in range(14)] == [theirs(n) for n in range(14)] and ours(11) == ours(13) == 0.0
    engine.make_optimizer(args, plan)  # the config's total: no ValueError for differing from --steps
    resumed = lr_schedule.with_total(args)  # no --resume: laid over --steps
    assert lr_schedule.total(resumed) == 6
    flags = {"deepspeed_optimizer": {"scheduler_params": {"total_num_steps": 6, "warmup_num_steps": 2}}}
    extend = cli.parse_args(gpt.RECIPE, ["--extend-schedule"])
    assert lr_schedule.comparable(flags, extend)["deepspeed_optimizer"]["scheduler_params"] == {"warmup_num_steps": 2}
    assert lr_schedule.comparable(flags, args) == flags


def test_what_a_resume_says_of_its_schedule():
    args = lr_schedule.with_total(cli.parse_args(gpt.RECIPE, ["--steps", "8", "--warmup", "2"]))
    plan, args = layout.resolve(cli.with_precision(args), 1, None, notices=False)
    spec = lr_schedule.spec(args, plan)
    assert spec == dict(kind="warmup_cosine", total_steps=8, peak_lr=3e-3, end_lr=3e-4, warmup_steps=2)
    assert lr_schedule.on_resume(args, spec, 8, 4) is None  # the same --steps: nothing to say
    shorter = cli.parse_args(gpt.RECIPE, ["--steps", "6", "--warmup", "2"])
    assert "continues; training stops at step 6 (lr " in lr_schedule.on_resume(shorter, spec, 8, 4)
    with pytest.warns(lr_schedule.ScheduleWarning, match="records no lr schedule .* laid over --steps 8"):
        assert lr_schedule.on_resume(args, spec, None, 4) is None
    assert lr_schedule.laid_over(spec, 3, args)["warmup_steps"] == 1  # at most half the steps, as a fresh run
