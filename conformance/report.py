"""The conformance report: every check with its outcome and why, grouped by the
capability it proves, the probe's figures, and a JSON form for CI."""

from __future__ import annotations

import dataclasses
import json
import re

#: (group, pattern on the test function name), first match wins. Object-contract
#: groups follow the sections of object_contract.py.
GROUPS: list[tuple[str, str]] = [
    ("performance (reported, not judged)", r"test_performance_probe"),
    ("create-only writes", r"write_if_absent"),
    ("concurrency", r"concurrent|from_threads"),
    ("atomic commit: unfinished, failed and aborted writes stay invisible",
     r"uncommitted|committed_object|abort|exception_in_writer|leaving_writer|overwrite"),
    ("multi-part writes", r"multipart|writer_does_not_keep"),
    ("missing objects", r"missing_object"),
    ("keys: unicode, nesting, invalid names", r"unicode|nested_key|invalid_key"),
    ("listing", r"test_list"),
    ("delete", r"delete"),
    ("exists and size", r"test_exists|test_size|directory_like"),
    ("ranged reads", r"test_read"),
    ("round trip", r"round_trip_|test_write_|_raw_object|empty_object"),
]
CHECKPOINT_GROUP = "checkpoints: save, load, reshard, killed saves, corruption"
PERFORMANCE_GROUP = GROUPS[0][0]
DISPLAY_ORDER = ["round trip", "multi-part writes", "ranged reads", "listing", "delete", "exists and size",
                 "keys: unicode, nesting, invalid names", "missing objects", GROUPS[3][0], "create-only writes",
                 "concurrency", CHECKPOINT_GROUP, PERFORMANCE_GROUP]


def group_of(class_name: str, test_name: str) -> str:
    base = test_name.split("[", 1)[0]
    if "Checkpoint" in class_name and base != "test_performance_probe":
        return CHECKPOINT_GROUP
    for group, pattern in GROUPS:
        if re.search(pattern, base):
            return group
    return "other"


@dataclasses.dataclass
class Check:
    nodeid: str
    group: str
    name: str
    outcome: str  # passed, failed, skipped, error
    why: str = ""
    seconds: float = 0.0
    figures: dict | None = None


@dataclasses.dataclass
class Report:
    uri: str
    level: str
    backend: dict = dataclasses.field(default_factory=dict)
    checks: list[Check] = dataclasses.field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        out = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
        for c in self.checks:
            out[c.outcome] += 1
        return out

    @property
    def ok(self) -> bool:
        counts = self.counts
        return counts["failed"] == 0 and counts["error"] == 0 and counts["passed"] > 0

    def figures(self) -> dict:
        merged: dict = {}
        for c in self.checks:
            merged.update(c.figures or {})
        return merged

    def to_json(self) -> str:
        return json.dumps({
            "uri": self.uri, "level": self.level, "backend": self.backend, "ok": self.ok, "counts": self.counts,
            "figures": self.figures(),
            "groups": {g: [dataclasses.asdict(c) for c in self.checks if c.group == g] for g in self._groups()},
        }, indent=2)

    def _groups(self) -> list[str]:
        order = DISPLAY_ORDER + ["other"]
        present = {c.group for c in self.checks}
        return [g for g in order if g in present]

    def to_text(self) -> str:
        lines = [f"bcp conformance: {self.uri} (level {self.level})"]
        if self.backend:
            lines.append("backend: " + ", ".join(f"{k} {v}" for k, v in self.backend.items()))
        lines.append("")
        for group in self._groups():
            checks = [c for c in self.checks if c.group == group]
            counts = {o: sum(c.outcome == o for c in checks) for o in ("failed", "error", "passed", "skipped")}
            summary = ", ".join(f"{n} {o.upper() if o in ('failed', 'error') else o}" for o, n in counts.items() if n)
            lines.append(f"{group} {'.' * max(2, 70 - len(group))} {summary}")
            for c in checks:
                if c.outcome in ("failed", "error"):
                    lines.append(f"    FAIL {c.name}: {c.why}")
            reasons: dict[str, int] = {}
            for c in checks:
                if c.outcome == "skipped":
                    reasons[c.why] = reasons.get(c.why, 0) + 1
            for why, n in reasons.items():
                lines.append(f"    skip ({n}): {why}")
            if group == PERFORMANCE_GROUP:
                for c in checks:
                    for k, v in (c.figures or {}).items():
                        lines.append(f"    {k}: {v}")
        counts = self.counts
        verdict = "PASSED" if self.ok else "FAILED"
        lines.append("")
        lines.append(f"RESULT: {verdict} ({counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
                     f"{counts['skipped']} skipped)")
        return "\n".join(lines)
