"""zfunc.ops.cpu.gomp: libgomp teams cover a range exactly once, in whole-line chunks."""
import numpy as np
import pytest
from numba import njit

from zfunc.ops.cpu import gomp


@pytest.mark.parametrize("lo, hi, k, want", [(0, 1, 2, 64), (0, 1000, 2, 512), (3, 100_003, 3, 33_344), (5, 5, 4, 0),
                                             (0, 129, 7, 64), (0, 128, 2, 64), (0, 129, 2, 128)])
def test_chunk_length_is_the_fewest_whole_lines_that_cover_the_range(lo, hi, k, want):
    """k chunks of ``per`` cover [lo, hi); one line less per chunk would not: each thread's share is
    as even as whole lines allow."""
    per = gomp.chunk_length(lo, hi, k)
    assert per % gomp.ALIGN == 0 and k * per >= hi - lo
    assert per == 0 or per - gomp.ALIGN < -(-(hi - lo) // k), per
    assert per == want


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
