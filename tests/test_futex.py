"""zfunc.dist.futex: a waiter sleeps in the kernel until its peer changes a shared word, and no wake-up is lost."""
import mmap
import threading
import time

import numpy as np
import pytest

from zfunc.dist import futex, shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="the futex wait runs on x86-64 Linux")


def _words():
    segment = mmap.mmap(-1, 4096)  # shared anonymous: the futex word is in a MAP_SHARED mapping, as a segment's
    control = np.ndarray((8,), dtype=np.int64, buffer=segment)
    return segment, control[0:1], control[1:2]


def test_a_wait_returns_at_once_when_the_word_has_changed_and_after_its_timeout_when_not():
    segment, word, _ = _words()
    word[0] = 5
    start = time.monotonic()
    futex.wait(word.ctypes.data, 4, 1.0)  # not the value: EAGAIN at once
    assert time.monotonic() - start < 0.05
    futex.wait(word.ctypes.data, 5, 0.05)
    assert time.monotonic() - start >= 0.04
    assert futex.wake(word.ctypes.data) == 0  # nobody waits


def test_a_waiter_sleeps_until_a_late_peer_changes_the_word_and_wakes_it():
    segment, word, asleep = _words()
    woken = {}

    def peer():
        time.sleep(0.2)
        woken["at"] = time.monotonic()
        word[0] += 1
        futex.wake_if_asleep(word, asleep)

    thread = threading.Thread(target=peer)
    cpu, start = time.thread_time(), time.monotonic()
    thread.start()
    futex.wait_until(lambda: word[0] == 1, word, asleep, lambda waited: None, busy_s=0.0, check_s=5.0)
    late, cpu = time.monotonic() - woken["at"], time.thread_time() - cpu
    thread.join()
    assert time.monotonic() - start >= 0.19
    assert late < 0.1  # woken by the peer, not by the 5 s timeout
    assert cpu < 0.02  # slept in the kernel: no polling
    assert asleep[0] == 0


def test_no_wake_up_is_lost_over_many_hand_offs():
    # two threads pass a counter back and forth 2000 times, each sleeping at once until the other's move
    segment = mmap.mmap(-1, 4096)
    control = np.ndarray((8,), dtype=np.int64, buffer=segment)
    word, asleep = control[0:1], control[1:3]
    n, stalls = 2000, []

    def player(me):
        for k in range(me, 2 * n, 2):
            futex.wait_until(lambda: word[0] == k, word, asleep[me:me + 1], stalls.append, busy_s=0.0, check_s=2.0)
            word[0] = k + 1
            futex.wake_if_asleep(word, asleep[1 - me:2 - me])

    threads = [threading.Thread(target=player, args=(me,)) for me in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert word[0] == 2 * n and not stalls  # a lost wake-up would stall a player for check_s
