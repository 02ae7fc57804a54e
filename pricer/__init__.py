"""pricer: batch binomial-lattice option pricing on MPI clusters (CPU and GPU backends).

`pricer.price(book, ...)` prices a book in this process, `pricer.implied_volatility(book, ...)`
solves for its volatilities from market prices, `pricer.price_bonds(book, curves)` prices a book of
bond options on Hull–White trees, `pricer.read_book(path)` reads and checks a book file into a
DataFrame (pricer/api.py); each takes a book file's path or the book in memory.
`pricer.InputError` is what they raise for bad input."""

from pricer.errors import InputError

__version__ = "0.1.0"
__all__ = ["InputError", "price", "implied_volatility", "price_bonds", "price_file", "read_book",
           "__version__"]
_API = ("price", "implied_volatility", "price_bonds", "price_file", "read_book")


def __getattr__(name):
    """The functions of pricer/api.py, imported at their first use: `import pricer` stays light
    (the command line imports this package before it knows what it will run)."""
    if name in _API:
        import pricer.api
        return getattr(pricer.api, name)
    raise AttributeError(f"module 'pricer' has no attribute {name!r}")
