"""Nodes that share nothing but a network: each node a Linux network, mount and UTS namespace.

A node here has its own network interface and address (a veth pair into a bridge of the root
namespace), its own private /dev/shm (a tmpfs mounted in its own mount namespace), its own host
name and its own /etc/hosts naming every node. Shared memory, a segment name or loopback that
reaches another node on the emulated nodes (PYCOLL_RANKS_PER_NODE, PYCOLL_HOST_ID) reaches
nothing here, as between machines.

- ``mpiexec`` runs across them through hydra's ssh launcher, with ``enter-node.sh`` in place of
  ssh: it runs each proxy inside the namespace of the host it names (``mpiexec_args``).
- Any command runs on a node with ``nsenter`` (``command``): torchrun's agents, one per node.

Making them needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN); where that fails, ``available()`` says
why and the tests fall back to the emulated nodes. PYCOLL_TEST_NO_NAMESPACES=1 takes that path
on purpose. By hand, as root (what ``NamespaceNodes`` runs, for node i of n)::

    ip link add pcbr type bridge && ip addr add 10.77.0.254/24 dev pcbr && ip link set pcbr up
    unshare --net --mount --uts --fork --propagation private \\
        sh -c 'mount -t tmpfs tmpfs /dev/shm && mount --bind HOSTS /etc/hosts &&
               hostname pcn0 && exec sleep infinity' &          # HOSTS: "10.77.0.1 pcn0" ...
    ip link add pcv0h type veth peer name pcv0n && ip link set pcv0n netns $!
    ip link set pcv0h master pcbr up
    nsenter -t $! -n sh -c 'ip link set lo up && ip addr add 10.77.0.1/24 dev pcv0n &&
                            ip link set pcv0n up && ip route add default via 10.77.0.254'
    mpiexec -launcher ssh -launcher-exec tests/harness/enter-node.sh -hosts pcn0,pcn1 -n 4 ...
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENTER = HERE / "enter-node.sh"


def _run(*cmd, check=True):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise OSError(f"{' '.join(map(str, cmd))}: {done.stderr.strip() or done.returncode}")
    return done


def available() -> str | None:
    """None where namespace nodes can be made here; else why not."""
    if os.environ.get("PYCOLL_TEST_NO_NAMESPACES"):
        return "PYCOLL_TEST_NO_NAMESPACES is set"
    if os.geteuid() != 0:
        return "not root: namespaces and veth pairs need CAP_SYS_ADMIN and CAP_NET_ADMIN"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    done = _run("unshare", "--net", "--mount", "--uts", "--fork", "true", check=False)
    if done.returncode != 0:
        return f"unshare --net --mount --uts failed: {done.stderr.strip()}"
    return None


class NamespaceNodes:
    """`n` namespace nodes on one bridge, named pcn0.. (host names), at addresses .1, .2, ...
    of a /24 of their own (`address(i)`); the root namespace is .254. A context manager: on
    exit every holder process, link and file is gone."""

    def __init__(self, n: int):
        self.n = n
        tag = os.getpid() % 100_000
        self.subnet = f"10.{100 + tag // 250 % 100}.{tag % 250}"
        self.bridge = f"pcbr{tag}"
        self.hosts = [f"pcn{i}" for i in range(n)]
        self.pids: list[int] = []
        self._procs: list[subprocess.Popen] = []
        self._links: list[str] = []
        self.box = Path(tempfile.mkdtemp(prefix="pycoll-netns-"))
        self._tag = tag
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.254"

    def _make(self):
        hosts = self.box / "hosts"
        lines = ["127.0.0.1 localhost", f"{self.gateway} {os.uname().nodename} pcroot"]
        lines += [f"{self.address(i)} {h}" for i, h in enumerate(self.hosts)]
        hosts.write_text("\n".join(lines) + "\n")
        # No name server: a lookup of a name not in the hosts file fails at once instead of
        # waiting for a server the nodes cannot reach.
        (self.box / "resolv.conf").write_text("options timeout:1 attempts:1\n")
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, name in enumerate(self.hosts):
            setup = " && ".join([
                "mount -t tmpfs -o size=2g tmpfs /dev/shm",
                f"mount --bind {hosts} /etc/hosts",
                f"mount --bind {self.box}/resolv.conf /etc/resolv.conf",
                f"hostname {name}",
                f"touch {self.box}/ready-{i}",
                "exec sleep infinity",
            ])  # fmt: skip
            proc = subprocess.Popen(
                ["unshare", "--net", "--mount", "--uts", "--fork", "--propagation", "private",
                 "sh", "-c", setup], start_new_session=True,
            )  # fmt: skip
            self._procs.append(proc)
            self.pids.append(proc.pid)
        deadline = time.monotonic() + 10
        while not all((self.box / f"ready-{i}").exists() for i in range(self.n)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                raise OSError("a namespace node did not come up (mount or hostname failed)")
            time.sleep(0.01)
        for i, pid in enumerate(self.pids):
            outside, inside = f"pcv{self._tag}h{i}"[:15], f"pcv{self._tag}n{i}"[:15]
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            self._links.append(outside)
            _run("ip", "link", "set", inside, "netns", pid)
            _run("ip", "link", "set", outside, "master", self.bridge, "up")
            inner = " && ".join([
                "ip link set lo up",
                f"ip addr add {self.address(i)}/24 dev {inside}",
                f"ip link set {inside} up",
                f"ip route add default via {self.gateway}",
            ])  # fmt: skip
            _run("nsenter", "-t", pid, "-n", "sh", "-c", inner)
        (self.box / "nodes").write_text(
            "".join(f"{h} {p}\n" for h, p in zip(self.hosts, self.pids))
        )

    def command(self, i: int, argv: list) -> list:
        """`argv` run inside node i (its network, mounts and host name)."""
        return ["nsenter", "-t", str(self.pids[i]), "-n", "-m", "-u", "--", *map(str, argv)]

    def mpiexec_args(self, per_node: int | list) -> list:
        """hydra's options for ranks on these nodes: `per_node` ranks on each (a list: that
        many on node i), each proxy started inside its node by enter-node.sh."""
        counts = per_node if isinstance(per_node, list) else [per_node] * self.n
        hosts = ",".join(f"{h}:{c}" for h, c in zip(self.hosts, counts) if c)
        return ["-launcher", "ssh", "-launcher-exec", str(ENTER), "-hosts", hosts,
                "-iface", self.bridge]  # fmt: skip

    def env(self) -> dict:
        """What enter-node.sh needs to find the nodes."""
        return {"PYCOLL_NETNS_NODES": str(self.box / "nodes")}

    def shm(self, i: int) -> list[str]:
        """The names in node i's /dev/shm."""
        done = _run(*self.command(i, ["ls", "/dev/shm"]))
        return done.stdout.split()

    def close(self):
        for proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for link in self._links:
            _run("ip", "link", "del", link, check=False)
        shutil.rmtree(self.box, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
