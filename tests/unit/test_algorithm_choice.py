"""The shipped tuning table that algorithm=None chooses from: well formed."""

from pycollectives.options import TUNING_FILE, load_tuning


def test_shipped_tuning_table_is_well_formed():
    rules = load_tuning(TUNING_FILE)
    assert rules, "no tuning rules shipped"
    for coll, lo, hi, max_bytes, algo in rules:
        assert coll in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
        assert 1 <= lo <= hi and max_bytes > 0
        assert algo in ("ring", "tree", "direct")
        assert algo != "tree" or coll in ("all_reduce", "broadcast", "reduce")
