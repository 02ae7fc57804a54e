#!/usr/bin/env bash
# The whole test suite on a fresh machine: a virtual environment with the package and its test
# extras (the mpich extra brings mpiexec),
# then pytest (which also runs the MPI suite under mpiexec -n 2 and -n 3).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[mpich,test]'
# the package's and the test helpers' bytecode, once: pip compiles an installed package's, not an
# editable one's, and where PYTHONDONTWRITEBYTECODE is set every process of the suite (hundreds:
# each command, each MPI rank) would otherwise compile the sources again (~0.2 s on 2 cores);
# -q prints only the files that do not compile
.venv/bin/python -m compileall -q pricer tests
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$PWD/.venv/numba-cache}"
# two workers, an idle one taking tests from the other: most tests keep one core busy (a
# process, or MPI ranks that mostly wait); the ten slowest tests named at the end
.venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=10 "$@"
