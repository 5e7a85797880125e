"""Nodes that share nothing but a network: each node its own Linux namespaces on one machine.

A node here is a network, mount, UTS, IPC and PID namespace: its own interface (``eth0``, one
end of a veth pair whose other end is on a bridge of the root namespace) and address, ``lo``,
its own /dev/shm (a fresh tmpfs), /sys (its own network devices), host name, boot id,
/etc/hosts naming every node, System V IPC and process ids. Shared memory, a segment name,
loopback or another process's memory (process_vm_readv) that reaches another node on the
emulated nodes (PYCOLL_RANKS_PER_NODE, PYCOLL_HOST_ID) reaches nothing here, as between
machines.

The IPC and PID namespaces matter to MPI: with only the network, mount and UTS namespaces, the
pip wheel's MPICH (ch4:ucx) still moved the messages between nodes through memory (a 2 x 2
all-reduce of 1 MiB a rank put 29-45 KB on each veth pair); with either one added, every byte
between nodes crosses the veth pairs (``veth_bytes``, which the tests check). The boot id and
/sys are the node's own too (the communicator names a machine by host name and boot id under
torchrun).

- ``mpiexec`` runs across them through hydra's ssh launcher, with ``enter-node.sh`` in place of
  ssh: it runs each proxy inside the namespaces of the host it names (``mpiexec_args``).
- Any command runs on a node with ``nsenter`` (``command``, ``run``): torchrun's agents.

Making them needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN); where that fails, ``available()`` says
why and the tests fall back to the emulated nodes. PYCOLL_TEST_NO_NAMESPACES=1 takes that path
on purpose. docs/guide/nodes.md ("Nodes that share nothing, on one machine") has the same steps
as commands to paste.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENTER = HERE / "enter-node.sh"
NAMESPACES = ["--net", "--mount", "--uts", "--ipc", "--pid"]  # unshare's
ENTER_FLAGS = ["-n", "-m", "-u", "-i", "-p"]  # nsenter's, the same namespaces
_made = itertools.count()  # sets of nodes this process has made


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
    done = _run("unshare", *NAMESPACES, "--fork", "true", check=False)
    if done.returncode != 0:
        return f"unshare {' '.join(NAMESPACES)} failed: {done.stderr.strip()}"
    return None


def _die_with_parent():
    """In the holder's unshare (preexec_fn): SIGKILL when the process that made it dies, so
    that a killed test run leaves no namespaces behind (unshare --kill-child passes it on)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def remove_stale():
    """Bridges and folders of runs whose process is gone (their holders died with them, and
    the veth pairs with the holders' network namespaces)."""
    for name in re.findall(r"^\d+: (pcbr(\d+)[a-z])[:@]", _run("ip", "-o", "link").stdout, re.M):
        if not Path(f"/proc/{name[1]}").exists():
            _run("ip", "link", "del", name[0], check=False)
    for box in Path(tempfile.gettempdir()).glob("pycoll-netns-*-*"):
        if not Path(f"/proc/{box.name.split('-')[2]}").exists():
            shutil.rmtree(box, ignore_errors=True)


def _free_subnet(pid: int) -> str:
    """A 10.x.y/24 that no interface here has an address in, chosen from the pid."""
    used = _run("ip", "-4", "-o", "addr").stdout
    for k in range(1000):
        i = (pid + k) % (150 * 250)
        subnet = f"10.{100 + i // 250}.{i % 250}"
        if f" {subnet}." not in used:
            return subnet
    raise OSError("no free 10.x.y.0/24 subnet")


def _child(pid: int) -> int:
    """The one child of process `pid` (unshare --fork's: pid 1 of the node's namespace)."""
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            return int(path.parent.name)
    raise OSError(f"unshare ({pid}) has no child")


class NamespaceNodes:
    """`n` namespace nodes on one bridge, named pcn0.. (host names), at addresses .1, .2, ...
    of a /24 of their own (`addresses`); the root namespace is .254 (`gateway`). Names carry
    this process's pid and a letter for each set it makes (bridge pcbr<pid><k>, veth
    pcv<pid><k>h<i>), so concurrent runs and sets do not meet.
    A context manager: on exit every holder process, link and file is gone."""

    def __init__(self, n: int):
        self.n = n
        pid = os.getpid()
        remove_stale()
        self.subnet = _free_subnet(pid)
        tag = self._tag = f"{pid}{chr(ord('a') + next(_made) % 26)}"
        self.bridge = f"pcbr{tag}"
        self.hosts = [f"pcn{i}" for i in range(n)]
        self.pids: list[int] = []  # each node's init (pid 1 inside), what nsenter enters
        self._procs: list[subprocess.Popen] = []
        self._links: list[str] = []
        self._veths = [f"pcv{tag}h{i}" for i in range(n)]
        self.box = Path(tempfile.mkdtemp(prefix=f"pycoll-netns-{pid}-"))
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def addresses(self) -> list[str]:
        return [self.address(i) for i in range(self.n)]

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
            boot_id = self.box / f"boot_id-{i}"
            boot_id.write_text(Path("/proc/sys/kernel/random/uuid").read_text())
            setup = " && ".join([
                "mount -t tmpfs -o size=2g tmpfs /dev/shm",
                "mount -t sysfs sysfs /sys",
                f"mount --bind {boot_id} /proc/sys/kernel/random/boot_id",
                f"mount --bind {hosts} /etc/hosts",
                f"mount --bind {self.box}/resolv.conf /etc/resolv.conf",
                f"hostname {name}",
                f"touch {self.box}/ready-{i}",
                "exec sleep infinity",
            ])  # fmt: skip
            proc = subprocess.Popen(
                ["unshare", *NAMESPACES, "--fork", "--mount-proc", "--propagation", "private",
                 "--kill-child", "sh", "-c", setup],
                start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip
            self._procs.append(proc)
        deadline = time.monotonic() + 10
        while not all((self.box / f"ready-{i}").exists() for i in range(self.n)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                raise OSError("a namespace node did not come up (mount or hostname failed)")
            time.sleep(0.01)
        self.pids = [_child(proc.pid) for proc in self._procs]  # each node's pid 1
        for i, pid in enumerate(self.pids):
            outside, inside = self._veths[i], f"pcv{self._tag}n{i}"
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            self._links.append(outside)
            _run("ip", "link", "set", inside, "netns", pid)
            _run("ip", "link", "set", outside, "master", self.bridge, "up")
            inner = " && ".join([
                "ip link set lo up",
                f"ip link set {inside} name eth0",
                f"ip addr add {self.address(i)}/24 dev eth0",
                "ip link set eth0 up",
                f"ip route add default via {self.gateway}",
            ])  # fmt: skip
            _run("nsenter", "-t", pid, "-n", "sh", "-c", inner)
        (self.box / "nodes").write_text(
            "".join(f"{h} {p}\n" for h, p in zip(self.hosts, self.pids))
        )

    def command(self, i: int, argv: list) -> list:
        """`argv` run inside node i (its network, mounts, host name, IPC and process ids)."""
        return ["nsenter", "-t", str(self.pids[i]), *ENTER_FLAGS, "--", *map(str, argv)]

    def run(self, i: int, argv: list, env: dict | None = None, **popen) -> subprocess.Popen:
        """`argv` started inside node i with `env` (Popen's other arguments as given)."""
        return subprocess.Popen(self.command(i, argv), env=env, **popen)

    def mpiexec_args(self, per_node: int | list) -> list:
        """hydra's options for ranks on these nodes: `per_node` ranks on each (a list: that
        many on node i), each proxy started inside its node by enter-node.sh, which finds
        the nodes through ``env()``; hydra's control port on the bridge's address."""
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

    def host_pid(self, i: int, pid: int) -> int | None:
        """The pid, as this namespace sees it, of the process that node i calls `pid` (None
        when there is none): to signal a process whose pid only its node knows."""
        ns = os.readlink(f"/proc/{self.pids[i]}/ns/pid")
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                line = next(x for x in status.read_text().splitlines() if x.startswith("NSpid:"))
                if line.split()[-1] == str(pid) and os.readlink(status.parent / "ns/pid") == ns:
                    return int(status.parent.name)
            except (OSError, StopIteration):
                continue
        return None

    def placement(self, nranks: int, given: str) -> list | None:
        """The hosts of ``PYCOLL_RANKS_PER_NODE=given`` for `nranks` ranks as
        ``mpiexec_args`` takes them (nodes of k consecutive ranks, or ``k:cyclic``: rank r on
        node r mod (nranks / k), hydra dealing one rank per host in turn), or None when it
        needs more nodes than these or is not a valid value."""
        number, _, layout = given.partition(":")
        if not number.isdigit() or int(number) < 1 or layout not in ("", "cyclic"):
            return None
        k = int(number)
        if layout:
            nodes = max(1, nranks // k)
            return [1] * nodes if nodes <= self.n else None
        counts = [k] * (nranks // k) + ([nranks % k] if nranks % k else [])
        return counts if len(counts) <= self.n else None

    def free_port(self, i: int) -> int:
        """A TCP port free on node i: ports its earlier jobs used (in TIME_WAIT there) are
        not seen from this namespace."""
        probe = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
        return int(_run(*self.command(i, [sys.executable, "-c", probe])).stdout)

    def veth_bytes(self, i: int) -> int:
        """Bytes node i has sent and received over its interface so far (the counters of its
        veth pair's outer end)."""
        stats = Path(f"/sys/class/net/{self._veths[i]}/statistics")
        return sum(int((stats / f).read_text()) for f in ("rx_bytes", "tx_bytes"))

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


def run_on_two(nodes, argv_of, env_of, logs: Path, done, timeout: float) -> list:
    """argv_of(i) with environment env_of(i) on node i of 2 (of `nodes`; None: here, each
    process taken as a node by its environment), its output in logs/node<i>.log, until both
    end or done() holds; the exit statuses (None: still running then, and killed with its
    process group)."""
    procs = []
    for i in range(2):
        log = open(logs / f"node{i}.log", "w")  # noqa: SIM115 - closed below
        popen = dict(env=env_of(i), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        argv = argv_of(i)
        procs.append((nodes.run(i, argv, **popen) if nodes else
                      subprocess.Popen(argv, **popen), log))  # fmt: skip
    codes = []
    try:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            if all(p.poll() is not None for p, _ in procs):
                break
            time.sleep(0.2)
    finally:
        for proc, log in procs:
            codes.append(proc.poll())
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.close()
    return codes


_SHARED: list = []


def shared() -> NamespaceNodes | None:
    """Three namespace nodes for the whole test run, made at the first call (conftest removes
    them at the end), or None where they cannot be made (``available()`` says why)."""
    if available() is not None:
        return None
    if not _SHARED:
        _SHARED.append(NamespaceNodes(3))
    return _SHARED[0]


def close_shared():
    if _SHARED:
        _SHARED.pop().close()
