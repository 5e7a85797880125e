"""The rules fitted from a probe's measurements (backends/host_tuning.py), by hand; the cache;
PYCOLL_TUNING."""

import json

import pytest

from pycollectives.backends import host_tuning as ht
from pycollectives.options import TUNING_FILE, Options, load_tuning

US = 1e-6


def measured(**algos):
    """An all-reduce probe at 8, 64, 512 and 4096 B: each algorithm's times in microseconds."""
    times = {a: [t * US for t in ts] for a, ts in algos.items()}
    return {"all_reduce": {"bytes": [8, 64, 512, 4096], **times}}


def test_lines_between_measured_sizes():
    sizes, times = [8, 64, 512], [1.0, 2.0, 9.0]
    assert ht.fitted_time(sizes, times, 64) == 2.0
    assert ht.fitted_time(sizes, times, 36) == 1.5  # halfway from 8 to 64
    assert ht.fitted_time(sizes, times, 288) == 5.5  # halfway from 64 to 512
    # Above the largest size the last line goes on (7 us per 448 B), never falling.
    assert ht.fitted_time(sizes, times, 1024) == 17.0
    assert ht.fitted_time(sizes, [1.0, 2.0, 1.5], 4096) == 1.5
    with pytest.raises(ValueError):
        ht.fitted_time(sizes, times, 4)
    # 8 sizes compared in each factor of 8, evenly in the logarithm: 512 * 8 ** (j / 8), and as
    # many again up to 8 times the largest.
    assert ht.compared_sizes([512, 4096]) == [
        512, 664, 861, 1117, 1448, 1878, 2435, 3158, 4096,
        5312, 6889, 8933, 11585, 15024, 19484, 25268, 32768,
    ]  # fmt: skip


def test_rules_by_hand():
    # direct 1, 1, 2, 16 us; ring 3, 3, 3, 6 us. Up to 512 B direct is faster. Between 512 and
    # 4096 B the lines are direct 2 + 14 x and ring 3 + 3 x (x = (size - 512) / 3584), equal
    # at x = 1/11 (838 B). At the compared sizes 664 (x = 0.042: direct 2.59, ring 3.13) and
    # 861 (x = 0.097: direct 3.36, ring 3.29, 2% faster) direct holds, since the rules switch
    # only to an algorithm 3% faster; at 1117 (x = 0.169: direct 4.36, ring 3.51) ring takes
    # over, and holds above the largest size measured.
    m = measured(ring=[3, 3, 3, 6], direct=[1, 1, 2, 16])
    assert ht.rules_from(m, 2) == [
        ("all_reduce", 2, 2, 861, "direct"),
        ("all_reduce", 2, 2, ht.UNBOUNDED, "ring"),
    ]
    # Without the margin the switch comes at the first compared size past the crossing.
    assert ht.rules_from(m, 2, margin=0)[0] == ("all_reduce", 2, 2, 664, "direct")
    # Near-ties do not split the range: ring 2% faster at every size keeps direct.
    tie = measured(ring=[0.98, 0.98, 0.98, 0.98], direct=[1, 1, 1, 1])
    assert ht.rules_from(tie, 4) == [("all_reduce", 4, 4, ht.UNBOUNDED, "ring")]
    # Three algorithms, the middle one winning in the middle.
    three = measured(ring=[5, 5, 5, 5], tree=[3, 3, 3, 9], direct=[1, 1, 9, 9])
    rules = ht.rules_from(three, 3, margin=0)
    assert [r[4] for r in rules] == ["direct", "tree", "ring"]
    assert [ht.table_choice(rules, "all_reduce", 3, s) for s in (8, 64, 512, 4096, 1 << 30)] == [
        "direct", "direct", "tree", "ring", "ring"]  # fmt: skip


def test_rules_above_the_largest_size_follow_the_slopes():
    # tree 5, 5, 20, 99 us; ring 10, 10, 30, 100 us: tree is faster at every measured size,
    # by 1% at 4096 B. Above it the lines go on: tree 99 + 79 d / 3584, ring 100 + 70 d / 3584
    # (d = size - 4096), ring 3% faster once 100 + 0.01953 d < 0.97 (99 + 0.02204 d), d > 2146:
    # not at 5312 (d = 1216), at 6889 (d = 2793). Carried on from 4096 B instead, tree would
    # hold at every size, 1.13x ring's time by 64 KiB.
    m = measured(ring=[10, 10, 30, 100], tree=[5, 5, 20, 99])
    assert ht.rules_from(m, 2) == [
        ("all_reduce", 2, 2, 5312, "tree"),
        ("all_reduce", 2, 2, ht.UNBOUNDED, "ring"),
    ]
    # A line 3% faster only past 8 times the largest size is not followed that far: with ring
    # at 23.5 us at 512 B, ring's line falls below 0.97x tree's only past about 113 KiB.
    far = measured(ring=[10, 10, 23.5, 100], tree=[5, 5, 20, 99])
    assert [r[4] for r in ht.rules_from(far, 2)] == ["tree"]


def test_table_choice_reads_rules_as_the_host_does():
    rules = load_tuning(TUNING_FILE)
    assert ht.table_choice(rules, "all_reduce", 2, 8) == "direct"
    assert ht.table_choice(rules, "all_reduce", 2, 1 << 20) == "ring"
    assert ht.table_choice([], "all_gather", 2, 8) == "ring"  # no rule: ring
    assert ht.table_choice([], "gather", 2, 8) == "direct"  # ... where it exists


def test_fastest_round_of_the_slowest_rank():
    # Two ranks, two sizes, three rounds each. Size 8: the slowest rank per round is 5, 4, 6:
    # 4 counts (not 2, rank 0's best, nor 3, rank 1's: they came in different rounds).
    # Size 64: rounds 7, 3, 9 -> 3.
    a = {"all_reduce": {"bytes": [8, 64], "ring": [[5, 4, 2], [7, 2, 9]]}}
    b = {"all_reduce": {"bytes": [8, 64], "ring": [[3, 4, 6], [1, 3, 1]]}}
    assert ht.slowest([a, b]) == {"all_reduce": {"bytes": [8, 64], "ring": [4, 3]}}


def test_cache_round_trip_and_rejections(tmp_path):
    opts = Options(cache_dir=str(tmp_path))
    key = ht.machine_key(4, opts)
    path = ht.cache_file(opts, key)
    assert path.parent == tmp_path and "4ranks" in path.name
    assert ht.read_cached(path, key) is None  # nothing cached
    rules = [("all_reduce", 4, 4, 100, "direct"), ("all_reduce", 4, 4, ht.UNBOUNDED, "ring")]
    ht.write_cached(path, key, measured(ring=[1, 1, 1, 1]), rules, 0.5)
    assert ht.read_cached(path, key) == rules
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    # Another machine, rank count or staging size: another file, and this one is not read.
    other = ht.machine_key(4, opts.replace(staging_bytes=128 << 10))
    assert ht.cache_file(opts, other) != path and ht.read_cached(path, other) is None
    assert ht.cache_file(opts, ht.machine_key(2, opts)) != path
    path.write_text("{not json")  # a torn or edited file: measured again
    assert ht.read_cached(path, key) is None
    path.write_text(json.dumps({"key": key}))
    assert ht.read_cached(path, key) is None


def test_tuning_setting(tmp_path):
    assert Options.resolve(environ={}).tuning == "auto"
    for value in ("auto", "calibrate", "shipped", " Shipped "):
        assert Options.resolve(environ={"PYCOLL_TUNING": value}).tuning == value.strip().lower()
    table = tmp_path / "t.json"
    table.write_text("{}")
    assert Options.resolve(environ={"PYCOLL_TUNING": str(table)}).tuning == str(table)
    with pytest.raises(ValueError, match="PYCOLL_TUNING='nowhere.json'"):
        Options.resolve(environ={"PYCOLL_TUNING": "nowhere.json"})
    assert Options.resolve(environ={"PYCOLL_CACHE_DIR": "/x"}).cache_dir == "/x"
