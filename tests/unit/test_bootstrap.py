"""Launch variables of env:// launches, checked before any rendezvous."""

from __future__ import annotations

import pytest

from pycollectives.errors import CollectiveError
from pycollectives.runtime import bootstrap


def test_env_launch_variables_are_checked():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert bootstrap._env_launch({}) is None
    assert bootstrap._env_launch(env) == (0, 2, "h", 1)
    with pytest.raises(CollectiveError, match="MASTER_PORT not"):
        bootstrap._env_launch({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(CollectiveError, match="out of range"):
        bootstrap._env_launch({**env, "RANK": "2"})
    with pytest.raises(CollectiveError, match="integers"):
        bootstrap._env_launch({**env, "WORLD_SIZE": "two"})
