"""The "pycollectives" torch.distributed backend against gloo in the same job: every operation
torch sends a backend, on every dtype, gives gloo's result (or, where gloo has no such
operation or dtype, the value computed here); stock DistributedDataParallel, ZeRO, FSDP2,
tensor parallel and pipelining (GPipe, 1F1B) train to gloo's parameters.

Usage: mpiexec -n N python torch_backend.py CASE[,CASE...]
       (ops, ddp, parallel, errors, exchange; device and device_ddp: the device path, on
       the GPU, or on the emulated device under PYCOLL_TORCH_DEVICE=emulated)
(or under torchrun, where pycollectives.torch.init_process_group is dist.init_process_group)
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from checks import run_main
from torch_nets import BranchNet

import pycollectives as pc
import pycollectives.torch as pct

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives


# Several emulated nodes (PYCOLL_RANKS_PER_NODE under mpiexec, PYCOLL_HOST_ID under torchrun):
# shared memory inside each; MPI, or gloo under torchrun, between them.
def several_nodes() -> bool:
    """Whether this run's world is over several (emulated) nodes."""
    return pct.communicator().topology.num_nodes > 1


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
]


def value(rank, count, dtype, salt=0):
    """Small integers (exact in every dtype and under every reduction order)."""
    g = torch.Generator().manual_seed(1000 * rank + 7 * count + salt)
    return torch.randint(0, 4, (count,), generator=g).to(dtype)


def same(a, b, what):
    assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {a} != {b}"


def native_calls():
    """Calls the C++ backend has run natively so far (on the host and the device path), or
    None where the Python backend answers (PYCOLL_TORCH_NATIVE=0, several nodes)."""
    if os.environ.get("PYCOLL_TORCH_NATIVE", "1") == "0":
        return None
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    if not backend.native:
        return None
    return backend.host_calls + backend.device_calls


def natively(what, before):
    """Asserts that one call ran natively since `before` (native_calls())."""
    assert before is None or native_calls() == before + 1, f"{what}: not run natively"


def check_ops(gloo):
    r, n = dist.get_rank(), dist.get_world_size()
    for dtype in DTYPES:
        for count in (1, 1000, 70_000):
            x = value(r, count, dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
                a, b = x.clone(), x.clone()
                dist.all_reduce(a, op=op)
                dist.all_reduce(b, op=op, group=gloo)
                same(a, b, f"all_reduce {dtype} {count} {op}")
            a, b = x.clone(), x.clone()
            dist.broadcast(a, n - 1)
            dist.broadcast(b, n - 1, group=gloo)
            same(a, b, f"broadcast {dtype}")
            a, b = x.clone(), x.clone()
            dist.reduce(a, 0)
            dist.reduce(b, 0, group=gloo)
            if r == 0:
                same(a, b, f"reduce {dtype}")
            outs = [torch.empty_like(x) for _ in range(n)]
            before = native_calls()
            dist.all_gather(outs, x)
            natively("all_gather", before)
            for q in range(n):
                same(outs[q], value(q, count, dtype), f"all_gather {dtype}")
            flat = torch.empty(n * count, dtype=dtype)
            dist.all_gather_into_tensor(flat, x)
            same(flat, torch.cat([value(q, count, dtype) for q in range(n)]), "all_gather_into")
            big = value(r, n * count, dtype, salt=1)
            a, b = torch.empty_like(x), torch.empty_like(x)
            dist.reduce_scatter_tensor(a, big)
            want = sum(value(q, n * count, dtype, salt=1) for q in range(n))
            same(a, want[r * count : (r + 1) * count].to(dtype), f"reduce_scatter {dtype}")
            before = native_calls()
            dist.reduce_scatter(b, list(big.chunk(n)))
            natively("reduce_scatter", before)
            same(b, a, f"reduce_scatter list {dtype}")
            a = torch.empty_like(big)
            dist.all_to_all_single(a, big)
            want = torch.cat([value(q, n * count, dtype, salt=1).chunk(n)[r] for q in range(n)])
            same(a, want, f"all_to_all_single {dtype}")
    # Uneven all_to_all_single: rank r sends q + r + 1 rows of 3 to rank q.
    rows = [q + r + 1 for q in range(n)]
    got = [r + q + 1 for q in range(n)]
    x = torch.cat([torch.full((k, 3), float(100 * r + q)) for q, k in enumerate(rows)])
    a = torch.empty(sum(got), 3)
    b = torch.empty(sum(got), 3)
    dist.all_to_all_single(a, x, got, rows)
    dist.all_to_all_single(b, x, got, rows, group=gloo)
    same(a, b, "uneven all_to_all_single")
    outs = [torch.empty(q + 2) for q in range(n)]
    dist.all_to_all(outs, [torch.full((r + 2,), float(10 * r + q)) for q in range(n)])
    for q in range(n):
        same(outs[q], torch.full((q + 2,), float(10 * q + r)), "all_to_all lists")
    gathered = [torch.empty(5) for _ in range(n)] if r == 1 % n else None
    dist.gather(torch.full((5,), float(r)), gathered, dst=1 % n)
    if gathered is not None:
        for q in range(n):
            same(gathered[q], torch.full((5,), float(q)), "gather")
    part = torch.empty(4, dtype=torch.int64)
    dist.scatter(part, [torch.full((4,), q) for q in range(n)] if r == 0 else None, src=0)
    same(part, torch.full((4,), r), "scatter")
    check_async(gloo)
    # Coalesced forms, AVG, bool, objects, futures.
    ts = [value(r, 10, torch.float32), value(r, 3, torch.float32)]
    ws = [t.clone() for t in ts]
    dist.all_reduce_coalesced(ts)
    dist.all_reduce_coalesced(ws, group=gloo)
    for t, w in zip(ts, ws):
        same(t, w, "all_reduce_coalesced")
    a = torch.full((6,), float(r))
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    same(a, torch.full((6,), (n - 1) / 2), "all_reduce AVG")
    b = torch.tensor([r == 0, True, False])
    dist.all_reduce(b)
    same(b, torch.tensor([True, True, False]), "all_reduce bool (or)")
    b = torch.tensor([r == 0, True, False])
    dist.all_reduce(b, op=dist.ReduceOp.MIN)
    same(b, torch.tensor([n == 1, True, False]), "all_reduce bool MIN (and)")
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "blob": "x" * (r * 1000)})
    assert objs == [{"rank": q, "blob": "x" * (q * 1000)} for q in range(n)], objs
    lst = [f"from {r}", r]
    dist.broadcast_object_list(lst, src=n - 1)
    assert lst == [f"from {n - 1}", n - 1], lst
    t = torch.ones(50_000)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    same(fut.wait(), torch.full((50_000,), 2.0 * n), "future chained")
    assert work.is_completed()
    # Point to point: a ring of batch_isend_irecv, and tagged sends received in the other order.
    nxt, prv = (r + 1) % n, (r - 1) % n
    got = torch.empty(7, dtype=torch.int32)
    reqs = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.full((7,), r, dtype=torch.int32), nxt),
            dist.P2POp(dist.irecv, got, prv),
        ]
    )
    for q in reqs:
        q.wait()
    same(got, torch.full((7,), prv, dtype=torch.int32), "batch_isend_irecv")
    if n > 1:
        if r == 0:
            w1 = dist.isend(torch.full((3,), 1.0), 1, tag=1)
            w2 = dist.isend(torch.full((5,), 2.0), 1, tag=2)
            w1.wait()
            w2.wait()
        elif r == 1:
            a, b = torch.empty(5), torch.empty(3)
            dist.recv(a, 0, tag=2)
            dist.recv(b, 0, tag=1)
            same(a, torch.full((5,), 2.0), "recv tag 2")
            same(b, torch.full((3,), 1.0), "recv tag 1")
        check_one_work(r, n)
    # torch's functional collectives (DTensor's) dispatch to the backend from C++.
    import torch.distributed._functional_collectives as funcol

    world = dist.group.WORLD
    same(funcol.all_reduce(torch.ones(4), "sum", world), torch.full((4,), float(n)), "funcol")
    got = funcol.all_gather_tensor(torch.full((2,), float(r)), 0, world)
    same(got, torch.arange(n).repeat_interleave(2).float(), "funcol all_gather_tensor")
    got = funcol.reduce_scatter_tensor(torch.arange(2.0 * n), "sum", 0, world)
    same(got, n * torch.arange(2.0 * r, 2.0 * r + 2), "funcol reduce_scatter_tensor")
    # Subgroups (every rank makes each, as torch requires): the first two ranks, the first and
    # last, and the first three (on nodes of 2 ranks: two on one node, one on the other). Each
    # has the nodes its ranks are on.
    node_of = pct.communicator().topology.node_of
    for members in ([0, 1 % n], [0, n - 1], list(range(min(3, n)))):
        sub = dist.new_group(members)
        if r not in members:
            continue
        nodes = pct.communicator(sub).topology.num_nodes
        assert nodes == len({node_of[q] for q in members}), (members, nodes)
        t = torch.full((4,), float(r + 1))
        dist.all_reduce(t, group=sub)
        want = float(sum(q + 1 for q in set(members)))
        same(t, torch.full((4,), want), f"subgroup {members} all_reduce")
        got = [torch.empty(2) for _ in members]
        dist.all_gather(got, torch.full((2,), float(r)), group=sub)
        same(torch.cat(got), torch.tensor(members).repeat_interleave(2).float(), "subgroup gather")
    dist.barrier()
    print(f"torch ops rank={r}")


def make_model(seed=0):
    torch.manual_seed(seed)
    return BranchNet(12, 4)


def train(ddp, steps, rank, unused=False):
    """`steps` steps of a BranchNet on this rank's data; with `unused`, its extra head only on
    even steps."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randn(16, 12, generator=g) + rank  # ranks see different data
        y = torch.randint(0, 4, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x, use_extra=not unused or step % 2 == 0), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return ddp.module


def check_ddp(gloo):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = dist.get_rank()
    variants = {
        "plain": ({"gradient_as_bucket_view": True}, None, False),
        "unused": ({"find_unused_parameters": True}, None, True),
        "fp16 hook": ({}, hooks.fp16_compress_hook, False),
        "small buckets": ({"bucket_cap_mb": 0.001, "broadcast_buffers": True}, None, False),
    }
    for name, (kwargs, hook, unused) in variants.items():
        models = []
        for group in (None, gloo):
            ddp = DDP(make_model(seed=r), process_group=group, **kwargs)
            if hook is not None:
                ddp.register_comm_hook(group or dist.group.WORLD, hook)
            models.append(train(ddp, 4, r, unused))
        ours, theirs = models
        for (k, p), q in zip(ours.state_dict().items(), theirs.state_dict().values()):
            # fp16 sums of 3+ ranks round differently in another reduction order
            tol = {"rtol": 2e-2, "atol": 2e-3} if "fp16" in name else {"rtol": 1e-5, "atol": 1e-6}
            torch.testing.assert_close(p, q, **tol, msg=f"{name}: {k}")
        # Replicas' parameters agree (BatchNorm's running statistics are each rank's own since
        # the last forward: DDP broadcasts buffers as a forward begins).
        flat = torch.cat([v.double().reshape(-1) for v in ours.parameters()])
        first = flat.clone()
        dist.broadcast(first, 0)
        torch.testing.assert_close(flat, first, msg=f"{name}: replicas differ")
    sampler = torch.utils.data.DistributedSampler(list(range(10)), shuffle=False)
    n = dist.get_world_size()
    padded = list(range(10)) + list(range(10))[: -10 % n]  # wrapped round to even shares
    assert list(sampler) == padded[r::n], list(sampler)
    print(f"torch ddp rank={r}")


def _mesh(group):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group or dist.group.WORLD, "cpu")


def _batches(rank, steps, width=12):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(8, width, generator=g) for _ in range(steps)]


def _mlp(width=12, depth=3):
    torch.manual_seed(0)  # the same on every rank: FSDP and TP expect replicas to start alike
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _full(params):
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]


def _train(model, opt, r):
    """Three optimizer steps on rank `r`'s batches (the loss: the output's mean square); the
    full parameters after."""
    for x in _batches(r, 3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return _full(model.parameters())


def _close(a, b, what):
    for i, (p, q) in enumerate(zip(a, b)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{what}: parameter {i}")


def zero_run(group, r):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(), process_group=group)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2, process_group=group
    )
    return _train(model, opt, r)


def fsdp_run(group, r):
    from torch.distributed.fsdp import fully_shard

    model, mesh = _mlp(), _mesh(group)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train(model, torch.optim.SGD(model.parameters(), lr=0.1), r)


def tp_run(group, r):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 8 * n), torch.nn.ReLU(), torch.nn.Linear(8 * n, 12)
    )
    parallelize_module(model, _mesh(group), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _train(model, opt, 0)  # tensor parallel: every rank sees the same batch


def pipeline_run(group, r, schedule):
    from torch.distributed import pipelining

    n = dist.get_world_size()
    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.Tanh()) for _ in range(n)]
    stage = pipelining.PipelineStage(stages[r], r, n, torch.device("cpu"), group=group)
    cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=4, loss_fn=lambda out, target: (out - target).square().mean())
    opt = torch.optim.SGD(stages[r].parameters(), lr=0.1)
    losses = []
    for x in _batches(0, 2):
        if r == 0:
            sched.step(x)
        elif r == n - 1:
            sched.step(target=torch.zeros_like(x), losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
    return _full(stages[r].parameters()) + ([torch.stack(losses)] if losses else [])


def mesh2d_run(mesh, r):
    """FSDP2 over the mesh's "dp" dimension of a tensor-parallel model over its "tp" one."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _mlp(depth=2)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _train(model, opt, mesh["dp"].get_local_rank())  # a batch per data-parallel replica


def check_mesh2d(gloo):
    """A 2-D DeviceMesh (data parallel x tensor parallel) on 4 ranks made by torch on our
    backend, against the same mesh of gloo groups. Ranks 2k and 2k+1 share a tensor-parallel
    group; over two nodes of two, the data-parallel groups span the nodes."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    r, n = dist.get_rank(), dist.get_world_size()
    assert n == 4, n
    ours = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    node_of = pct.communicator().topology.node_of
    dp = pct.communicator(ours["dp"].get_group())
    assert dp.topology.num_nodes == len({node_of[r], node_of[r ^ 2]}), dp.topology.describe()
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:  # under mpiexec, MPI stays between nodes
        assert dp._group.mpi is not None, "a subgroup under mpiexec without MPI"
    groups = {}
    for name, sets in (("dp", ([0, 2], [1, 3])), ("tp", ([0, 1], [2, 3]))):
        for members in sets:  # every rank makes every group, as torch requires
            g = dist.new_group(members, backend="gloo")
            if r in members:
                groups[name] = g
    theirs = DeviceMesh.from_group(
        [groups["dp"], groups["tp"]], "cpu", mesh=torch.arange(4).view(2, 2),
        mesh_dim_names=("dp", "tp"),
    )  # fmt: skip
    _close(mesh2d_run(ours, r), mesh2d_run(theirs, r), "2-D mesh (FSDP2 x tensor parallel)")
    dist.barrier()
    print(f"torch mesh2d rank={r}")


def check_parallel(gloo):
    """ZeRO, FSDP2, tensor parallel and pipelining on our backend give gloo's parameters."""
    r = dist.get_rank()
    runs = {
        "ZeroRedundancyOptimizer": zero_run,
        "fully_shard": fsdp_run,
        "parallelize_module": tp_run,
        "pipelining GPipe": lambda g, r: pipeline_run(g, r, "gpipe"),
        "pipelining 1F1B": lambda g, r: pipeline_run(g, r, "1f1b"),
    }
    for name, run in runs.items():
        _close(run(None, r), run(gloo, r), name)
        dist.barrier()
    print(f"torch parallel rank={r}")


def check_exchange(gloo):
    """The pipeline exchange: batch_isend_irecv to the next rank and from the previous one
    (and the other way), every dtype, as gloo delivers it; isends waited for only after the
    irecvs. Each round is a few messages: a stuck one would take the timeout."""
    r, n = dist.get_rank(), dist.get_world_size()
    nxt, prv = (r + 1) % n, (r - 1) % n
    t0 = time.monotonic()
    for k, dtype in enumerate(DTYPES):
        got = {}
        for name, group in (("ours", None), ("gloo", gloo)):
            fwd, bwd = torch.empty(1000 + k, dtype=dtype), torch.empty(7, dtype=dtype)
            ops = [
                dist.P2POp(dist.isend, value(r, 1000 + k, dtype, salt=1), nxt, group),
                dist.P2POp(dist.irecv, fwd, prv, group),
                dist.P2POp(dist.isend, value(r, 7, dtype, salt=2), prv, group),
                dist.P2POp(dist.irecv, bwd, nxt, group),
            ]
            for w in reversed(dist.batch_isend_irecv(ops)):
                w.wait()
            got[name] = (fwd, bwd)
        same(got["ours"][0], got["gloo"][0], f"exchange forward {dtype}")
        same(got["ours"][1], got["gloo"][1], f"exchange backward {dtype}")
        same(got["ours"][0], value(prv, 1000 + k, dtype, salt=1), f"exchange value {dtype}")
    sends = [dist.isend(torch.full((5,), float(10 * r + t)), nxt, tag=t) for t in range(3)]
    for t in reversed(range(3)):
        buf = torch.empty(5)
        dist.recv(buf, prv, tag=t)
        same(buf, torch.full((5,), float(10 * prv + t)), f"tag {t} received last-first")
    for w in sends:
        w.wait()
    took = time.monotonic() - t0
    assert took < 20, f"the exchanges took {took:.1f} s: messages waited for the program"
    print(f"torch exchange rank={r}")


def check_one_work(r, n):
    """Every operation answers with one kind of Work (the C++ backend's, for its own calls and
    for those the Python backend runs; the Python backend's where it serves alone), and an
    operation the Python backend runs reports its error through each of that Work's faces."""
    native = os.environ.get("PYCOLL_TORCH_NATIVE", "1") != "0"
    face = "pycollectives._torch.Work" if native else "pycollectives.torch.backend.Work"
    a, b = torch.ones(3), torch.ones(1 << 18)  # run at once; queued
    kinds = {}
    for name, work in (
        ("small", dist.all_reduce(a, async_op=True)),
        ("large", dist.all_reduce(b, async_op=True)),
        (
            "all_to_all",
            dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n), async_op=True),
        ),
        ("barrier", dist.barrier(async_op=True)),
    ):
        work.wait()
        kinds[name] = f"{type(work).__module__}.{type(work).__qualname__}"
    assert set(kinds.values()) == {face}, kinds
    # result(): the outputs, of an operation the Python backend runs too (a gather's list).
    outs = [torch.empty(2) for _ in range(n)] if r == 0 else None
    work = dist.gather(torch.full((2,), float(r)), outs, dst=0, async_op=True)
    work.wait()
    got = work.result()
    assert len(got) == (n if r == 0 else 0), got
    for q, t in enumerate(got):
        same(t, torch.full((2,), float(q)), "gather's Work.result()")
    same(b, torch.full((1 << 18,), float(n)), "one work: large all_reduce")
    # A send that does not fit its receive (in a group of its own, which it leaves unusable):
    # both sides' Works fail, and say why in wait(), exception() and their future.
    pair = dist.new_group([0, 1])
    if r < 2:
        x = torch.ones(8)
        if r == 0:
            work = dist.isend(x, 1, group=pair, tag=9)
        else:
            work = dist.irecv(torch.empty(4), 0, group=pair, tag=9)
        fut = work.get_future()
        for wait, what in ((work.wait, "Work.wait()"), (fut.wait, "its future's wait()")):
            try:
                wait()
            except pc.CollectiveError as e:
                assert "does not fit" in str(e), (what, e)
            else:
                raise AssertionError(f"{what} returned for a send that does not fit its receive")
            assert work.is_completed() and not work.is_success()
            assert "does not fit" in str(work.exception()), work.exception()
    dist.barrier()


def check_async(gloo):
    """Operations of 1 MiB and more run on the communicator's progress thread: results, Work
    and futures as for the small ones, callbacks that issue collectives, several in flight."""
    r, n = dist.get_rank(), dist.get_world_size()
    count = 300_000
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = value(r, count, dtype, salt=2)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, op=dist.ReduceOp.MAX)
        dist.all_reduce(b, op=dist.ReduceOp.MAX, group=gloo)
        same(a, b, f"async all_reduce MAX {dtype}")
        a = x.clone()
        dist.broadcast(a, n - 1)
        same(a, value(n - 1, count, dtype, salt=2), f"async broadcast {dtype}")
        a = x.clone()
        dist.reduce(a, 1 % n)
        if r == 1 % n:
            same(a, sum(value(q, count, dtype, salt=2) for q in range(n)).to(dtype), "async reduce")
        flat = torch.empty(n * count, dtype=dtype)
        dist.all_gather_into_tensor(flat, x)
        same(flat, torch.cat([value(q, count, dtype, salt=2) for q in range(n)]), "async gather")
        part = torch.empty(count // n, dtype=dtype)
        dist.reduce_scatter_tensor(part, x)
        want = sum(value(q, count, dtype, salt=2) for q in range(n)).to(dtype)
        same(part, want.chunk(n)[r], f"async reduce_scatter {dtype}")
        # The list forms: filled before the Work, its future or a completion test says done.
        outs = [torch.empty(count, dtype=dtype) for _ in range(n)]
        work = dist.all_gather(outs, x, async_op=True)
        if dtype is torch.float32:
            work.get_future().wait()
        elif dtype is torch.int64:
            while not work.is_completed():
                time.sleep(0.0005)
        else:
            work.wait()
        for q in range(n):
            same(outs[q], value(q, count, dtype, salt=2), f"async all_gather list {dtype}")
        part2 = torch.empty(count // n, dtype=dtype)
        dist.reduce_scatter(part2, list(x.chunk(n)))
        same(part2, part, f"async reduce_scatter list {dtype}")
    # Several in flight, one dropped unwaited (its tensors stay alive until it is done), and
    # a future whose callback issues collectives itself.
    ts = [torch.full((count,), float(k + r)) for k in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    dist.all_reduce(torch.ones(count), async_op=True)
    fut = dist.all_reduce(torch.ones(count), async_op=True).get_future()

    def then(f):
        small = f.value()[0][:4].clone()
        dist.all_reduce(small)
        return small

    same(fut.then(then).wait(), torch.full((4,), float(n * n)), "callback issuing a collective")
    for k, (w, t) in enumerate(zip(works, ts)):
        w.wait()
        assert w.is_completed() and w.is_success()
        same(t, torch.full((count,), float(n * k + n * (n - 1) / 2)), f"in flight {k}")
    # List all_gathers in flight together: each through a flat tensor of its own.
    lists = [[torch.empty(count) for _ in range(n)] for _ in range(3)]
    works = [dist.all_gather(outs, torch.full((count,), float(10 * k + r)), async_op=True)
             for k, outs in enumerate(lists)]  # fmt: skip
    for k, (w, outs) in enumerate(zip(works, lists)):
        w.wait()
        for q in range(n):
            same(outs[q], torch.full((count,), float(10 * k + q)), f"list all_gather {k} in flight")
    coal = [torch.full((count,), 1.0), torch.full((7,), 2.0)]
    dist.all_reduce_coalesced(coal)
    same(coal[0], torch.full((count,), float(n)), "async all_reduce_coalesced")


def device_path():
    """The device of the C++ backend's device path in this run: the CPU, whose tensors stand
    for CUDA ones on the emulated device (PYCOLL_TORCH_DEVICE=emulated), else this rank's GPU."""
    if os.environ.get("PYCOLL_TORCH_DEVICE", "") == "emulated":
        return torch.device("cpu")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def device_transport_seq(pg, dev):
    """Calls the device path's transport of `pg` (the Python backend) has run."""
    return pg._emulated[0].seq if dev.type == "cpu" else pg.comm._cuda.seq


def host_seq(comm):
    """Calls `comm` has run on host memory."""
    return comm.seq - (comm._cuda.seq if comm._cuda is not None else 0)


def check_device(gloo):
    """The C++ backend's device path: on a GPU (CUDA tensors, on torch's current stream), or on
    the emulated device (PYCOLL_TORCH_DEVICE=emulated, CPU tensors standing for CUDA ones).
    Every operation the C++ backend runs natively goes to the device transport, none to the
    host communicator, and gives gloo's result (gloo on host copies); Work and futures behave
    as on the host path; a mismatch and bad input are refused."""
    r, n = dist.get_rank(), dist.get_world_size()
    dev = device_path()
    backend = dist.group.WORLD._get_backend(dev)
    comm = backend.fallback.comm
    dist.all_reduce(torch.ones(1, device=dev))  # the first makes the transport (collective)
    calls, host_calls = backend.device_calls, host_seq(comm)
    issued = 0

    def on(t):  # a copy on the device (on the CPU too)
        return t.to(dev, copy=True)

    # The last count, 1 MiB or more, is asynchronous on the device: Work's behaviour, which the
    # number of ranks does not change (on 2 ranks; more ranks, the device's schedules, run in
    # test_emulated.py).
    counts = (1, 5000, 300_000) if n == 2 else (1, 5000)
    for dtype in DTYPES:
        for count in counts:
            x = value(r, count, dtype, salt=3)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                a, b = on(x), x.clone()
                dist.all_reduce(a, op=op)
                dist.all_reduce(b, op=op, group=gloo)
                same(a.cpu(), b, f"device all_reduce {dtype} {count} {op}")
            a, b = on(x), x.clone()
            dist.broadcast(a, n - 1)
            dist.broadcast(b, n - 1, group=gloo)
            same(a.cpu(), b, f"device broadcast {dtype} {count}")
            a, b = on(x), x.clone()
            dist.reduce(a, 1 % n)
            dist.reduce(b, 1 % n, group=gloo)
            if r == 1 % n:
                same(a.cpu(), b, f"device reduce {dtype} {count}")
            flat = torch.empty(n * count, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(flat, on(x))
            want = torch.cat([value(q, count, dtype, salt=3) for q in range(n)])
            same(flat.cpu(), want, f"device all_gather_into_tensor {dtype} {count}")
            big = value(r, n * count, dtype, salt=4)
            a, b = torch.empty_like(x, device=dev), torch.empty_like(x)
            dist.reduce_scatter_tensor(a, on(big))
            dist.reduce_scatter_tensor(b, big, group=gloo)
            same(a.cpu(), b, f"device reduce_scatter_tensor {dtype} {count}")
            # The list forms, through a flat tensor.
            outs = [torch.empty(count, dtype=dtype, device=dev) for _ in range(n)]
            dist.all_gather(outs, on(x))
            same(torch.cat([o.cpu() for o in outs]), want, f"device all_gather {dtype} {count}")
            a = torch.empty_like(x, device=dev)
            dist.reduce_scatter(a, [on(t) for t in big.chunk(n)])
            same(a.cpu(), b, f"device reduce_scatter {dtype} {count}")
            issued += 8
    ts = [value(r, 10, torch.float32), value(r, 3, torch.float32)]
    ds = [on(t) for t in ts]
    dist.all_reduce_coalesced(ds)
    dist.all_reduce_coalesced(ts, group=gloo)
    for d, t in zip(ds, ts):
        same(d.cpu(), t, "device all_reduce_coalesced")
    issued += 2
    t = torch.ones(300_000, device=dev)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    same(fut.wait().cpu(), torch.full((300_000,), 2.0 * n), "device future chained")
    work.wait()
    assert work.is_completed() and work.is_success()
    issued += 1
    if dev.type == "cuda":
        # A CUDA future is marked when the calls are queued, its events behind them (on the
        # transport's stream for the large call, the current one for the small): with the GPU
        # busy for a while (a sleep kernel queued first), the host waits for none of it.
        big, small = torch.ones(300_000, device=dev), torch.ones(3, device=dev)
        torch.cuda._sleep(200_000_000)
        start = time.perf_counter()
        futs = [dist.all_reduce(x, async_op=True).get_future() for x in (big, small)]
        dist.all_reduce(torch.ones(7, device=dev))
        queued = time.perf_counter() - start
        assert all(f.done() for f in futs), "a CUDA future waited for the GPU"
        assert queued < 0.05, f"queueing three calls behind a busy GPU took {queued:.3f} s"
        same(futs[0].wait()[0].cpu(), torch.full((300_000,), float(n)), "device future, async")
        same(futs[1].wait()[0].cpu(), torch.full((3,), float(n)), "device future, blocking")
        issued += 3
    assert backend.device_calls - calls == issued, (backend.device_calls - calls, issued)
    assert host_seq(comm) == host_calls, "the host communicator ran a device call"
    ran = device_transport_seq(backend.fallback, dev)
    assert ran == backend.device_calls, f"the device ran {ran} calls of {backend.device_calls}"
    # Ranks that disagree: CollectiveMismatch on every rank, from the call itself where the
    # host finds it (a GPU's stepped mode), else from a wait on it (found by the device: on a GPU
    # in kernel mode, in the launch, the call returning once queued).
    odd = dist.new_group()
    try:
        bad = torch.ones(8 if r == 0 else 16, device=dev)
        work = dist.all_reduce(bad, group=odd, async_op=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        work.wait()
    except pc.CollectiveMismatch as e:
        assert "disagree" in str(e), e
    else:
        raise AssertionError("a mismatch went unnoticed on the device path")
    try:
        dist.all_gather_into_tensor(torch.empty(3 * n + 1, device=dev), torch.ones(3, device=dev))
    except ValueError as e:
        assert "all_gather" in str(e), e
    else:
        raise AssertionError("a wrong output size was accepted on the device path")
    t = torch.ones(5, device=dev)
    dist.all_reduce(t)  # the world is still usable
    same(t.cpu(), torch.full((5,), float(n)), "device all_reduce after the refusal")
    print(f"torch device rank={r}")


def check_device_ddp(gloo):
    """Stock DDP with the model on the device path's device (a GPU, or the emulated device's
    CPU tensors) trains to the parameters gloo's DDP reaches on the CPU; every bucket's
    all-reduce went to the device."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = dist.get_rank()
    dev = device_path()
    backend = dist.group.WORLD._get_backend(dev)
    before = backend.device_calls
    ours = DDP(make_model(seed=r).to(dev), device_ids=None, bucket_cap_mb=0.001)
    theirs = DDP(make_model(seed=r), process_group=gloo, bucket_cap_mb=0.001)
    for ddp in (ours, theirs):
        where = next(ddp.parameters()).device
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(r)
        for _ in range(4):
            x = (torch.randn(16, 12, generator=g) + r).to(where)
            y = torch.randint(0, 4, (16,), generator=g).to(where)
            torch.nn.functional.cross_entropy(ddp(x, use_extra=True), y).backward()
            opt.step()
            opt.zero_grad()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dev.type == "cpu" else {"rtol": 1e-3, "atol": 1e-4}
    for (k, p), q in zip(ours.module.state_dict().items(), theirs.module.state_dict().values()):
        torch.testing.assert_close(p.cpu(), q, **tol, msg=f"device DDP: {k}")
    assert backend.device_calls - before >= 4 * 2, "DDP's buckets did not reach the device"
    print(f"torch device_ddp rank={r}")


def check_errors(gloo):
    r = dist.get_rank()
    for op, words in ((dist.ReduceOp.BAND, "BAND"), (dist.ReduceOp.BXOR, "BXOR")):
        try:
            dist.all_reduce(torch.ones(3, dtype=torch.int32), op=op)
        except ValueError as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"{words} was accepted")
    try:
        dist.all_reduce(torch.ones(4, 4).t())
    except Exception as e:  # torch or the backend: either way a clear refusal
        assert "contiguous" in str(e), e
    else:
        raise AssertionError("a non-contiguous tensor was accepted")
    # init_process_group(timeout=60) and new_group(timeout=...) bound our waits.
    assert pct.communicator().timeout == 60
    short = dist.new_group(timeout=timedelta(seconds=7))
    assert pct.communicator(short).timeout == 7, pct.communicator(short).timeout
    t = torch.ones(5)
    dist.all_reduce(t)  # still usable
    assert (t == dist.get_world_size()).all()
    # A bounded wait on an asynchronous operation whose peer is late: CollectiveTimeout, and
    # the operation goes on to complete.
    big = torch.ones(1 << 20)
    if r == 1:
        time.sleep(1.0)
    work = dist.all_reduce(big, async_op=True)
    if r == 0:
        try:
            work.wait(timeout=timedelta(seconds=0.1))
        except pc.CollectiveTimeout as e:
            assert "not complete after" in str(e), e
        else:
            raise AssertionError("Work.wait(timeout) returned while the peer was late")
    work.wait()
    assert (big == dist.get_world_size()).all()
    # Ranks that disagree: CollectiveMismatch on both, that group unusable, the others fine.
    odd = dist.new_group()
    try:
        dist.all_reduce(torch.ones(8 if r == 0 else 16), group=odd)
    except pc.CollectiveMismatch as e:
        assert "disagree" in str(e), e
    else:
        raise AssertionError("a mismatch went unnoticed")
    try:
        dist.all_reduce(torch.ones(8), group=odd)
    except pc.CollectiveError as e:
        assert "unusable" in str(e), e
    else:
        raise AssertionError("a poisoned group ran a collective")
    dist.all_reduce(t)
    assert (t == dist.get_world_size() ** 2).all()
    # torch's shrink_group: torch refuses it before anything moves (the C++ backend: "does not
    # support shrinking"; the Python one: no device backend to ask). Communicator.shrink is
    # the way (docs/guide/elasticity.md).
    try:
        dist.shrink_group([dist.get_world_size() - 1], group=dist.new_group())
    except (TypeError, RuntimeError) as e:
        assert "support shrinking" in str(e) or "device backend" in str(e), e
    else:
        raise AssertionError("shrink_group worked on a pycollectives group")
    dist.all_reduce(t)  # nothing changed
    assert (t == dist.get_world_size() ** 3).all()
    print(f"torch errors rank={r}")


def main():
    if len(sys.argv) > 2 and sys.argv[2] == "stock":  # torchrun: torch's own call, unchanged
        dist.init_process_group("pycollectives")
    else:
        pct.init_process_group(timeout=60)
    assert dist.get_backend() == "pycollectives", dist.get_backend()
    # The C++ backend serves the groups unless PYCOLL_TORCH_NATIVE=0 asks for the Python one.
    world = dist.group.WORLD
    native = os.environ.get("PYCOLL_TORCH_NATIVE", "1") != "0"
    if native:  # over several nodes, the C++ backend hands every call to the Python one
        native_backend = world._get_backend(torch.device("cpu")).native
        assert native_backend != several_nodes(), "not the C++ backend"
    else:
        assert isinstance(world, pct.backend.ProcessGroup), type(world)
    gloo = dist.new_group(backend="gloo")
    cases = {"ops": check_ops, "ddp": check_ddp, "parallel": check_parallel}
    cases.update(errors=check_errors, exchange=check_exchange, mesh2d=check_mesh2d)
    cases.update(device=check_device, device_ddp=check_device_ddp)
    if "deepspeed" in sys.argv[1]:  # DeepSpeed's ZeRO on the default group (deepspeed_zero.py)
        from deepspeed_zero import check_zero

        cases["deepspeed"] = check_zero
    want_nodes = os.environ.get("PYCOLL_EXPECT_NODES")  # the launch's emulated nodes
    if want_nodes:
        got = pct.communicator().topology.num_nodes
        assert got == int(want_nodes), f"{got} nodes, expected {want_nodes}"
    for case in sys.argv[1].split(","):
        cases[case](gloo)
    if os.environ.get("PYCOLL_EXPECT_NO_ML_DTYPES"):  # the test hid it: make sure it was
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            pass
        else:
            raise AssertionError("ml_dtypes was importable")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
