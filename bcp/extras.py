"""Optional packages, and the extra of ``bcp-checkpoint`` that installs each.

bcp imports an optional package only where a feature needs it. When it is missing,
the error names the feature and the one command that installs it (the CLI prints it
as one line), instead of a bare ``No module named 'safetensors'``. The storage
backends' packages (``s3``, ``gcs``) are named the same way by
``bcp.backends.registry``. The extras themselves are in pyproject.toml.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

#: The distribution's name (the name ``bcp`` on PyPI is an unrelated package).
DISTRIBUTION = "bcp-checkpoint"

#: extra -> the top-level modules it provides that bcp (or a bcp feature) imports
EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("safetensors",),
    "dataloader": ("torchdata",),
    "conformance": ("pytest",),
    "lightning": ("lightning",),
    "accelerate": ("accelerate",),
    "transformers": ("transformers", "accelerate"),  # the Trainer needs accelerate
    "viz": ("matplotlib",),
}


def install_command(extra: str) -> str:
    """The command that installs ``extra``, as the error messages give it."""
    # s3/gcs: named by bcp.backends.registry; fastcrc: bcp.metadata.checksum uses it when present, silently
    if extra not in EXTRAS and extra not in ("s3", "gcs", "fastcrc", "all"):
        raise ValueError(f"unknown extra {extra!r}")
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def _missing_message(extra: str, feature: str, module: str) -> str:
    return f"{feature} needs the package {module!r}, which is not installed: {install_command(extra)}"


@contextlib.contextmanager
def needs_extra(extra: str, feature: str) -> Iterator[None]:
    """Around the import of an optional package: a ModuleNotFoundError for one of
    ``extra``'s packages becomes one that names ``feature`` and the install command.
    Any other import error (a package that is there but broken, or lacks one of its
    own dependencies) passes unchanged: the extra would not fix it."""
    try:
        yield
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in EXTRAS[extra]:
            raise
        raise ModuleNotFoundError(_missing_message(extra, feature, top), name=e.name) from e


def missing_extra(extra: str, feature: str) -> str | None:
    """None when every package of ``extra`` imports; else the message that names
    ``feature`` and the install command (for errors that want to say it as a hint)."""
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] == module:
                return _missing_message(extra, feature, module)
            raise
    return None
