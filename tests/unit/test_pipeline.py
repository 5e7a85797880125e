"""Pipeline parallelism's helpers: the theoretical bubble, splitting a model into stages."""

import pytest

from pycollectives.parallel import nn
from pycollectives.parallel.pipeline import split_stages, theoretical_bubble


def test_theoretical_bubble():
    assert theoretical_bubble(1, 8) == 0
    assert theoretical_bubble(2, 1) == 0.5
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(4, 1000) < 0.003
    for p, m in ((0, 4), (4, 0)):
        with pytest.raises(ValueError, match="p >= 1 stages and m >= 1"):
            theoretical_bubble(p, m)


def test_split_stages_balances_and_keeps_the_layers():
    model = nn.mlp([32, 256, 256, 256, 10])
    stages = split_stages(model, 4)
    assert [len(s.layers) for s in stages] == [2, 2, 2, 1]  # each Linear with its ReLU
    flat = [layer for s in stages for layer in s.layers]
    assert len(flat) == len(model.layers) and all(a is b for a, b in zip(flat, model.layers))
    counts = [sum(p.size for p in s.params) for s in split_stages(model, 2)]
    assert counts == [32 * 256 + 256 + 256 * 256 + 256, 256 * 256 + 256 + 256 * 10 + 10]
    # By parameters the small last layers share a stage; by layers each stage gets as many.
    sizes = [8, 64, 64, 4, 4, 4]
    by_params = split_stages(nn.mlp(sizes), 2)
    assert [len(s.params) // 2 for s in by_params] == [1, 4]
    by_layers = split_stages(nn.mlp(sizes), 2, by="layers")
    assert sorted(len(s.params) // 2 for s in by_layers) == [2, 3]
    assert len(split_stages(model, 1)[0].layers) == len(model.layers)
    lead = nn.Sequential([nn.ReLU(), *nn.mlp([4, 4, 4]).layers])
    assert [len(s.layers) for s in split_stages(lead, 2)] == [3, 1]


def test_split_stages_errors():
    with pytest.raises(ValueError, match="4 layers with parameters cannot fill 5 stages"):
        split_stages(nn.mlp([8, 8, 8, 8, 8]), 5)
    with pytest.raises(ValueError, match="by must be"):
        split_stages(nn.mlp([8, 8]), 1, by="flops")
    with pytest.raises(ValueError, match="at least 1"):
        split_stages(nn.mlp([8, 8]), 0)
