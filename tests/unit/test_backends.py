"""What every backend's set-up shares (pycollectives.backends): one exchange in which every
rank hears of every other rank's failure, and a check that ranks agree on a setting."""

import pytest

from pycollectives.backends import gathered_or_raise, same_on_every_rank
from pycollectives.errors import CollectiveError


class Group:
    """Rank `rank` of a group whose other ranks' contributions to the next allgather are
    given (`others`, by rank)."""

    def __init__(self, rank, others):
        self.rank, self.others = rank, others

    def allgather(self, obj):
        got = dict(self.others)
        got[self.rank] = obj
        return [got[r] for r in range(len(got))]


def test_every_rank_gets_every_value_in_rank_order():
    group = Group(1, {0: ("a", None), 2: ("c", None)})
    assert gathered_or_raise(group, "setting up", "b") == ["a", "b", "c"]


def test_a_failure_on_other_ranks_raises_here_too_naming_each():
    # Rank 0's own step went well; ranks 1 and 2 failed: rank 0 raises all the same.
    group = Group(0, {1: (None, "no space left"), 2: (None, "permission denied")})
    with pytest.raises(CollectiveError) as e:
        gathered_or_raise(group, "cannot set up shared memory", "segment-0")
    assert str(e.value) == (
        "cannot set up shared memory: rank 1: no space left; rank 2: permission denied"
    )


def test_settings_must_be_the_same_on_every_rank():
    same_on_every_rank([(4096, 4)] * 3, "the staging configuration")
    with pytest.raises(ValueError) as e:
        same_on_every_rank([(4096, 4), (8192, 4)], "the staging configuration")
    assert str(e.value) == (
        "ranks disagree on the staging configuration: rank 0: (4096, 4), rank 1: (8192, 4)"
    )
