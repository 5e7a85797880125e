#!/usr/bin/env bash
# The GPU run kit's one command, for a GPU machine without network access or an MPI library
# whose Python 3.12 already has torch, cupy, mpi4py, pytest and the build tools. Run from the
# repository root, with tools/gpu/wheels/ filled by tools/gpu/fetch_wheels.sh:
#
#     bash tools/gpu/run.sh OUTDIR                  # the first call (see tools/gpu/README.md)
#     bash tools/gpu/run.sh --call second OUTDIR    # the sweeps and the rest of the GPU suite
#     bash tools/gpu/run.sh --dry-run [--call C] OUTDIR   # the stages and their limits
#
# A GPU comes with 15 minutes of machine time in all, so the work is cut into calls of at
# most 5 minutes each (limits plus grace), every one useful on its own:
#   first   env, build (for this GPU's architecture only), paths (every path of the GPU suite
#           once, each with a check of its result: one rank, stepped mode, kernel mode under MPS
#           with auto blocks, a late rank and calls on alternating streams, registered two-shot,
#           LL, graph replay, torch's CUDA tensors, mismatches, 300 shapes past the plan cache
#           with replays between, the event probe), figures (the residency the
#           GPU allows, then 8 B and 128 MiB all-reduces on 2 and 4 ranks in kernel mode,
#           synchronised, back to back and in a graph, registered and not)
#   second  env, build (incremental where the first call's build is still there), bench-2,
#           bench-mps (the sweeps), gpu (the collective matrices, faults, training job)
#   all     env build bench-2 bench-mps train gpu under the old 10-minute limits (by hand)
# Stages, each under its own time limit, each logging into OUTDIR/<stage>.log:
#   env       nvidia-smi, driver, CUDA runtime, torch/cupy/NCCL versions
#   build     a venv (.venv-gpu) on top of the machine's packages, the carried wheels, and
#             `pip install -e .` with the CUDA transport required
#   paths     pytest -m gpu, the tests of one path or protocol each (not the matrices)
#   figures   the key figures under an MPS daemon the stage starts and stops
#   bench-2   benchmarks/gpu_bench.py on 2 ranks sharing the GPU without MPS (stepped mode), its
#             all-reduces up to 1 MiB again by the steps (PYCOLL_CUDA_STEPPED_TWOSHOT=0), on
#             registered buffers, and from 1 MiB with the host waiting for the GPU at every
#             fence (PYCOLL_CUDA_STEPPED_EVENTS=0)
#   bench-mps the benchmark on 2 and then 4 ranks in kernel mode, its small all-reduces again
#             on 2 ranks without the LL format (PYCOLL_CUDA_LL_BYTES=0), and the host's cost of
#             one small call layer by layer (gpu_call_cost.py), all-reduces on registered
#             buffers (two-shot) on 2 ranks, then all-reduces of 32-128 MiB
#             with PYCOLL_CUDA_BLOCKS=auto on 1 MiB and 4 MiB slots, under an MPS daemon it
#             starts and stops
#   train     the training job on the GPU, 4 ranks
#   gpu       the GPU test suite (second call: what paths did not run), last
#   emulated  the emulated-device suite (CI runs it on every change; only when asked)
#   bench-4   the benchmark on 4 ranks in stepped mode (only when asked)
# Every stage runs in a session of its own, killed whole at its limit, and is followed by a
# clean-up (stages.sh): MPS daemons it left are asked to quit (then killed), segments removed.
# OUTDIR/summary.txt gets one line per stage: status, exit code, seconds, limit. A failed stage
# does not stop the next; the exit status is 1 if any failed, 2 on bad usage.
#
# Environment: PYTHON (python3), CALL (first), STAGES (the call's), T_ENV, T_BUILD, T_PATHS,
# T_FIGURES, T_GPU, T_EMULATED, T_BENCH2, T_BENCH4, T_BENCH_MPS, T_TRAIN (limits in seconds),
# BENCH_MAX_BYTES (128M), TRAIN_EPOCHS (3), CUDAARCHS (the GPU's compute capability).
set -u # and no -e: a failed stage must not stop the stages after it

usage() {
  echo "usage: $0 [--dry-run] [--call first|second|all] OUTDIR" >&2
  exit 2
}
DRY_RUN=0
CALL=${CALL:-first}
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    --call)
      [ $# -ge 2 ] || usage
      CALL=$2
      shift
      ;;
    -*) usage ;;
    *) break ;;
  esac
  shift
done
[ $# -eq 1 ] && [ -n "$1" ] || usage
case $CALL in first | second | all) ;; *) usage ;; esac
OUTDIR=$1
if [ "$DRY_RUN" = 0 ]; then
  mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || exit 2 # before the cd below
fi
cd "$(dirname "$0")/../.." || exit 2
. tools/gpu/stages.sh

# The emulated-device suite runs in every CI run, and stepped mode on 4 ranks adds little to
# stepped mode on 2; here they are stages to ask for (STAGES=...). The benchmarks run before the
# GPU suite, so that a suite that runs long never costs the figures. Each call's limits plus
# 5 s of grace per stage add up to at most 300 s (all: 570 s, under the 10 minutes a remote
# runner gives one command).
case $CALL in
  first)
    STAGES=${STAGES:-env build paths figures}
    D_ENV=10 D_BUILD=110 D_PATHS=110 D_FIGURES=50 D_GPU=0 D_BENCH2=0 D_BENCH_MPS=0 D_TRAIN=0
    ;;
  second)
    STAGES=${STAGES:-env build bench-2 bench-mps gpu}
    D_ENV=10 D_BUILD=100 D_PATHS=0 D_FIGURES=0 D_GPU=45 D_BENCH2=45 D_BENCH_MPS=75 D_TRAIN=0
    ;;
  all)
    STAGES=${STAGES:-env build bench-2 bench-mps train gpu}
    D_ENV=15 D_BUILD=95 D_PATHS=110 D_FIGURES=50 D_GPU=130 D_BENCH2=90 D_BENCH_MPS=185 D_TRAIN=25
    ;;
esac
T_ENV=${T_ENV:-$D_ENV}
T_BUILD=${T_BUILD:-$D_BUILD}
T_PATHS=${T_PATHS:-$D_PATHS}
T_FIGURES=${T_FIGURES:-$D_FIGURES}
T_GPU=${T_GPU:-$D_GPU}
T_EMULATED=${T_EMULATED:-120}
T_BENCH2=${T_BENCH2:-$D_BENCH2}
T_BENCH4=${T_BENCH4:-60}
T_BENCH_MPS=${T_BENCH_MPS:-$D_BENCH_MPS}
T_TRAIN=${T_TRAIN:-$D_TRAIN}
GRACE=5 # seconds between SIGTERM and SIGKILL when a stage runs over
BENCH_MAX_BYTES=${BENCH_MAX_BYTES:-128M}
TRAIN_EPOCHS=${TRAIN_EPOCHS:-3}
# The GPU suite's tests of one path or protocol each (the first call), and the rest (the
# second call's gpu stage); tests/gpu/conftest.py runs the path tests first in a whole suite.
PATHS_K="not collective_matrix and not new_collectives and not training_job and not faults \
and not bench_ and not call_cost and not first_use_in_stepped_mode and not reproducible"
if [ "$CALL" = second ]; then GPU_K="not ($PATHS_K)"; else GPU_K=""; fi

# Resolved before the venv's bin goes first on PATH (it has a python3 of its own).
BASE_PYTHON=$(command -v "${PYTHON:-python3}") || {
  echo "no ${PYTHON:-python3} on PATH" >&2
  exit 2
}
VENV=$PWD/.venv-gpu
PY=$VENV/bin/python
MPIEXEC=$VENV/bin/mpiexec # from the mpich wheel; the tests find it beside sys.executable
WHEELS=tools/gpu/wheels
export BASE_PYTHON VENV PY WHEELS MPIEXEC BENCH_MAX_BYTES OUTDIR
# python3's own bin (cmake, ninja) stays reachable when PYTHON names it by path.
PATH="$VENV/bin:$PATH:$(dirname "$BASE_PYTHON"):/usr/local/cuda/bin"
export PATH
export PYTHONUNBUFFERED=1 # a stage killed at its limit still logs everything it printed
export PYCOLL_CUDA=ON     # no nvcc, or a CUDA compile error, fails the build stage
export PYCOLL_EMULATOR=ON # the emulated-device suite (the emulated stage) runs on it
# The benchmark's NCCL baseline runs several ranks on one GPU.
export NCCL_MULTI_RANK_GPU_ENABLE=1
# CMake reads CUDAARCHS: build for the GPU that is here (compute capability 9.0 -> 90).
if [ -z "${CUDAARCHS:-}" ]; then
  CUDAARCHS=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
    head -n 1 | tr -d ' .')
  [[ $CUDAARCHS =~ ^[0-9]+$ ]] || CUDAARCHS=90
fi
export CUDAARCHS

show_env() {
  local rc=0
  nvidia-smi || rc=1
  nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv || rc=1
  nvcc --version || rc=1
  echo "CUDAARCHS=$CUDAARCHS"
  "$BASE_PYTHON" - <<'EOF' || rc=1
import sys


def show(name, describe):
    try:
        print(f"{name}: {describe()}")
    except Exception as e:  # report what is missing, keep going
        print(f"{name}: unavailable ({type(e).__name__}: {e})")


def torch_info():
    import torch

    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    return (f"{torch.__version__}, CUDA {torch.version.cuda}, "
            f"GPU usable {torch.cuda.is_available()}, NCCL {nccl}")


def cupy_info():
    import cupy

    rt = cupy.cuda.runtime
    return (f"{cupy.__version__}, runtime {rt.runtimeGetVersion()}, "
            f"driver {rt.driverGetVersion()}, devices {rt.getDeviceCount()}")


print("python", sys.version.split()[0], sys.executable)
show("torch", torch_info)
show("cupy", cupy_info)
EOF
  return $rc
}

build_package() {
  local wheels=("$WHEELS"/*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    echo "no wheels in $WHEELS: run tools/gpu/fetch_wheels.sh where the package index is"
    echo "reachable, and carry $WHEELS to this machine"
    return 1
  fi
  if [ ! -x "$PY" ]; then
    # --system-site-packages keeps the machine's torch, cupy, NCCL, pytest and build tools.
    # Without ensurepip the venv still gets pip from the machine's packages (below).
    "$BASE_PYTHON" -m venv --system-site-packages "$VENV" ||
      "$BASE_PYTHON" -m venv --system-site-packages --without-pip "$VENV" || return 1
  fi
  # Where python3 is itself a venv (the GPU images keep torch in one), the venv above reaches
  # only the interpreter beneath it: a .pth file adds python3's own site-packages after ours.
  local purelib
  purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || return 1
  "$BASE_PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
    >"$purelib/_gpu_kit_base.pth" || return 1
  # The machine's own mpi4py may be built for another MPI, or be the same version (which pip
  # would then skip): --ignore-installed puts the carried one in the venv, ahead of it.
  "$PY" -m pip install --disable-pip-version-check --no-index --no-deps --ignore-installed \
    "${wheels[@]}" || return 1
  "$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' ||
    return 1
  echo "building with PYCOLL_CUDA=$PYCOLL_CUDA CUDAARCHS=$CUDAARCHS"
  "$PY" -m pip install -v --disable-pip-version-check --no-index --no-deps \
    --no-build-isolation -e . || return 1
  "$PY" -c 'import pycollectives._C, pycollectives._cuda; print("CUDA transport built")' ||
    return 1
  "$PY" -c 'import pycollectives._net' 2>/dev/null ||
    echo "note: pycollectives._net (the inter-node MPI transport) was not built"
}
# Ranks that share a GPU run stepped mode unless MPS is running; kernel mode (one launch per
# collective) needs a daemon, started with private pipe and log directories (under
# /tmp/pycoll-mps-*, where clean_up_stage finds it) and always asked to quit afterwards.
start_mps() {
  local dir
  dir=$(mktemp -d /tmp/pycoll-mps-XXXXXX) || return 1
  export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
}
bench_mps() {
  local rc
  start_mps || return 1
  rc=0
  for n in 2 4; do
    result "gpu_bench-@-${n}ranks-mps" bench-mps env PYCOLL_CUDA_SYNC=kernel "$MPIEXEC" -n $n \
      "$PY" benchmarks/gpu_bench.py --max-bytes "$BENCH_MAX_BYTES" || rc=1
  done
  # The small sizes without the LL format, to set beside the first run's (LL on).
  PYCOLL_CUDA_SYNC=kernel PYCOLL_CUDA_LL_BYTES=0 "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_bench.py \
    --max-bytes 64K --collectives all_reduce || rc=1
  PYCOLL_CUDA_SYNC=kernel "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_call_cost.py || rc=1
  # On registered buffers (comm.empty on the GPU), no staging: the two-shot all-reduce, and
  # all-gather and reduce-scatter reading peers' buffers.
  PYCOLL_CUDA_SYNC=kernel "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_bench.py --registered \
    --max-bytes "$BENCH_MAX_BYTES" --collectives all_reduce,all_gather,reduce_scatter \
    --iters 10 --calls 20 || rc=1
  # torch.distributed on CUDA tensors: the C++ backend's device path against the Python
  # backend and gloo, all-reduces up to 16 MiB and stock DDP.
  PYCOLL_CUDA_SYNC=kernel "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_torch_backend.py \
    --max-bytes 16M --budget 0.3 --steps 5 || rc=1
  # The ring's large all-reduces with a block per SM of each rank's share of the GPU
  # (PYCOLL_CUDA_BLOCKS=auto), with 1 MiB and then 4 MiB slots, beside the first run's 16 blocks.
  for slot in 1M 4M; do
    PYCOLL_CUDA_SYNC=kernel PYCOLL_CUDA_BLOCKS=auto PYCOLL_CUDA_STAGING_BYTES=$((${slot%M} << 20)) \
      "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_bench.py --min-bytes 32M --max-bytes 128M \
      --collectives all_reduce --iters 5 --calls 10 || rc=1
  done
  # The ring's all-reduces from 1 MiB with two messages in flight per channel
  # (PYCOLL_CUDA_LOOKAHEAD=1), beside the first run's (off).
  PYCOLL_CUDA_SYNC=kernel PYCOLL_CUDA_LOOKAHEAD=1 "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_bench.py \
    --min-bytes 1M --max-bytes "$BENCH_MAX_BYTES" --collectives all_reduce --iters 5 \
    --calls 10 || rc=1
  # Messages by writes into the receiver's memory (PYCOLL_CUDA_PUSH=1), small and large,
  # beside the first run's reads of the sender's.
  PYCOLL_CUDA_SYNC=kernel PYCOLL_CUDA_PUSH=1 "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_bench.py \
    --max-bytes "$BENCH_MAX_BYTES" --collectives all_reduce --iters 5 --calls 10 || rc=1
  echo quit | nvidia-cuda-mps-control
  return $rc
}
# The first call's figures, under an MPS daemon of its own (kernel mode on a shared GPU): what
# the residency check finds on this GPU, then 8 B and 128 MiB all-reduces on 2 and 4 ranks,
# synchronised, back to back and in a graph (gpu_bench.py), staged and registered; on 2 ranks
# also registered on first use (cupy's pool, PYCOLL_CUDA_REGISTER_BYTES).
figures() {
  local rc=0 one="--collectives all_reduce --iters 5 --calls 10"
  "$PY" - <<'EOF' || rc=1
from pycollectives import _cuda
from pycollectives.backends.cuda.residency import GpuShare, mps_sm_limit, plan_residency

sms = _cuda.sm_count(0)
share = GpuShare(bytes(_cuda.device_uuid(0)), sms, _cuda.resident_blocks_per_sm(0), mps_sm_limit(sms))
print(f"residency: {sms} SMs, {share.per_sm} blocks of the step kernel per SM")
for n in (1, 2, 4, 8):
    for asked in (0, 16):
        got = plan_residency([share] * n, asked, "kernel")
        print(f"  {n} ranks, PYCOLL_CUDA_BLOCKS={asked or 'auto'}: {got.mode} mode, "
              f"{got.blocks} blocks{'; ' + got.why if got.why else ''}")
EOF
  start_mps || return 1
  for n in 2 4; do
    PYCOLL_CUDA_SYNC=kernel "$MPIEXEC" -n $n "$PY" benchmarks/gpu_bench.py --max-bytes 8 \
      $one || rc=1
    for reg in "" --registered; do
      PYCOLL_CUDA_SYNC=kernel "$MPIEXEC" -n $n "$PY" benchmarks/gpu_bench.py $reg \
        --min-bytes 128M --max-bytes 128M $one || rc=1
    done
  done
  # cupy's pool, nothing registered: registration on first use (off by default until this
  # measures it), against the staged and registered rows above.
  PYCOLL_CUDA_SYNC=kernel PYCOLL_CUDA_REGISTER_BYTES=1M "$MPIEXEC" -n 2 "$PY" \
    benchmarks/gpu_bench.py --min-bytes 128M --max-bytes 128M $one || rc=1
  echo quit | nvidia-cuda-mps-control # and clean_up_stage, should the stage not get here
  return $rc
}
# Stepped mode on 2 ranks: the benchmark, then its all-reduces up to 1 MiB again by the steps
# (PYCOLL_CUDA_STEPPED_TWOSHOT=0), to set beside the first run's all-reduces through scratch; the
# registered collectives (one launch between two fences); and all-reduces from 1 MiB, through
# scratch and registered, with the fences of PYCOLL_CUDA_STEPPED_EVENTS=0 (the host waits for the
# GPU, then meets the peers) beside the first runs' on interprocess events.
bench_stepped() {
  local rc=0 h="--collectives all_reduce --iters 5 --calls 10"
  result gpu_bench-@-2ranks-stepped bench-2 env PYCOLL_CUDA_SYNC=stepped "$MPIEXEC" -n 2 "$PY" \
    benchmarks/gpu_bench.py --max-bytes "$BENCH_MAX_BYTES" || rc=1
  PYCOLL_CUDA_SYNC=stepped PYCOLL_CUDA_STEPPED_TWOSHOT=0 "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_bench.py \
    --max-bytes 1M $h || rc=1
  PYCOLL_CUDA_SYNC=stepped "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_bench.py --registered \
    --max-bytes "$BENCH_MAX_BYTES" --collectives all_reduce,all_gather,reduce_scatter \
    --iters 5 --calls 10 || rc=1
  for reg in "" --registered; do
    PYCOLL_CUDA_SYNC=stepped PYCOLL_CUDA_STEPPED_EVENTS=0 "$MPIEXEC" -n 2 "$PY" \
      benchmarks/gpu_bench.py $reg --min-bytes 1M --max-bytes "$BENCH_MAX_BYTES" $h || rc=1
  done
  # Registered all-gathers by copy engines (PYCOLL_CUDA_COPY_ENGINES=1), beside the kernel's
  # above.
  PYCOLL_CUDA_SYNC=stepped PYCOLL_CUDA_COPY_ENGINES=1 "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_bench.py \
    --registered --min-bytes 16M --max-bytes "$BENCH_MAX_BYTES" --collectives all_gather \
    --iters 5 --calls 10 || rc=1
  return $rc
}
export -f show_env build_package start_mps commit_of result bench_mps bench_stepped figures

SUMMARY=$OUTDIR/summary.txt
FAILED=() # stages that failed, timed out or were skipped
BLOCKED=  # why the stages after the build cannot run, once known

record() { # STAGE STATUS EXIT SECONDS LIMIT
  printf '%-9s %-34s %5s %7s %6s\n' "$@" >>"$SUMMARY"
}

# stage [--none-ok] NAME LIMIT COMMAND...: runs COMMAND for at most LIMIT seconds, output in
# OUTDIR/NAME.log, a line in the summary. --none-ok: pytest's exit 5 (no test carries the
# marker) means there was nothing to run, not a failure. Returns 0 when the stage passed.
stage() {
  local none_ok=0
  if [ "$1" = --none-ok ]; then
    none_ok=1
    shift
  fi
  local name=$1 limit=$2
  shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  if [ "$DRY_RUN" = 1 ]; then
    printf '%-9s %4ss  %s\n' "$name" "$limit" "$*"
    TOTAL=$((TOTAL + limit + GRACE))
    return 0
  fi
  if [ -n "$BLOCKED" ]; then
    record "$name" "skipped ($BLOCKED)" - 0 "$limit"
    FAILED+=("$name")
    return 1
  fi
  local log=$OUTDIR/$name.log start=$SECONDS rc status
  echo "== $name (at most ${limit}s): $log"
  printf '$ %s\n' "$*" >"$log"
  run_limited "$limit" "$GRACE" "$@" >>"$log" 2>&1 </dev/null
  rc=$?
  # Whatever the stage left (an MPS daemon whose quit it never reached, segments of ranks
  # killed at the limit) goes before the next stage; the log says what there was.
  local cleaned
  cleaned=$(clean_up_stage 2>&1)
  [ -n "$cleaned" ] && echo "$cleaned" | tee -a "$log"
  case $rc in
    0) status=ok ;;
    5) [ $none_ok = 1 ] && status="none (no tests with the marker)" || status=failed ;;
    124 | 137) status="timeout" ;;
    *) status=failed ;;
  esac
  record "$name" "$status" "$rc" "$((SECONDS - start))" "$limit"
  echo "   $status"
  case $status in ok | none*) return 0 ;; esac
  FAILED+=("$name")
  return 1
}

TOTAL=0
if [ "$DRY_RUN" = 0 ]; then
  {
    echo "# tools/gpu/run.sh, $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
    echo "# commit $(commit_of), CUDAARCHS=$CUDAARCHS, call: $CALL, stages: $STAGES"
    printf '%-9s %-34s %5s %7s %6s\n' stage status exit seconds limit
  } >"$SUMMARY"
fi

stage env "$T_ENV" bash -c show_env
[ "$DRY_RUN" = 0 ] && [ -f "$OUTDIR/env.log" ] && cat "$OUTDIR/env.log"
stage build "$T_BUILD" bash -c build_package || BLOCKED="build failed"
if [ "$DRY_RUN" = 0 ] && [ -z "$BLOCKED" ] && [ ! -x "$PY" ]; then
  BLOCKED="no .venv-gpu: run the build stage"
fi
# -rP: the output of the tests that print what they measured (the event probe).
stage paths "$T_PATHS" "$PY" -m pytest -m gpu tests -v -ra -rP --durations=10 -k "$PATHS_K"
stage figures "$T_FIGURES" bash -c figures
stage bench-2 "$T_BENCH2" bash -c bench_stepped
stage bench-4 "$T_BENCH4" env PYCOLL_CUDA_SYNC=stepped "$MPIEXEC" -n 4 "$PY" \
  benchmarks/gpu_bench.py --max-bytes "$BENCH_MAX_BYTES"
stage bench-mps "$T_BENCH_MPS" bash -c bench_mps
stage train "$T_TRAIN" "$MPIEXEC" -n 4 "$PY" -m pycollectives.examples.train --device gpu \
  --epochs "$TRAIN_EPOCHS"
stage gpu "$T_GPU" "$PY" -m pytest -m gpu tests -q -ra --durations=10 ${GPU_K:+-k "$GPU_K"}
stage --none-ok emulated "$T_EMULATED" "$PY" -m pytest -m emulated tests -q -ra

if [ "$DRY_RUN" = 1 ]; then
  echo "total     ${TOTAL}s at most (limits plus ${GRACE}s grace each)"
  exit 0
fi
echo
cat "$SUMMARY"
# The end of each failed stage's log, so the reason shows without fetching the files.
for name in "${FAILED[@]}"; do
  if [ -f "$OUTDIR/$name.log" ]; then
    echo
    echo "--- last lines of $name.log ---"
    tail -n 15 "$OUTDIR/$name.log"
  fi
done
[ ${#FAILED[@]} -eq 0 ]
