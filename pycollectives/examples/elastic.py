"""Elastic data-parallel training: a rank dies, the others finish the step and go on; a
replacement joins and the world grows back. No restart, no checkpoint file, no step lost.

    python -m pycollectives.launch -n 4 --elastic --replace 1 -- \\
        python -m pycollectives.examples.elastic [--steps 120] [--fail-rank 2 --fail-at-step 40]

The two-layer MLP of ``pycollectives.examples.train`` on scikit-learn's digits, its gradients
averaged by ``pc.DataParallel``, with a global batch of ``--batch-size`` samples per step
whatever the number of ranks (``pc.GlobalBatchSampler``: each rank takes its share of the
step's samples, and weights its gradient so that the average over the ranks is the mean over
the step's samples).

Each step ends with ``Communicator.agree``: it is applied only when every rank still running
had its all-reduce complete. When a rank dies, the all-reduce fails on the others (the dead
rank is seen within milliseconds; the first to see it revokes the communicator, so that ranks
waiting on a live peer stop too), the survivors shrink the communicator and do the same step
again with the batch split among fewer ranks (``DataParallel.rebind``). At each step boundary
the ranks take in any process waiting to join (``Communicator.grow``: the launcher's
replacements) and rank 0 sends it the parameters, the momentum and the step. Each change of
world size is printed with its step, and the time from the death to the survivors' next
completed step.

``--fail-rank R --fail-at-step S`` makes rank R (each of R1,R2,... for a list) kill itself
(SIGKILL) as step S begins, once; with ``--fail-late``, once its gradients are averaged. A
rank that dies late in a step has sent its whole share: the step may then complete on the
others, and the survivors shrink at the next collective that needs the dead rank (a step
boundary's included).

Across machines, under ``pycollectives.launch --elastic --nnodes M`` (replacements too) or
torchrun (survivors only: torchrun's agents cannot add a process to a running job), the same
code runs over the rendezvous store (``--deaths DIR``, a folder every machine sees, for the
recovery time).

``--record FILE``: rank 0 writes, at the end, the world size of every step and the final
parameters, which ``replay`` reproduces in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import pycollectives as pc
from pycollectives.examples.common import digits_split
from pycollectives.examples.train import MLP


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=64, help="samples per step, all ranks")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fail-rank",
        type=lambda text: [int(r) for r in text.split(",")],
        default=[],
        metavar="R[,R...]",
        help="these ranks kill themselves (e.g. 2,3: a whole node of 2 ranks)",
    )
    ap.add_argument("--fail-at-step", type=int, default=None)
    ap.add_argument(
        "--fail-late", action="store_true", help="die once the step's gradients are averaged"
    )
    ap.add_argument(
        "--deaths",
        default=None,
        metavar="DIR",
        help="a dying rank writes its time of death here (default: the launcher's folder)",
    )
    ap.add_argument("--record", default=None, help="rank 0 writes sizes and parameters here")
    ap.add_argument(
        "--full-size-by",
        type=int,
        default=None,
        metavar="STEP",
        help="at this step, wait for replacements until the world has its first size again",
    )
    return ap.parse_args(argv)


class Trainer:
    """The model, its momentum, the data and the step: the state a joining rank receives."""

    def __init__(self, args):
        self.args = args
        (self.x, self.y), self.test = digits_split(args.seed)
        self.x = self.x.astype(np.float32)
        self.model = MLP(self.x.shape[1], args.hidden, 10, np.random.default_rng(args.seed))
        self.momentum = [np.zeros_like(p) for p in self.model.params]
        self.batches = pc.GlobalBatchSampler(len(self.x), args.batch_size, args.seed)
        self.dp = None  # DataParallel over the communicator of the moment
        self.step = 0
        self.sizes = []  # world size of each committed step
        self.first_size = None  # the job's size when it started
        self.pending_death = None  # when the rank the last shrink left out died (time.time())
        self.last_death = None  # the same, kept after the next step (rank 0's)

    def gradient(self, step: int, rank: int, world: int, grads, ready=lambda i: None):
        """This rank's share of step `step`'s gradient into `grads`, weighted so that the
        average over the ranks is the mean over the step's samples."""
        share, weight = self.batches.share(step, rank, world)
        w = np.float32(weight)

        def scaled(i):
            grads[i] *= w
            ready(i)

        if len(share):
            self.model.loss_and_backward(self.x[share], self.y[share], grads, scaled)
        else:  # more ranks than samples: nothing to add
            for i, g in enumerate(grads):
                g[...] = 0
                ready(i)

    def apply(self, grads):
        for p, m, g in zip(self.model.params, self.momentum, grads):
            m *= np.float32(self.args.momentum)
            m += g
            p -= np.float32(self.args.lr) * m

    def flat_params(self) -> np.ndarray:
        return np.concatenate([p.reshape(-1) for p in self.model.params])

    def accuracy(self) -> float:
        x, y = self.test
        _, logits = self.model.forward(x.astype(np.float32))
        return float((logits.argmax(axis=1) == y).mean())


def replay(args, sizes: list) -> np.ndarray:
    """The same training in one process, step s's batch split into sizes[s] shares as the job
    split it: the parameters the job should end with (up to float rounding: the job sums the
    shares in the all-reduce's order)."""
    t = Trainer(args)
    grads = [np.zeros_like(p) for p in t.model.params]
    for step, world in enumerate(sizes):
        total = [np.zeros_like(p) for p in t.model.params]
        for r in range(world):
            t.gradient(step, r, world, grads)
            for a, g in zip(total, grads):
                a += g
        t.apply([a / np.float32(world) for a in total])
    return t.flat_params()


def hand_over(comm, t: Trainer, wait=None) -> bool:
    """Rank 0's momentum and progress to every rank of `comm` (a grown communicator: the
    newcomers; the parameters came with DataParallel), with whether the ranks are waiting at
    this step boundary for more (`wait`, rank 0's)."""
    t.step, t.sizes, t.first_size, wait = comm.broadcast_object(
        (t.step, t.sizes, t.first_size, wait), root=0
    )
    for m in t.momentum:
        comm.broadcast(m, root=0)
    return wait


def boundary(comm, t: Trainer, wait: bool, joined: bool = False):
    """A step boundary: takes in whoever waits to join (Communicator.grow), and, with `wait`,
    looks again until the world has its first size (rank 0 decides, for every rank, whether
    to look again, up to the timeout). A rank that just `joined` comes in where the others
    were when they took it in. The communicator to go on with."""
    deadline = time.monotonic() + comm.timeout
    try:
        while True:
            grown = None if joined else comm.grow()
            joined = False
            if grown is not None:
                if grown.rank == 0:
                    since = "" if t.last_death is None else (
                        f", {time.time() - t.last_death:.2f} s after the death")  # fmt: skip
                    print(f"step {t.step}: world {comm.size} -> {grown.size} "
                          f"({grown.size - comm.size} joined{since})", flush=True)  # fmt: skip
                comm.close()
                comm = grown
                t.dp.rebind(comm)  # the parameters, to the newcomers
                hand_over(comm, t, wait)
            if not wait:
                return comm
            again = comm.size < t.first_size and time.monotonic() < deadline
            if not comm.broadcast_object(again if comm.rank == 0 else None, root=0):
                return comm
            time.sleep(0.005)
    except pc.CollectiveError:  # a rank died meanwhile: the next step fails on every rank,
        comm.revoke()  # and the survivors shrink there
        return comm


def die(deaths):
    """SIGKILL, once the time of death is written (in folder `deaths`) for the survivors'
    recovery time."""
    if deaths:
        Path(deaths, f"died-{os.getpid()}").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def died_at(pid_file: Path):
    try:
        return float(pid_file.read_text())
    except (OSError, ValueError):
        return None


def train(args) -> int:
    joining = bool(os.environ.get("PYCOLL_JOIN"))
    rendezvous = os.environ.get("PYCOLL_RENDEZVOUS")
    elastic = bool(rendezvous or os.environ.get("PYCOLL_ELASTIC"))  # replacements may come
    started = float(os.environ.get("PYCOLL_STARTED_AT", time.time()))  # set by the launcher
    comm = pc.Communicator(timeout=60)
    t = Trainer(args)
    t.dp = pc.DataParallel(comm, t.model.params)  # rank 0's parameters, everywhere
    if joining:
        wait = hand_over(comm, t)
        print(f"rank {comm.rank}: joined at step {t.step} as rank {comm.rank} of {comm.size}, "
              f"{time.time() - started:.2f} s after its process started", flush=True)  # fmt: skip
        if elastic:
            comm = boundary(comm, t, wait, joined=True)
    else:
        t.first_size = comm.size
        hand_over(comm, t)
    me_first = None if joining else comm.rank  # the rank this process started as
    deaths = args.deaths or rendezvous
    shrunk = False  # the communicator is new: DataParallel is rebound to it within the step
    while t.step < args.steps:
        step, world, dp = t.step, comm.size, t.dp
        dies = me_first in args.fail_rank and step == args.fail_at_step
        if dies and not args.fail_late:
            die(deaths)
        ok = 1
        try:
            if shrunk:  # in the step: a rank lost meanwhile fails it like any other
                dp.rebind(comm, sync_params=False)  # the survivors' parameters agree already
                shrunk = False
            t.gradient(step, comm.rank, world, dp.grads, dp.mark_ready)
            dp.synchronize()
            if dies:
                die(deaths)
        except pc.CollectiveError as e:
            ok, why = 0, e
            comm.revoke()  # ranks waiting on a live peer stop too
        if comm.agree(ok) != 1:  # some rank's step failed: shrink, the same step again
            old = comm
            comm = old.shrink()
            old.close()
            shrunk = True
            lost = sorted(set(range(old.size)) - set(comm.previous_ranks))
            times = [died_at(p) for p in Path(deaths).glob("died-*")] if deaths else []
            if comm.rank == 0:
                print(f"step {step}: world {old.size} -> {comm.size} (rank(s) {lost} of "
                      f"{old.size} gone: {why if ok == 0 else 'seen by a peer'})",
                      flush=True)  # fmt: skip
            t.pending_death = max((d for d in times if d is not None), default=None)
            t.last_death = t.pending_death
            continue
        t.apply(dp.grads)
        t.sizes.append(world)
        t.step += 1
        death = t.pending_death
        if death is not None and comm.rank == 0:
            print(f"step {step}: done on {world} ranks "
                  f"{(time.time() - death) * 1e3:.1f} ms after the death", flush=True)  # fmt: skip
        t.pending_death = None
        if elastic:  # at --full-size-by, wait for replacements
            comm = boundary(comm, t, t.step == args.full_size_by and comm.size < t.first_size)
    flat = t.flat_params()
    first = flat.copy()
    comm.broadcast(first, root=0)
    if not np.array_equal(first, flat):
        print(f"rank {comm.rank}: parameters differ from rank 0's", file=sys.stderr)
        return 1
    if comm.rank == 0:
        print(f"{args.steps} steps, world sizes {sorted(set(t.sizes))}, "
              f"test accuracy {t.accuracy():.4f}", flush=True)  # fmt: skip
        if args.record:
            Path(args.record).write_text(json.dumps({"sizes": t.sizes, "params": flat.tolist()}))
    comm.close()
    return 0


def main(argv=None) -> int:
    return train(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
