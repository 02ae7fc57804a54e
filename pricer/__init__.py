"""pricer: batch binomial-lattice option pricing on MPI clusters (CPU and GPU backends)."""

__version__ = "0.1.0"
