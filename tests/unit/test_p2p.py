"""What a communicator over several nodes checks before any message leaves: the host path's
checks (_C.check_p2p)."""

import pytest


def test_check_p2p_is_the_host_paths_checks():
    # What a communicator over several nodes runs before any message leaves: the same checks.
    import numpy as np

    from pycollectives import _C

    x = np.zeros(4, np.float32)
    _C.check_p2p([("send", x, 1, 0), ("recv", np.zeros(4, np.float32), 2, 7)], 0, 3)
    with pytest.raises(ValueError, match="peer 0 is not another rank"):
        _C.check_p2p([("send", x, 0, 0)], 0, 3)
    with pytest.raises(ValueError, match="overlaps"):
        _C.check_p2p([("send", x, 1, 0), ("recv", x, 1, 0)], 0, 3)
    with pytest.raises(TypeError, match="numpy"):
        _C.check_p2p([("send", [1.0], 1, 0)], 0, 3)
    with pytest.raises(ValueError, match="read-only"):
        _C.check_p2p([("recv", np.frombuffer(b"abcd", np.uint8), 1, 0)], 0, 3)
