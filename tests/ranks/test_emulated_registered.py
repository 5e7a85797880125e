"""Registered buffers on the emulated device and the two-shot all-reduce over them (csrc/emu/
emu_registry.h, csrc/device/twoshot_kernel.h). See workers/emulated_registered.py."""

import pytest
from harness.launch import run_mpi

pytestmark = pytest.mark.emulated

MODES = ["kernel", "stepped"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_registered_all_reduce(mode, nranks):
    # float32/float64/int32/float16/bfloat16 x sum/max/avg x counts 0, 1, < n, not divisible by
    # n, over several slots; in place and not; views at aligned and unaligned offsets.
    out = run_mpi(nranks, "emulated_registered.py", mode, "matrix")
    assert f"registered matrix {mode} ranks={nranks}" in out, out


@pytest.mark.parametrize("mode,nranks", [("kernel", 2), ("kernel", 4), ("stepped", 3)])
def test_registered_back_to_back_with_late_ranks(mode, nranks):
    out = run_mpi(nranks, "emulated_registered.py", mode, "back_to_back")
    assert f"registered back_to_back {mode} ranks={nranks}" in out, out


def _traffic(nranks, count, part="traffic", names=("twoshot", "ring", "direct"),
             worker="emulated_registered.py", env=None):  # fmt: skip
    """Every rank's counts per algorithm (or collective) of the worker's `part`: {name: {rank:
    (read_own, read_peer, write_own, write_peer)}} (emu Traffic, in bytes)."""
    out = run_mpi(nranks, worker, "kernel", part, str(count), env=env)
    rows = {}
    for line in out.splitlines():
        if line.startswith("TRAFFIC "):
            _, name, rank, *counts = line.split()
            rows.setdefault(name, {})[int(rank)] = tuple(int(v) for v in counts)
    assert set(rows) == set(names) and all(len(r) == nranks for r in rows.values()), out
    return rows


def _shard(count, n, r):
    per = -(-count // n)
    per = -(-per // 16) * 16  # kSliceAlign
    lo = min(r * per, count)
    return min(lo + per, count) - lo


@pytest.mark.parametrize("nranks,count", [(3, 3072), (4, 4100)])
def test_registered_traffic(nranks, count):
    """The bytes an all-reduce of S bytes on n ranks moves, counted by the emulated device: every
    data load and store of the device code (16-byte words and single elements; not flags, call
    headers or LL words, and LL is off here), by whose memory it touches: the rank's own (its
    segment, input, output) or a peer's (a peer's segment or registered buffers). float32.

    Two-shot over registered buffers: rank r reads shard r (s_r bytes) of every rank's input and
    writes it into every rank's output: read_own = s_r, read_peer = (n-1) s_r, write_own = s_r,
    write_peer = (n-1) s_r; 2 n s_r per rank, and since the shards tile the message, 2nS in all.
    Worked: n = 3, count = 3072, S = 12288 B; shards of 1024 elements (a multiple of 16),
    s_r = 4096 B: each rank reads 4096 own + 8192 peer and writes 4096 own + 8192 peer = 24576
    B = 2S; 3 ranks: 73728 B = 2 * 3 * 12288. With count = 4100 on 4 ranks the shards are 1040,
    1040, 1040 and 980 elements: uneven per rank, still 2nS in all.

    For comparison, on plain arrays (staged through slots; no rank writes a peer's memory):
    ring: own input read once (S), 2(n-1) chunks read from peers' slots, 2(n-1) chunks written
    to slots and S to the output: 2(3n-2)S in all (n = 3: 14S = 172032 B against two-shot's 6S).
    one-shot (direct, below PYCOLL_ONESHOT_BYTES): each rank writes its input to a slot (read S,
    write S), reads every peer's ((n-1)S from peers), its own input again and writes the output:
    read_own 2S, read_peer (n-1)S, write_own 2S per rank."""
    n, S = nranks, 4 * count
    rows = _traffic(n, count)
    two = rows["twoshot"]
    for r in range(n):
        s = 4 * _shard(count, n, r)
        assert two[r] == (s, (n - 1) * s, s, (n - 1) * s), (r, two[r])
    assert sum(sum(t) for t in two.values()) == 2 * n * S
    ring = rows["ring"]
    assert all(t[3] == 0 for t in ring.values()), ring
    assert all(t[0] == S for t in ring.values()), ring
    assert sum(t[1] for t in ring.values()) == 2 * (n - 1) * S, ring
    assert sum(t[2] for t in ring.values()) == n * S + 2 * (n - 1) * S, ring
    assert sum(sum(t) for t in ring.values()) == 2 * (3 * n - 2) * S
    for r, t in rows["direct"].items():
        assert t == (2 * S, (n - 1) * S, 2 * S, 0), (r, t)


@pytest.mark.parametrize("mode", MODES)
def test_registered_mismatch(mode):
    # On the count (both registered), and on registering (one rank passes a plain array): both
    # ranks raise CollectiveMismatch; checked in the worker, on every rank.
    out = run_mpi(2, "emulated_registered.py", mode, "mismatch")
    assert f"registered mismatch {mode} ranks=2" in out, out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", ["dies_mid", "stalls_mid"])
def test_registered_peer_fails_mid_call(mode, what):
    # Rank 1 runs none of its second two-shot call, and dies or stalls past the 1.5 s timeout.
    out = run_mpi(3, "emulated_registered.py", mode, what, own_job=True,
                  mpiexec_args=("-disable-auto-cleanup",))  # fmt: skip
    raised = ["RAISED" + part.split("\n")[0] for part in out.split("RAISED")[1:]]
    assert len(raised) == 2, out  # both survivors
    for line in raised:
        if what == "dies_mid":
            assert "CollectiveError" in line and "rank 1" in line and "no longer running" in line
        else:
            assert "CollectiveTimeout" in line and "rank 1" in line, line
            assert float(line.split(" after ")[1].split("s:")[0]) < 6, line


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nranks", [2, 3])
def test_registered_other_collectives(mode, nranks):
    # reduce-scatter, all-gather, broadcast and reduce reading peers' registered buffers:
    # every dtype, op and root, counts from 1 to several blocks' slices, in place and not.
    out = run_mpi(nranks, "emulated_registered.py", mode, "others")
    assert f"registered others {mode} ranks={nranks}" in out, out


@pytest.mark.parametrize("nranks,count", [(3, 1024), (4, 1001)])
def test_registered_traffic_of_other_collectives(nranks, count):
    """The bytes each collective moves on registered buffers (counted as in
    test_registered_traffic), `count` float32 elements per rank's block, B = 4 count bytes:

    reduce-scatter: rank r reads block r of every rank's input (B own, (n-1)B from peers) and
    writes its own output (B): (B, (n-1)B, B, 0).
    all-gather: rank r reads every rank's input and writes its own n-block output:
    (B, (n-1)B, nB, 0).
    broadcast from rank 0: the root moves nothing; every other rank reads the root's B and
    writes its own: (0, B, B, 0).
    reduce to rank 0: rank r reads shard r (s_r bytes, as the two-shot's) of every input and
    writes it into the root's output: (s_r, (n-1)s_r, s_r, 0) on the root, (s_r, (n-1)s_r, 0,
    s_r) elsewhere.
    Worked: n = 3, count = 1024, B = 4096: reduce-scatter (4096, 8192, 4096, 0) per rank;
    all-gather (4096, 8192, 12288, 0); broadcast (0, 4096, 4096, 0) off the root; reduce's
    shards 352, 352 and 320 elements (1024/3 rounded up to 16): s = 1408, 1408, 1280 B.
    Nothing goes through a staging slot: each moves the least its result needs."""
    n, B = nranks, 4 * count
    names = ("reduce_scatter", "all_gather", "broadcast", "reduce")
    rows = _traffic(n, count, "traffic_others", names)
    if (n, count) == (3, 1024):
        assert [4 * _shard(count, n, r) for r in range(n)] == [1408, 1408, 1280]
    for r in range(n):
        s = 4 * _shard(count, n, r)
        assert rows["reduce_scatter"][r] == (B, (n - 1) * B, B, 0), rows["reduce_scatter"]
        assert rows["all_gather"][r] == (B, (n - 1) * B, n * B, 0), rows["all_gather"]
        want = (0, 0, 0, 0) if r == 0 else (0, B, B, 0)
        assert rows["broadcast"][r] == want, rows["broadcast"]
        want = (s, (n - 1) * s, s, 0) if r == 0 else (s, (n - 1) * s, 0, s)
        assert rows["reduce"][r] == want, rows["reduce"]


def test_push_traffic():
    """PYCOLL_CUDA_PUSH=1 moves the ring's bytes to other places, not other amounts: every
    message a rank receives is in its own memory (its peers wrote it there), so no rank reads
    a peer's memory; what pull reads from peers, push writes into them. Worked: n = 3, count
    = 3072 float32 (S = 12288 B): pull, each rank reads 12288 own + 16384 peer and writes 28672
    own; push, it reads 28672 own and writes 12288 own + 16384 peer (the 2(n-1) = 4 chunks of
    S/n = 4096 B). The one-shot (direct) still reads its peers' broadcast slots."""
    n, count = 3, 3072
    pull = _traffic(n, count)
    push = _traffic(n, count, env={"PYCOLL_CUDA_PUSH": "1"})
    for r in range(n):
        ro, rp, wo, wp = pull["ring"][r]
        assert push["ring"][r] == (ro + rp, 0, wo - rp, rp) == (28672, 0, 12288, 16384), r
        assert push["twoshot"][r] == pull["twoshot"][r] and push["direct"][r] == pull["direct"][r]
