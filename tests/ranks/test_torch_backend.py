"""pycollectives as a torch.distributed backend (see workers/torch_backend.py): every operation
torch sends a backend against gloo in the same job; stock DistributedDataParallel,
ZeroRedundancyOptimizer, FSDP2, tensor parallel and pipelining against gloo; clear errors;
launched by mpiexec and by torchrun."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import netns
from harness.launch import TWO_NODES, clean_env, free_port, run_mpi

WORKER = Path(__file__).parent / "workers" / "torch_backend.py"


def without_ml_dtypes() -> dict:
    """The environment of a worker that cannot import ml_dtypes (as where torch is installed
    without it): tensors of every dtype, bfloat16 included, must move with torch alone."""
    path = [str(WORKER.parent / "no_ml_dtypes"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), "PYCOLL_EXPECT_NO_ML_DTYPES": "1"}


# Every job here runs where ml_dtypes cannot be imported: nothing on torch's paths uses it
# (torchrun's job below runs where it can).
NO_ML_DTYPES = without_ml_dtypes()


@pytest.mark.parametrize("nranks,native", [(2, "1"), (3, "1"), (2, "0")])
def test_every_operation_matches_gloo(nranks, native):
    # native "0": the Python backend alone (what the C++ one hands CUDA tensors and
    # multi-node groups to).
    env = {"PYCOLL_TORCH_NATIVE": native, **NO_ML_DTYPES}
    run_mpi(nranks, "torch_backend.py", "ops", timeout=240, env=env)


def test_operations_and_pipelining_across_nodes_as_on_gloo():
    # 2 nodes x 2 ranks: shared memory inside each, MPI between them (the Python backend
    # serves groups over several nodes). The operations suite, point-to-point and async
    # included, and the pipeline's exchanges against gloo, without ml_dtypes. The training
    # on top (ZeRO, FSDP2, tensor parallel, pipelining, stock DDP) runs across nodes under
    # torchrun below, on the same backend.
    env = {**TWO_NODES, **NO_ML_DTYPES}
    run_mpi(4, "torch_backend.py", "ops,exchange", timeout=300, env=env)


def test_pipeline_exchange_on_three_nodes_as_on_gloo():
    # 3 nodes x 2 ranks: batch_isend_irecv both ways around the ring, every dtype.
    env = {"PYCOLL_RANKS_PER_NODE": "2", **NO_ML_DTYPES}
    run_mpi(6, "torch_backend.py", "exchange", timeout=300, env=env)


@pytest.mark.emulated
@pytest.mark.parametrize(
    "nranks,delay_ms,cases",
    [(2, 1, "device,device_ddp,ops,ddp,errors"), (3, 0, "device")],
)
def test_device_path_on_the_emulated_device(nranks, delay_ms, cases):
    # The C++ backend's CUDA path (device/device_capi.h: calls queued while the host goes on,
    # Work and futures ending when the device's calls do) run on the emulated device, CPU
    # tensors standing for CUDA ones: every native operation goes there and none to the host
    # communicator; on 2 ranks also DDP on the device path, the operations suite, stock DDP
    # and the error cases as on gloo (3 ranks: the device operations). With a delay, each
    # queued call starts late: a result read before its call has ended is wrong.
    env = {
        "PYCOLL_TORCH_DEVICE": "emulated",
        "PYCOLL_EMU_STREAM_DELAY_MS": str(delay_ms),
        **NO_ML_DTYPES,
    }
    run_mpi(nranks, "torch_backend.py", cases, timeout=240, env=env)


@pytest.mark.parametrize("nranks", [2, 4])
def test_stock_ddp_trains_as_on_gloo(nranks):
    run_mpi(nranks, "torch_backend.py", "ddp", timeout=300, env=NO_ML_DTYPES)


@pytest.mark.parametrize("nranks", [2, 4])
def test_zero_fsdp_tensor_parallel_and_pipelining_train_as_on_gloo(nranks):
    run_mpi(nranks, "torch_backend.py", "parallel", timeout=300, env=NO_ML_DTYPES)


@pytest.mark.parametrize("native", ["1", "0"])
def test_unsupported_ops_and_layouts_are_refused_and_errors_named(native):
    run_mpi(2, "torch_backend.py", "errors", env={"PYCOLL_TORCH_NATIVE": native, **NO_ML_DTYPES})


def test_torchrun_with_stock_init_process_group():
    # torch's own init_process_group("pycollectives") under torchrun on one machine, then stock
    # DDP against gloo's (the operations, on the same C++ backend, run under mpiexec above).
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed")
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), str(WORKER)]
    proc = subprocess.run(
        cmd + ["ddp", "stock"], capture_output=True, text=True, timeout=240, env=clean_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_mesh2d_fsdp_by_tensor_parallel_across_nodes_as_on_gloo():
    # 2 nodes x 2 ranks under mpiexec: the data-parallel groups of the mesh span the nodes.
    env = {**TWO_NODES, **NO_ML_DTYPES, "PYCOLL_EXPECT_NODES": "2"}
    run_mpi(4, "torch_backend.py", "mesh2d", timeout=300, env=env)


def torchrun_on_two_nodes(worker, *args, env=None) -> list[str]:
    """`worker` under torchrun --nnodes 2, 2 ranks each; every agent's output. Each agent runs
    on a namespace node of its own (harness/netns.py: its own address, /dev/shm and host name)
    where they can be made, else both on this machine, each taken as a node (PYCOLL_HOST_ID)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed")
    return _torchrun_agents(torchrun, worker, args, env, netns.shared())


def _torchrun_agents(torchrun, worker, args, env, nodes) -> list[str]:
    port = str(free_port() if nodes is None else nodes.free_port(0))
    agents = []
    for node in range(2):
        master = "127.0.0.1" if nodes is None else nodes.address(0)
        cmd = [str(torchrun), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node",
               "2", "--master_addr", master, "--master_port", port,
               str(WORKER.parent / worker), *args]  # fmt: skip
        given = {"PYCOLL_HOST_ID": f"node{node}"} if nodes is None else {}
        agent_env = clean_env(**given, PYCOLL_EXPECT_NODES="2", **NO_ML_DTYPES, **(env or {}))
        if nodes is not None:
            cmd = nodes.command(node, cmd)
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=agent_env))  # fmt: skip
    try:
        outs = [a.communicate(timeout=300)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    for node, (agent, out) in enumerate(zip(agents, outs)):
        assert agent.returncode == 0, f"node {node}:\n{out[-4000:]}"
    return outs


def test_torchrun_over_two_nodes_as_on_gloo():
    # torchrun --nnodes 2 on namespace nodes (or emulated ones): shared memory inside each
    # node, gloo between them. The operations suite, subgroups within and across the nodes,
    # point-to-point, ZeRO, FSDP2, tensor parallel, pipelining, a 2-D mesh and stock DDP,
    # against gloo, through torch's own init_process_group; then DeepSpeed's ZeRO-2 and
    # ZeRO-3 (deepspeed.init_distributed on that group) against the same training in one
    # process.
    cases = ["ops", "exchange", "parallel", "mesh2d", "ddp"]
    deepspeed = importlib.util.find_spec("deepspeed") is not None
    outs = torchrun_on_two_nodes("torch_backend.py", ",".join(cases + ["deepspeed"] * deepspeed),
                                 "stock", env={"DS_ACCELERATOR": "cpu"})  # fmt: skip
    lines = [rf"torch {case} rank=(\d)" for case in cases]
    lines += [rf"deepspeed zero{stage} rank=(\d)" for stage in (2, 3)] * deepspeed
    for line in lines:
        ranks = sorted(r for out in outs for r in re.findall(line, out))
        assert ranks == ["0", "1", "2", "3"], (line, outs)
