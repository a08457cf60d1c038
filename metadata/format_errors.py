"""The root of bcp's checkpoint errors, and the format layer's own error.

``CheckpointError`` lives here, in the lowest layer that knows what a checkpoint
is, so that a malformed file (``FormatError``) is a checkpoint error like every
other; the engine's errors (``bcp.errors``) derive from it too. Storage errors
(``bcp.backends.storage_errors``) are ``OSError``\\ s instead: they are about the store, not
the checkpoint. docs/errors.md shows the whole tree.
"""


class CheckpointError(Exception):
    """Base of every error about a checkpoint or the state saved into one."""


class FormatError(CheckpointError, ValueError):
    """A manifest or catalog is malformed. The message names the file and the field or row."""


class CorruptManifestError(FormatError):
    """manifest.json fails its own CRC32C (``manifest_crc32c``): flipped bits or an edit.

    A FormatError, because this layer may raise nothing else; the engine reports it
    as a corrupt checkpoint."""
