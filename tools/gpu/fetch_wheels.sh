#!/usr/bin/env bash
# Run where the package index is reachable. Downloads what tools/gpu/run.sh installs on a GPU
# machine that has no network access and no MPI library: MPICH (libmpi, mpiexec, mpi.h) and an
# mpi4py wheel that loads it, for CPython 3.12 on x86-64 Linux, into tools/gpu/wheels/ (ignored
# by git; carry it to the GPU machine with the working tree).
#
#     bash tools/gpu/fetch_wheels.sh
#
# Environment: PYTHON (python3), PY_VERSION (3.12), MPICH_VERSION, MPI4PY_VERSION.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
PY_VERSION=${PY_VERSION:-3.12}
# Pinned to the versions `make test` is run with, so the GPU machine runs what CI ran.
MPICH_VERSION=${MPICH_VERSION:-5.0.2}
MPI4PY_VERSION=${MPI4PY_VERSION:-4.1.2}
DEST=tools/gpu/wheels
LIMIT_MIB=64 # what a remote runner carries at most, working tree included

# pip matches manylinux tags exactly, so name every level these wheels are built for: mpich 5
# ships manylinux_2_28 only, mpi4py manylinux1 / manylinux_2_5.
platforms=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
  manylinux_2_5_x86_64 manylinux1_x86_64)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --implementation cp --python-version "$PY_VERSION" "${platforms[@]/#/--platform=}" \
  --dest "$tmp" "mpich==$MPICH_VERSION" "mpi4py==$MPI4PY_VERSION"

# Replace, never add to, what was there: two versions of one package stop the offline install.
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$tmp"/*.whl "$DEST"/

echo "wheels in $DEST:"
total=0
for wheel in "$DEST"/*.whl; do
  size=$(wc -c <"$wheel")
  printf '  %10d  %s\n' "$size" "${wheel##*/}"
  total=$((total + size))
done
echo "total: $total bytes (about $(((total + 524288) / 1048576)) MiB)"
if [ "$total" -gt $((LIMIT_MIB * 1048576 / 2)) ]; then
  echo "warning: over half of the ${LIMIT_MIB} MiB a remote runner carries" >&2
fi
