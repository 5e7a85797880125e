"""The emulated device's set-up refuses what the CUDA transport would refuse, before anything is
made: bad launch shapes, more ranks than the device segment holds, and a peer list of the
wrong length. No segment is left behind by a refused set-up."""

from __future__ import annotations

import pytest
from harness.launch import our_segments

from pycollectives import _emu


def options(**fields) -> _emu.EmuOptions:
    o = _emu.EmuOptions()
    for name, value in fields.items():
        setattr(o, name, value)
    return o


@pytest.mark.parametrize(
    "fields", [{"nblocks": 0}, {"nblocks": 129}, {"threads": 0}], ids=lambda f: str(f)
)
def test_bad_launch_shape_is_refused(fields):
    before = our_segments()
    with pytest.raises(ValueError, match="bad blocks, threads or slot count"):
        _emu.EmuComm(0, 2, options(**fields))
    assert our_segments() == before


def test_more_ranks_than_the_device_holds_are_refused():
    before = our_segments()
    with pytest.raises(ValueError, match="at most 32 ranks"):
        _emu.EmuComm(0, 33, options())
    assert our_segments() == before


def test_attach_needs_one_segment_per_rank():
    c = _emu.EmuComm(0, 2, options())
    try:
        with pytest.raises(ValueError, match="one device segment and one flag segment per rank"):
            c.attach([c.segment_name], [c.flags_name])
    finally:
        c.unlink()


def test_pycoll_algo_is_the_devices_own_choice():
    # PYCOLL_ALGO reaches the device's resolution (options.algorithm), as on the host: automatic
    # calls run it where the collective has it, the size rule elsewhere.
    plain = _emu.EmuComm(0, 2, options())
    forced = _emu.EmuComm(0, 2, options(algorithm="tree"))
    try:
        assert plain.choose("all_reduce", 1 << 20) == "ring"
        assert plain.choose("all_reduce", 8) == "direct"
        assert forced.choose("all_reduce", 8) == "tree"
        assert forced.choose("broadcast", 1 << 20) == "tree"
        assert forced.choose("all_gather", 8) == "direct"  # no tree: by size
        assert forced.choose("all_gather", 1 << 20) == "ring"
    finally:
        plain.unlink()
        forced.unlink()
    with pytest.raises(ValueError, match="algorithm"):
        options(algorithm="fastest")
