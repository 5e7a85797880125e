#!/usr/bin/env bash
# Follows one blocking all-reduce's call descriptor from HostComm::execute through the functions
# that have it in hand, line by line under gdb, on a debug build of _C; prints its stays, files,
# returns and descents (summary.py). Needs gdb; builds in $CALLPATH_WORK (default /tmp/callpath).
#
#   tools/callpath/run.sh [BYTES ...]      # default: 8 and 1048576
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=$ROOT/.venv/bin/python
WORK=${CALLPATH_WORK:-/tmp/callpath}
mkdir -p "$WORK"
"$ROOT/.venv/bin/cmake" -S "$ROOT" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DPYCOLL_CUDA=OFF -DPYCOLL_NET=OFF -DPYCOLL_TORCH=OFF -DPython_EXECUTABLE="$PY" \
  -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" >"$WORK/configure.log"
"$ROOT/.venv/bin/cmake" --build "$WORK/build" --target _C >"$WORK/build.log"
rm -rf "$WORK/pkg" && mkdir -p "$WORK/pkg"
cp -r "$ROOT/pycollectives" "$WORK/pkg/"
cp "$WORK"/build/_C.*.so "$WORK/pkg/pycollectives/"
export CALLPATH_PKG=$WORK/pkg PYCOLL_TUNING=shipped PYCOLL_TIMEOUT=600
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(8 1048576)
for bytes in "${sizes[@]}"; do
  export CALLPATH_BYTES=$bytes CALLPATH_OUT=$WORK/follow-$bytes.json
  rm -f "$CALLPATH_OUT"
  "$ROOT/.venv/bin/mpiexec" -n 1 gdb -batch -x "$ROOT/tools/callpath/gdb_follow.py" \
    --args "$PY" "$ROOT/tools/callpath/worker.py" : \
    -n 1 "$PY" "$ROOT/tools/callpath/worker.py" >"$WORK/gdb-$bytes.log" 2>&1
  echo "all_reduce of $bytes B, 2 ranks:"
  "$PY" "$ROOT/tools/callpath/summary.py" "$CALLPATH_OUT"
done
