"""The data package's one error type."""


class DataError(ValueError):
    """Bad data input: a missing path, an empty corpus, a missing or stale binarized split.

    The message is one line saying what was wrong and what to do.
    """
