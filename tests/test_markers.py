"""The suite's markers: a test that starts a process without ``multiprocess`` errors, so
``-m "not multiprocess"`` stays an inner loop without processes; ``-m`` keeps slow and gpu out."""
import pytest

from tests.recipe_runs import ROOT, checkout_pythonpath

SPAWNING = '''
import multiprocessing, subprocess, sys
import pytest

def test_unmarked_interpreter():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_process():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()

@pytest.mark.multiprocess
def test_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.slow
def test_slow():
    pass

def test_alone():
    pass
'''


@pytest.fixture
def suite(pytester, monkeypatch):
    # the suite's conftest imports zfunc: its pytest process finds this checkout's, installed or not
    monkeypatch.setenv("PYTHONPATH", checkout_pythonpath())
    pytester.makepyprojecttoml((ROOT / "pyproject.toml").read_text())
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (pytester.path / "tests" / "test_spawning.py").write_text(SPAWNING)
    return pytester


@pytest.mark.multiprocess
def test_a_test_that_starts_a_process_without_the_marker_errors(suite):
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=2, deselected=1)  # the unmarked pass, then error
    result.stdout.fnmatch_lines(["*test_unmarked_interpreter started processes without*subprocess.Popen*",
                                 "*test_unmarked_process started processes without*multiprocessing*"])


@pytest.mark.multiprocess
def test_not_multiprocess_deselects_the_marked_the_slow_and_the_gpu(suite):
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-m", "not multiprocess", "-k",
                                         "test_marked or test_slow or test_alone")
    result.assert_outcomes(passed=1, deselected=4)
    assert suite.runpytest_subprocess("-p", "no:cacheprovider", "-m", "slow").parseoutcomes() == {"passed": 1,
                                                                                                   "deselected": 4}
