"""pricer: batch binomial-lattice option pricing on MPI clusters (CPU and GPU backends).

`pricer.price(book, ...)` prices a book in this process, `pricer.implied_volatility(book, ...)`
solves for its volatilities from market prices (pricer/api.py); `pricer.InputError` is what they
raise for bad input."""

from pricer.errors import InputError

__version__ = "0.1.0"
__all__ = ["InputError", "price", "implied_volatility", "__version__"]


def __getattr__(name):
    """`pricer.price` and `pricer.implied_volatility`, imported at their first use: `import pricer`
    stays light (the command line imports this package before it knows what it will run)."""
    if name == "price":
        from pricer.api import price
        return price
    if name == "implied_volatility":
        from pricer.api import implied_volatility
        return implied_volatility
    raise AttributeError(f"module 'pricer' has no attribute {name!r}")
