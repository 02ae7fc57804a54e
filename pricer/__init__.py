"""pricer: batch binomial-lattice option pricing on MPI clusters (CPU and GPU backends).

`pricer.price(book, ...)` prices a book in this process, `pricer.implied_volatility(book, ...)`
solves for its volatilities from market prices, `pricer.price_bonds(book, curves)` prices a book of
bond options on Hull–White trees (pricer/api.py); `pricer.InputError` is what they raise for bad
input."""

from pricer.errors import InputError

__version__ = "0.1.0"
__all__ = ["InputError", "price", "implied_volatility", "price_bonds", "__version__"]


def __getattr__(name):
    """`pricer.price`, `pricer.implied_volatility` and `pricer.price_bonds`, imported at their
    first use: `import pricer` stays light (the command line imports this package before it knows
    what it will run)."""
    if name in ("price", "implied_volatility", "price_bonds"):
        import pricer.api
        return getattr(pricer.api, name)
    raise AttributeError(f"module 'pricer' has no attribute {name!r}")
