"""What losing a node costs, across machines: 2 nodes x 2 ranks of
``pycollectives.examples.elastic`` (120 steps), both ranks of node 1 killed as step 40 begins.

    python benchmarks/elastic_nodes.py [--repeat 3]      # as root: namespace nodes

- launcher: ``python -m pycollectives.launch -n 2 --elastic --replace 2 --nnodes 2`` on each
  node (``--fail-rank 2,3 --full-size-by 60``): the time from the deaths to the survivors'
  next completed step, and to the world of 4 again (two replacements taken in);
- torchrun: ``torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 0`` on each node
  (``--fail-rank 2``: node 1's agent then stops rank 3): the time from the death to the
  survivors' next completed step (torchrun starts no replacements).

The dying rank writes the time just before it kills itself; the survivors' rank 0 prints the
times since then. The nodes are Linux namespaces on this machine (tests/harness/netns.py:
their own network, /dev/shm, host name, boot id, IPC and process ids), or, without root,
emulated nodes (``PYCOLL_HOST_ID``), said in the output. Medians of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import netns  # noqa: E402 - the test harness's namespace nodes

EXAMPLE = ["-m", "pycollectives.examples.elastic", "--steps", "120", "--fail-at-step", "40"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def env_for(nodes, i: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PYCOLL_RANKS_PER_NODE", "PYCOLL_HOST_ID"))}  # fmt: skip
    return env if nodes else {**env, "PYCOLL_HOST_ID": f"node{i}"}


def run_pair(nodes, argv_of, folder: Path, done) -> str:
    """argv_of(i) on node i of 2 until both end or done(); node 0's output."""
    netns.run_on_two(nodes, argv_of, lambda i: env_for(nodes, i), folder, done, 300)
    return (folder / "node0.log").read_text()


def launcher(nodes) -> tuple[float, float]:
    """(ms to the survivors' next step, s to the world of 4 again)."""
    host = nodes.address(0) if nodes else "127.0.0.1"
    port = str(nodes.free_port(0) if nodes else free_port())
    with tempfile.TemporaryDirectory() as folder:
        args = [*EXAMPLE, "--fail-rank", "2,3", "--full-size-by", "60", "--deaths", folder]

        def argv(i):
            return [sys.executable, "-m", "pycollectives.launch", "-n", "2", "--elastic",
                    "--replace", "2", "--nnodes", "2", "--node-rank", str(i), "--master-addr",
                    host, "--master-port", port, "--", sys.executable, *args]  # fmt: skip

        out = run_pair(nodes, argv, Path(folder), lambda: False)
    step = re.search(r"step 40: done on \d ranks ([0-9.]+) ms after the death", out)
    back = re.findall(r"-> 4 \(\d joined, ([0-9.]+) s after the death\)", out)
    if not step or not back:
        sys.exit(f"the launcher run did not report its recovery:\n{out[-4000:]}")
    return float(step[1]), float(back[-1])


def torchrun(nodes) -> float:
    """ms from the death to the survivors' next step."""
    port = nodes.free_port(0) if nodes else free_port()
    endpoint = f"{nodes.address(0) if nodes else '127.0.0.1'}:{port}"
    with tempfile.TemporaryDirectory() as folder:
        record = Path(folder) / "record.json"
        args = [*EXAMPLE, "--fail-rank", "2", "--deaths", folder, "--record", str(record)]

        def argv(i):
            return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--nproc-per-node", "2", "--max-restarts", "0", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", endpoint, "--rdzv-id", f"bench-{os.getpid()}",
                    "--rdzv-conf", f"is_host={i == 0}".lower(), *args]  # fmt: skip

        # node 0's agent waits at torchrun's exit barrier: done once rank 0 has printed
        log = Path(folder) / "node0.log"
        out = run_pair(nodes, argv, Path(folder), lambda: "test accuracy" in log.read_text())
    step = re.search(r"step 40: done on \d ranks ([0-9.]+) ms after the death", out)
    if not step:
        sys.exit(f"the torchrun run did not report its recovery:\n{out[-4000:]}")
    return float(step[1])


def span(xs, unit: str, digits: int) -> str:
    return (f"{statistics.median(xs):.{digits}f} {unit} (runs "
            + ", ".join(f"{x:.{digits}f}" for x in xs) + ")")  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    why_not = netns.available()
    with netns.NamespaceNodes(2) if why_not is None else _Nothing() as nodes:
        kind = "namespace nodes" if nodes else f"emulated nodes ({why_not})"
        print(f"2 nodes x 2 ranks, {kind}; medians of {args.repeat} runs", flush=True)
        runs = [launcher(nodes) for _ in range(args.repeat)]
        tr = [torchrun(nodes) for _ in range(args.repeat)]
    print(f"launcher, node 1 lost: survivors' next step {span([r[0] for r in runs], 'ms', 1)}")
    print(f"launcher, node 1 lost: world of 4 again {span([r[1] for r in runs], 's', 2)}")
    print(f"torchrun, rank 2 lost (its agent stops rank 3): survivors' next step "
          f"{span(tr, 'ms', 1)}")  # fmt: skip


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
