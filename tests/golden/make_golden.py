"""Regenerate tests/golden/v1. Run only when the format version changes, and then
add a new directory (v2) rather than replacing v1: v1 must keep loading."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bcp
from golden_state import golden_state

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v1")
    print(bcp.save(golden_state(), out, metadata={"purpose": "golden format test"}))
