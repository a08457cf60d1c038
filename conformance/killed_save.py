"""Child process of the killed-save checks: saves a checkpoint slowly, prints
``WRITING`` once its data is going out, and waits to be killed.

    python -P -m bcp.conformance.killed_save URI '{"overwrite": false, "imports": ["mypkg.backend"],
                                                   "paths": ["/dir/of/mypkg"], "bcp": "/site-packages/bcp"}'

``imports`` are modules to import before the URI is opened: a backend registered at
import time (``bcp conformance --import``) must be registered in this process too.
``paths`` are the directories they were imported from, put on ``sys.path`` only once
bcp is imported (with ``-P`` the current directory is not searched), so a ``bcp/``
folder beside a plugin cannot stand in for the installed package. ``bcp`` is the
directory of the package the parent runs: a child that imported another one says so
and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import bcp
from bcp.backends import Buffer, ObjectWriter, backend_for
from bcp.backends.registry import import_plugins
from bcp.backends.wrappers import ForwardingBackend, ForwardingWriter


class _AnnouncingWriter(ForwardingWriter):
    def _write_at(self, offset: int, data: Buffer) -> None:
        self.inner.write_at(offset, data)
        print("WRITING", flush=True)
        time.sleep(1.0)  # slow enough that the parent's SIGKILL lands mid-save


class _AnnouncingBackend(ForwardingBackend):
    """Announces the first data write, then slows every part down."""

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        writer = self.inner.open_writer(key, size=size)
        return _AnnouncingWriter(writer) if key.endswith(".bin") else writer


def main(argv: list[str]) -> None:
    uri, options = argv[0], json.loads(argv[1] if len(argv) > 1 else "{}")
    expected, mine = options.get("bcp"), os.path.dirname(os.path.realpath(bcp.__file__))
    if expected and os.path.realpath(expected) != mine:
        sys.exit(
            f"this child imported bcp from {mine}, not {expected} (the bcp the suite runs): "
            "a folder named bcp on PYTHONPATH shadows it; take it off PYTHONPATH"
        )
    for path in reversed(options.get("paths") or []):
        if path not in sys.path:
            sys.path.insert(0, path)
    import_plugins(options.get("imports") or [])
    backend = _AnnouncingBackend(backend_for(uri))
    g = torch.Generator().manual_seed(11)
    state = {f"layer{i}": torch.randn(2 << 20, generator=g) for i in range(8)}  # 64 MiB, many parts
    bcp.save(state, backend, overwrite=bool(options.get("overwrite")))
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
