"""`pricer` with one more backend, `oracle` (tests/oracle.py), registered as a user's own backend
would be: one module with an Engine subclass and one register() call, before the command runs.
Run it as `pricer` (under mpiexec too): python tests/data/oracle_backend.py price IN -o OUT
--backend oracle."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/, for oracle.py

from oracle import OracleEngine  # noqa: E402

from pricer.cli import main  # noqa: E402
from pricer.engines import register  # noqa: E402

register("oracle", {("options", "lattice"): OracleEngine},
         help="the plain NumPy oracle of the tests")

if __name__ == "__main__":
    sys.exit(main())
