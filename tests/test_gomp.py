"""zfunc.ops.cpu.gomp: libgomp teams cover a range exactly once, in whole-line chunks."""
import numpy as np
import pytest
from numba import njit

from zfunc.ops.cpu import gomp


@pytest.mark.parametrize("lo, hi, k", [(0, 1, 2), (0, 1000, 2), (3, 100_003, 3), (5, 5, 4), (0, 129, 7)])
def test_chunk_length_covers_the_range_in_whole_lines(lo, hi, k):
    per = gomp.chunk_length(lo, hi, k)
    assert per % gomp.ALIGN == 0 and k * per >= hi - lo


@njit(error_model="numpy", boundscheck=False)
def _mark(lo, hi, out):
    for i in range(lo, hi):
        out[i] += 1.0


@njit
def _mark_on_team(k, lo, hi, out):
    gomp.parallel_range(_mark, k, (lo, hi, out))


@pytest.mark.skipif(not gomp.AVAILABLE, reason="libgomp not loadable")
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_a_team_updates_every_element_of_the_range_once(k):
    out = np.zeros(10_000, np.float32)
    _mark_on_team(k, 17, 9_990, out)
    assert out[:17].sum() == 0 and out[9_990:].sum() == 0 and (out[17:9_990] == 1).all()
