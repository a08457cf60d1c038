"""Write tests/golden/v<N> for the format version this bcp writes (N = FORMAT_VERSION).

Run only when the format version changes. An existing directory is never replaced:
every golden checkpoint must keep loading (tests/test_golden.py loads them all)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bcp
from bcp.metadata.manifest import FORMAT_VERSION
from golden_state import golden_state

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"v{FORMAT_VERSION}")
    if os.path.exists(out):
        sys.exit(f"{out} exists: golden checkpoints are never regenerated")
    print(bcp.save(golden_state(), out, metadata={"purpose": "golden format test"}))
