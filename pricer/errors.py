"""The one exception type that means "the user's input is wrong": exit code 2, no traceback."""


class InputError(Exception):
    """Bad input: a message that names the cause (file, column, option ids, value). Where the
    cause is in the book, `column` is the column's name and `ids` the offending options' ids (all
    of them, a NumPy array; the message shows the first few); both None where it is not."""

    def __init__(self, message: str, column: str | None = None, ids=None):
        super().__init__(message)
        self.column = column
        self.ids = ids

    def prefixed(self, text: str) -> "InputError":
        """The same error, its message after `text` (e.g. the input's name)."""
        return InputError(f"{text}{self}", column=self.column, ids=self.ids)


class OutputError(Exception):
    """The results could not be written after the run priced them: a message that says why and
    what was kept (exit code 1, no traceback)."""


def first_ids(ids, mask, limit=5):
    """The first few ids where mask holds, formatted for a message ("7, 12, 19 and 3 more")."""
    bad = ids[mask]
    shown = ", ".join(str(int(i)) for i in bad[:limit])
    if bad.size > limit:
        shown += f" and {bad.size - limit} more"
    return shown
