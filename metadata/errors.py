"""Errors raised when catalog or manifest bytes do not follow FORMAT.md."""


class FormatError(ValueError):
    """A manifest or catalog is malformed. The message names the file and the field or row."""
