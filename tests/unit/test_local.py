"""Communicator.local (ranks that are threads of one process) and the single-process
DataParallel built on it, against numpy and one-process training."""

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import pycollectives as pc
from pycollectives.examples.common import batches, classification_data, train_one_process
from pycollectives.parallel import nn
from pycollectives.parallel.data.local import SingleProcessDataParallel


def run_ranks(comms, fn):
    with ThreadPoolExecutor(len(comms)) as pool:
        return list(pool.map(fn, comms))


@pytest.mark.parametrize("n", [2, 3])
def test_local_collectives_match_numpy(n):
    comms = pc.Communicator.local(n, timeout=30)
    inputs = [np.random.default_rng(r).normal(size=1000) for r in range(n)]

    def body(c):
        r = c.rank
        x = inputs[r].copy()
        c.all_reduce(x)
        gathered = np.empty(n * 1000)
        c.all_gather(inputs[r], gathered)
        part = np.empty(10)
        c.reduce_scatter(np.concatenate([inputs[r][:10]] * n), part)
        b = inputs[r][:5].copy()
        c.broadcast(b, root=n - 1)
        big = np.full(1 << 18, float(r))
        work = c.all_reduce(big, op="max", async_op=True)
        ring = np.empty(3)
        c.batch_p2p([pc.P2POp("send", np.full(3, float(r)), (r + 1) % n),
                     pc.P2POp("recv", ring, (r - 1) % n)])  # fmt: skip
        work.wait()
        c.barrier()
        return x, gathered, part, b, big[0], ring

    results = run_ranks(comms, body)
    total = np.sum(inputs, axis=0)
    for r, (x, gathered, part, b, big, ring) in enumerate(results):
        np.testing.assert_allclose(x, total, rtol=1e-12)
        np.testing.assert_array_equal(gathered, np.concatenate(inputs))
        np.testing.assert_allclose(part, n * total[:10] / n, rtol=1e-12)
        np.testing.assert_array_equal(b, inputs[n - 1][:5])
        assert big == n - 1
        np.testing.assert_array_equal(ring, np.full(3, float((r - 1) % n)))
    for c in comms:
        c.close()


def test_local_rejects_bad_sizes():
    for n in (0, -1, 2.0):
        with pytest.raises(ValueError, match="positive number of ranks"):
            pc.Communicator.local(n)


def test_abort_ends_a_wait_on_another_thread():
    comms = pc.Communicator.local(2, timeout=60)
    box = {}

    def waiter():
        t0 = time.perf_counter()
        try:
            comms[1].recv(np.empty(4), 0)  # rank 0 never sends
        except pc.CollectiveError as e:
            box["error"], box["after"] = str(e), time.perf_counter() - t0

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)
    comms[1].abort("stop waiting")
    t.join(20)
    assert not t.is_alive() and box["after"] < 10, box
    with pytest.raises(pc.CollectiveError, match="stop waiting|aborted"):
        comms[1].all_reduce(np.ones(2))
    for c in comms:
        c.close()


@pytest.mark.parametrize("n,name,kw", [(2, "sgd", {"momentum": 0.9}), (3, "adam", {})])
def test_single_process_data_parallel_matches_one_process(n, name, kw):
    sizes, b = [8, 24, 16, 3], 12
    x, y = classification_data(5 * b, 8, 3, seed=2)
    steps = batches(x, y, b)
    dp = SingleProcessDataParallel(nn.mlp(sizes, np.random.default_rng(0)), n, name, 0.05, **kw)
    try:
        for xb, yb in steps:
            dp.step(xb, yb)
        ref = train_one_process(nn.mlp(sizes, np.random.default_rng(0)), steps, name, 0.05, **kw)
        for got, want in zip(dp.model.params, ref):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        # rank 0 sent the parameters to each other rank every step, and received as much
        pbytes = dp.flat_params[0].nbytes
        sent, received = dp.traffic()[0]
        assert sent >= 5 * (n - 1) * pbytes and received >= 5 * (n - 1) * pbytes
        assert all(s < sent for s, _ in dp.traffic()[1:])
        with pytest.raises(ValueError, match="equal parts"):
            dp.step(x[: n * 4 + 1], y[: n * 4 + 1])
    finally:
        dp.close()


def test_a_failing_rank_ends_the_step_promptly():
    comms = pc.Communicator.local(2, timeout=120)
    dp = SingleProcessDataParallel(nn.mlp([4, 6, 3]), 2, "sgd", 0.1, comms=comms)
    x = np.ones((4, 4))
    t0 = time.perf_counter()
    with pytest.raises((IndexError, pc.CollectiveError)):
        dp.step(x, np.array([0, 1, 2, 7]))  # class 7 of 3: rank 0's loss fails
    assert time.perf_counter() - t0 < 30
    dp.close()
    for c in comms:
        c.close()


def test_dp_vs_ddp_example(tmp_path):
    png = tmp_path / "cmp.png"
    proc = subprocess.run(
        [sys.executable, "-m", "pycollectives.examples.dp_vs_ddp", "--ranks", "2",
         "--steps", "2", "--warmup", "1", "--sizes", "16,64,4", "--batch-size", "16",
         "--plot", str(png)],  # fmt: skip
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "matches single-process training: yes" in proc.stdout, proc.stdout
    assert "DataParallel (1 process)" in proc.stdout and "DDP (1 process per rank)" in proc.stdout
    assert png.stat().st_size > 1000


def test_bfloat16_as_tagged_uint16_without_ml_dtypes():
    # arrays.BFLOAT16_BITS: bfloat16 bit patterns in a uint16 array tagged as bfloat16 (how torch
    # tensors are seen); the native layer reduces them as bfloat16, accumulating in float32.
    from pycollectives import _C
    from pycollectives.runtime import arrays

    def bits(values):  # exactly representable in bfloat16: the top half of float32's bits
        f = np.asarray(values, np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(arrays.BFLOAT16_BITS)

    def floats(b):
        return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)

    comms = pc.Communicator.local(2, timeout=30)
    ins = [bits([1.5, -2.0, 0.25, 3.0]), bits([2.25, 0.5, 0.25, -1.0])]

    def body(c):
        x = ins[c.rank].copy()
        c.all_reduce(x)
        out = np.empty(8, arrays.BFLOAT16_BITS)
        c.all_gather(ins[c.rank], out)
        return x, out

    for x, out in run_ranks(comms, body):
        assert arrays.is_bfloat16(x.dtype) and arrays.is_bfloat16(out.dtype)
        np.testing.assert_array_equal(floats(x), [3.75, -1.5, 0.5, 2.0])
        np.testing.assert_array_equal(out, np.concatenate(ins))
    for c in comms:
        c.close()
    assert arrays.describe(ins[0]).dtype_name == "bfloat16"
    assert _C.check_p2p([("send", ins[0], 1, 0)], 0, 2)[0][3] == arrays.DTYPE_CODES["bfloat16"]
    with pytest.raises(TypeError, match="uint16"):  # untagged, it is an unsupported dtype
        _C.check_p2p([("send", ins[0].view(np.uint16), 1, 0)], 0, 2)


def test_local_split_by_parity_with_keys_reversed_and_ranks_left_out():
    comms = pc.Communicator.local(5, timeout=30)

    def body(c):
        r = c.rank
        color = None if r == 4 else r % 2  # rank 4 joins none
        sub = c.split(color, key=-r)
        if sub is None:
            return None
        with sub:
            x = np.full(3, float(r))
            sub.all_reduce(x)
            return sub.rank, sub.size, x[0], sub.all_gather_object(r)

    got = run_ranks(comms, body)
    for c in comms:
        c.close()
    assert got[4] is None
    evens, odds = [2, 0], [3, 1]  # key -r: the highest rank first
    for r in range(4):
        members = evens if r % 2 == 0 else odds
        assert got[r] == (members.index(r), 2, float(sum(members)), members), got[r]


def test_split_refuses_a_color_that_is_not_an_int():
    comms = pc.Communicator.local(2, timeout=5)
    with pytest.raises(TypeError, match="color"):
        comms[0].split(0.5)
    for c in comms:
        c.close()
