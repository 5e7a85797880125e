"""Without a GPU, making a CudaComm fails on every rank alike, with the reason, never a hang."""

from checks import run_main
from mpi4py import MPI

from pycollectives.backends.cuda import CudaComm
from pycollectives.errors import CollectiveError


def main():
    comm = MPI.COMM_WORLD
    try:
        CudaComm(comm, comm.rank, comm.size, timeout=10)
    except CollectiveError as e:
        assert "CUDA is not available" in str(e), e
        assert f"rank {comm.size - 1}" in str(e), e
    else:
        raise AssertionError("CudaComm was made without a GPU")
    print(f"cuda_nogpu rank={comm.rank}")


if __name__ == "__main__":
    run_main(main)
