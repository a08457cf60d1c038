"""Write tests/golden/v<N> for the format version this bcp writes (N = FORMAT_VERSION);
``make_golden.py v3``: tests/golden/v3, two sibling checkpoints: ``base`` (a full save
recording piece digests) and ``step``, an incremental save of a slightly changed state
whose unchanged pieces refer to ``base``'s bytes (manifest version 3, REFERENCES_VERSION).

Run only when the format version changes. An existing directory is never replaced:
every golden checkpoint must keep loading (tests/test_golden.py loads them all)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bcp
from bcp.metadata.manifest import FORMAT_VERSION
from golden_state import golden_state, golden_step_state


def make_v3(out: str) -> None:
    base, step = os.path.join(out, "base"), os.path.join(out, "step")
    meta = {"purpose": "golden format test"}
    bcp.save(golden_state(), base, incremental=True, piece_bytes=64, metadata=meta)
    print(bcp.save(golden_step_state(), step, base=base, piece_bytes=64, metadata=meta))


if __name__ == "__main__":
    if sys.argv[1:] == ["v3"]:
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v3")
        if os.path.exists(out):
            sys.exit(f"{out} exists: golden checkpoints are never regenerated")
        make_v3(out)
        sys.exit(0)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"v{FORMAT_VERSION}")
    if os.path.exists(out):
        sys.exit(f"{out} exists: golden checkpoints are never regenerated")
    print(bcp.save(golden_state(), out, metadata={"purpose": "golden format test"}))
