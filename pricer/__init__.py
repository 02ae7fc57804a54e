"""pricer: batch binomial-lattice option pricing on MPI clusters (CPU and GPU backends).

`pricer.price(book, ...)` prices a book in this process (pricer/api.py); `pricer.InputError` is
what it raises for bad input."""

from pricer.errors import InputError

__version__ = "0.1.0"
__all__ = ["InputError", "price", "__version__"]


def __getattr__(name):
    """`pricer.price`, imported at its first use: `import pricer` stays light (the command line
    imports this package before it knows what it will run)."""
    if name == "price":
        from pricer.api import price
        return price
    raise AttributeError(f"module 'pricer' has no attribute {name!r}")
