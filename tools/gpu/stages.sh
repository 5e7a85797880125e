# The GPU run kit's stage runner, sourced by run.sh (and by its tests): a command under a time
# limit that ends with everything it started, the clean-up after every stage, and the result
# files the benchmarks leave.
#
# A stage's command starts ranks (mpiexec and its processes), MPS daemons and their servers.
# `timeout` alone signals only its own child: the ranks of a benchmark killed at its limit
# would run on, holding the GPU, and an MPS daemon whose stage never reached its `quit` would
# outlive the kit. So a stage runs in a session of its own, the whole session is signalled at
# the limit, and every stage, passed, failed or timed out, is followed by clean_up_stage.

# run_limited LIMIT GRACE COMMAND...: runs COMMAND in a new session for at most LIMIT seconds;
# then TERM to every process of the session, GRACE seconds later KILL. Whatever of the session
# is left when COMMAND ends is killed too. Returns COMMAND's status, or 124 when it ran over.
run_limited() {
  local limit=$1 grace=$2
  shift 2
  # Not a process-group leader (a background job of a shell without job control), so setsid
  # makes the session without forking: $! is the session's leader and its id.
  setsid "$@" &
  local pid=$! rc
  local deadline=$((SECONDS + limit))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      kill -TERM -- "-$pid" 2>/dev/null
      local until=$((SECONDS + grace))
      while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$until" ]; do sleep 0.2; done
      kill -KILL -- "-$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      return 124
    fi
    sleep 0.2
  done
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null # what the command left running
  return $rc
}

# The pids of processes whose environment names MPS pipe directory $1 (a daemon and its
# servers: they keep the directory they were started with).
mps_pids() {
  local p
  for p in /proc/[0-9]*; do
    tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qxF "CUDA_MPS_PIPE_DIRECTORY=$1" &&
      echo "${p#/proc/}"
  done
}

# clean_up_stage: asks every MPS daemon the kit's stages and the GPU suite started (pipe
# directories /tmp/pycoll-mps-*/pipe) to quit, kills what of it is left after 10 s
# (KIT_MPS_QUIT_S), removes
# their directories, and removes shared-memory segments of ranks that are gone (the stage's
# session has ended; KIT_SHM_DIR, default /dev/shm). Prints one line of what it did, nothing
# when there was nothing to do.
clean_up_stage() {
  local dir pipe quit=0 killed=0 segments=0 left
  for dir in "${TMPDIR:-/tmp}"/pycoll-mps-*/; do
    pipe=${dir%/}/pipe
    [ -d "$pipe" ] || continue
    if [ -n "$(mps_pids "$pipe")" ]; then
      echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
      quit=$((quit + 1))
      local until=$((SECONDS + ${KIT_MPS_QUIT_S:-10}))
      while [ -n "$(mps_pids "$pipe")" ] && [ "$SECONDS" -lt "$until" ]; do sleep 0.2; done
      left=$(mps_pids "$pipe")
      if [ -n "$left" ]; then
        kill -KILL $left 2>/dev/null
        killed=$((killed + $(echo "$left" | wc -w)))
      fi
    fi
    rm -rf "${dir%/}"
  done
  for dir in "${KIT_SHM_DIR:-/dev/shm}"/pycoll-*; do
    [ -e "$dir" ] || continue
    rm -f "$dir" && segments=$((segments + 1))
  done
  if [ $((quit + killed + segments)) -gt 0 ]; then
    echo "clean-up: $quit MPS daemon(s) asked to quit, $killed MPS process(es) killed," \
      "$segments shared-memory segment(s) removed"
  fi
}

# The commit the files are at: its short hash, "plus changes" where they differ from it (a
# runner may copy the working tree beside an older .git).
commit_of() {
  local commit
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  git diff --quiet HEAD -- 2>/dev/null || commit="$commit plus changes"
  echo "$commit"
}

# result NAME STAGE COMMAND...: runs COMMAND, its output also in OUTDIR/results/NAME.txt
# headed as benchmarks/results/ keeps its files (the GPU and driver, the commit, the stage, the
# command): copied there as they are, the GPU tables of docs/performance.md are made from them
# (benchmarks/gpu_tables.py). NAME's "@" is the GPU's short name (h200).
result() {
  local name=$1 stage=$2 smi gpu file
  shift 2
  smi=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1)
  gpu=$(echo "$smi" | cut -d, -f1 | sed 's/^NVIDIA //' | awk '{print tolower($1)}')
  file=$OUTDIR/results/${name//@/$gpu}.txt
  mkdir -p "$OUTDIR/results"
  {
    echo "$smi" | awk -F', ' '{printf "# %s (%s), driver %s\n", $1, $2, $3}'
    echo "# commit $(commit_of), tools/gpu/run.sh stage $stage, $(date -u +%F)"
    echo "\$ $*"
  } >"$file"
  "$@" 2>&1 | tee -a "$file"
  return "${PIPESTATUS[0]}"
}
