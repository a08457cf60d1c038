"""The conformance report: every check with its outcome and why, grouped under the
heading of the class that defines it, the probe's figures, and a JSON form for CI."""

from __future__ import annotations

import dataclasses
import json

from bcp.backends.storage_errors import redact, redact_uri

#: The class attribute in which a test class declares the heading of the tests it defines.
HEADING_ATTRIBUTE = "report_heading"
#: Where a test goes that no class with a heading defines (a subclasser's own extra test).
OTHER = "other"
#: The longest reason shown for one check; longer ones are cut at a word boundary.
WHY_LIMIT = 1000


def shorten(text: str, limit: int = WHY_LIMIT) -> str:
    """``text`` whole when it fits in ``limit`` characters, else cut at the last space
    that fits (never inside a word, unless one word is longer than ``limit``), with
    " ..." to show that something was left out."""
    if len(text) <= limit:
        return text
    room = limit - len(" ...")
    cut = text.rfind(" ", 0, room + 1)
    head = text[:cut] if cut > 0 else text[:room]
    return head.rstrip(" ,;:") + " ..."


def heading_of(cls: type | None, test_name: str) -> str:
    """The heading of the class ``test_name`` belongs to: the first class in ``cls``'s
    MRO that both defines the test and declares its own heading. Looking the test up
    by definition, never by name pattern, is what keeps a test from landing under
    another group's heading; a subclass that overrides a test (to skip it, say)
    without declaring a heading leaves it under its group's."""
    if cls is None:
        return OTHER
    name = test_name.split("[", 1)[0]
    for klass in cls.__mro__:
        own = vars(klass)
        if name in own and HEADING_ATTRIBUTE in own:
            return str(own[HEADING_ATTRIBUTE])
    return OTHER


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
    #: Headings in the order to show them (the plugin fills it at collection).
    order: list[str] = dataclasses.field(default_factory=list)

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
        return json.dumps(
            {
                "uri": redact_uri(self.uri),
                "level": self.level,
                "backend": self.backend,
                "ok": self.ok,
                "counts": self.counts,
                "figures": self.figures(),
                "groups": {
                    g: [{**dataclasses.asdict(c), "why": redact(c.why)} for c in self.checks if c.group == g]
                    for g in self._groups()
                },
            },
            indent=2,
        )

    def _groups(self) -> list[str]:
        """Headings with checks: in ``order`` (the suite's collection order) first,
        then any others as they first appear."""
        present = {c.group for c in self.checks}
        ordered = [g for g in dict.fromkeys(self.order) if g in present]
        return ordered + [g for g in dict.fromkeys(c.group for c in self.checks) if g not in ordered]

    def to_text(self) -> str:
        lines = [f"bcp conformance: {redact_uri(self.uri)} (level {self.level})"]
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
                    lines.append(f"    FAIL {c.name}: {redact(c.why)}")
            reasons: dict[str, int] = {}
            for c in checks:
                if c.outcome == "skipped":
                    reasons[redact(c.why)] = reasons.get(redact(c.why), 0) + 1
            for why, n in reasons.items():
                lines.append(f"    skip ({n}): {why}")
            for c in checks:
                for k, v in (c.figures or {}).items():
                    lines.append(f"    {k}: {v}")
        counts = self.counts
        verdict = "PASSED" if self.ok else "FAILED"
        lines.append("")
        lines.append(
            f"RESULT: {verdict} ({counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
            f"{counts['skipped']} skipped)"
        )
        return "\n".join(lines)
