#!/usr/bin/env bash
# The whole test suite on a fresh machine: a virtual environment with the package and its test
# extras (the mpich extra brings mpiexec),
# then pytest (which also runs the MPI suite under mpiexec -n 2 and -n 3).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[mpich,test]'
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$PWD/.venv/numba-cache}"
# two workers, an idle one taking tests from the other: most tests keep one core busy (a
# process, or MPI ranks that mostly wait)
.venv/bin/python -m pytest -q -n 2 --dist worksteal "$@"
