"""zfunc.core.env: settings from environment variables, with errors naming the variable."""
import pytest

from zfunc.core import env


def test_unset_gives_the_default_and_a_good_value_is_cast(monkeypatch):
    monkeypatch.delenv("ZFUNC_TEST_N", raising=False)
    assert env.number("ZFUNC_TEST_N", 19, int, lambda n: n >= 0, "an int >= 0") == 19
    monkeypatch.setenv("ZFUNC_TEST_N", "7")
    assert env.number("ZFUNC_TEST_N", 19, int, lambda n: n >= 0, "an int >= 0") == 7


@pytest.mark.parametrize("raw", ["high", "", "-1", "nan", "inf", "1.5"])
def test_a_bad_value_is_refused_naming_the_variable_and_the_value(monkeypatch, raw):
    monkeypatch.setenv("ZFUNC_TEST_N", raw)
    cast = float if raw in ("nan", "inf") else int
    with pytest.raises(ValueError, match=f"environment variable ZFUNC_TEST_N: expected an int >= 0, got {raw!r}"):
        env.number("ZFUNC_TEST_N", 19, cast, lambda n: n >= 0, "an int >= 0")


def test_a_choice_is_one_of_its_values(monkeypatch):
    monkeypatch.delenv("ZFUNC_TEST_C", raising=False)
    assert env.choice("ZFUNC_TEST_C", "small", ("small", "all")) == "small"
    monkeypatch.setenv("ZFUNC_TEST_C", "all")
    assert env.choice("ZFUNC_TEST_C", "small", ("small", "all")) == "all"
    monkeypatch.setenv("ZFUNC_TEST_C", "most")
    with pytest.raises(ValueError, match=r"ZFUNC_TEST_C: expected one of \('small', 'all'\), got 'most'"):
        env.choice("ZFUNC_TEST_C", "small", ("small", "all"))
