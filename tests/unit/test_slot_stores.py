"""The choice between ordinary and non-temporal stores for staging slots (host/slot_stores.h),
fed made-up call times: it keeps the faster way, probes the other ever more rarely while that
one loses, and switches soon after the kept way slows down. The collectives themselves run
with streamed slots in test_collectives.py and test_single_copy.py."""

import pytest

from pycollectives import _C

KIND, BIG = 3, 16 << 20


def simulate(policy, seconds, calls, kind=KIND, size=BIG):
    """Runs `calls` calls, call i taking seconds(i, streamed); returns the ways they ran."""
    ways = []
    for i in range(calls):
        streamed = policy.choose(kind, size)
        policy.record(kind, size, streamed, seconds(i, streamed))
        ways.append(streamed)
    return ways


def probes(ways):
    """Indices of the calls that ran the minority way."""
    kept = max(set(ways), key=ways.count)
    return [i for i, w in enumerate(ways) if w != kept]


@pytest.mark.parametrize("mode, want", [("cached", False), ("streamed", True)])
def test_forced_modes_never_change(mode, want):
    p = _C.SlotStorePolicy(mode)
    ways = simulate(p, lambda i, s: 1.0 if s else 9.0, 50)
    assert ways == [want] * 50
    assert p.choose(KIND, 8) == want  # small calls too


def test_small_calls_stay_cached():
    p = _C.SlotStorePolicy()
    ways = simulate(p, lambda i, s: 1.0 if s else 9.0, 30, size=32 << 10)
    assert not any(ways)


def probe_starts(ways):
    """Indices of the first calls of each run of 3 probes."""
    p = probes(ways)
    return [i for i in p if i - 1 not in p]


def test_switches_to_the_faster_way_after_three_calls_each():
    p = _C.SlotStorePolicy()
    ways = simulate(p, lambda i, s: 1.0 if s else 2.0, 40)
    assert ways[:6] == [False] * 3 + [True] * 3
    # Streamed from then on, with cached probed 3 calls at a time now and then.
    assert ways[6:].count(True) >= 34 - 6


def test_probes_back_off_while_they_lose():
    p = _C.SlotStorePolicy()
    ways = simulate(p, lambda i, s: 1.5 if s else 1.0, 300)
    assert ways[:6] == [False] * 3 + [True] * 3
    assert all(len([i for i in probes(ways) if s <= i < s + 3]) == 3 for s in probe_starts(ways))
    # 8, 16, 32, then 64 calls the kept way between probes.
    gaps = [b - a - 3 for a, b in zip(probe_starts(ways), probe_starts(ways)[1:])]
    assert gaps[:3] == [8, 16, 32], gaps
    assert set(gaps[3:]) == {64}, gaps


def test_a_close_race_does_not_switch():
    # Within 10%: the kept way stays.
    p = _C.SlotStorePolicy()
    ways = simulate(p, lambda i, s: 0.95 if s else 1.0, 200)
    assert ways.count(False) > 180


def test_follows_a_change_of_placement_within_a_few_calls():
    # Cached is faster until call 100, then 3x slower (the cores moved apart), and from call
    # 200 faster again.
    def seconds(i, streamed):
        if streamed:
            return 1.5
        return 3.0 if 100 <= i < 200 else 1.0

    ways = simulate(_C.SlotStorePolicy(), seconds, 300)
    assert ways[60:100].count(True) <= 3
    # 3 slow calls show the change, 3 probes confirm it.
    assert ways[100:106] == [False] * 3 + [True] * 3, ways[100:110]
    assert ways[106:200].count(False) <= 9  # probes only
    # Back to cached at the next probe: the kept way did not slow down, so nothing hurries
    # it, but probes come at least every 64 calls.
    back = ways.index(False, 200)
    assert back <= 200 + 64 and ways[back + 3 :].count(True) <= 6, ways[200:]


def test_slow_calls_among_fast_ones_do_not_trigger_a_probe():
    # A busy thread beside the ranks slows single calls; the fastest of the last 3 stays.
    p = _C.SlotStorePolicy()
    ways = simulate(p, lambda i, s: 1.5 if s else (20.0 if i % 3 == 0 else 1.0), 30)
    assert probe_starts(ways) == [3, 14], ways


def test_noisy_calls_still_find_the_faster_way():
    # Every other call of either way takes 3x longer (descheduled): judged by single calls
    # the two would look alike half of the time.
    def seconds(i, streamed):
        return (0.5 if streamed else 1.0) * (3 if i % 2 else 1)

    ways = simulate(_C.SlotStorePolicy(), seconds, 100)
    assert ways[6:].count(True) >= 94 - 9


def test_kinds_and_size_classes_are_measured_apart():
    p = _C.SlotStorePolicy()
    simulate(p, lambda i, s: 1.0 if s else 2.0, 10, kind=1)
    assert p.choose(1, BIG) is True
    assert p.choose(2, BIG) is False  # another collective or algorithm: not measured yet
    assert p.choose(1, BIG * 2) is False  # another size class


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="auto"):
        _C.SlotStorePolicy("fast")


def test_environment_sets_the_mode():
    from pycollectives.options import Options

    assert Options.resolve(environ={}).host_options().slot_stores == "auto"
    opts = Options.resolve(environ={"PYCOLL_SLOT_STORES": " Streamed "})
    assert opts.host_options().slot_stores == "streamed"
    with pytest.raises(ValueError, match="PYCOLL_SLOT_STORES='fast'"):
        Options.resolve(environ={"PYCOLL_SLOT_STORES": "fast"})
