"""Bad-row accounting: counts per reason, the first row numbers of each, and the policy.

Every row a tokenisation pass rejects goes through `BadRowReport.add`. With
`bad_rows=fail` the first one raises `BadRowError` naming file, row and problem; with
`skip` it is counted, and `finish()` raises when too large a fraction of rows is bad
(a wrong file or format is not "a few bad rows"). The stage driver logs `summary()` and
adds `as_metrics()` to its metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Reasons (stable strings: they appear in metrics names and in tests).
INVALID_JSON = "invalid_json"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
UNKNOWN_ROLE = "unknown_role"
EMPTY_ASSISTANT = "empty_assistant"
TOO_LONG = "too_long"
NO_TARGET = "no_target_after_truncation"
EMPTY_COMPLETION = "empty_completion"
IDENTICAL_PAIR = "identical_pair"
TEMPLATE_ERROR = "template_error"  # the tokenizer's chat template rejected the row (raise_exception)
REASONS = (
    INVALID_JSON,
    MISSING_FIELD,
    WRONG_TYPE,
    UNKNOWN_ROLE,
    EMPTY_ASSISTANT,
    TOO_LONG,
    NO_TARGET,
    EMPTY_COMPLETION,
    IDENTICAL_PAIR,
    TEMPLATE_ERROR,
)


class BadRowError(ValueError):
    """A bad row under bad_rows=fail, or too many bad rows under skip."""


@dataclass
class BadRowReport:
    """What a pass over one source found. Row numbers are 0-based row indices of the source."""

    source: str
    """The file (or in-memory set) the rows came from."""
    policy: str = "skip"
    """skip | fail (data.bad_rows)."""
    keep_rows: int = 10
    """Row numbers kept per reason (data.report_rows)."""
    total: int = 0
    """Rows read."""
    good: int = 0
    """Rows that became examples."""
    truncated: int = 0
    """Good rows that were cut at the sequence length (data.truncate=true)."""
    counts: dict[str, int] = field(default_factory=dict)
    """Bad rows per reason."""
    rows: dict[str, list[int]] = field(default_factory=dict)
    """First keep_rows row numbers per reason."""
    first_message: dict[str, str] = field(default_factory=dict)
    """The problem description of the first bad row of each reason (with its location)."""

    @property
    def bad(self) -> int:
        return sum(self.counts.values())

    total_bad = bad  # the name the stage summary reads

    def add(self, reason: str, index: int, where: str, problem: str) -> None:
        """Record bad row `index` (located by `where`, e.g. 'train.jsonl row 3 (line 4)')."""
        if reason not in REASONS:
            raise ValueError(f"unknown bad-row reason '{reason}'")
        message = f"{where}: {reason}: {problem}"
        if self.policy == "fail":
            raise BadRowError(
                f"bad row in {message}. Fix the row, or pass data.bad_rows=skip to drop and count bad rows instead"
            )
        self.counts[reason] = self.counts.get(reason, 0) + 1
        kept = self.rows.setdefault(reason, [])
        if len(kept) < self.keep_rows:
            kept.append(index)
        self.first_message.setdefault(reason, message)

    def finish(self, max_bad_fraction: float) -> BadRowReport:
        """Raise when nothing usable is left or the bad fraction is above max_bad_fraction."""
        if self.total == 0:
            raise BadRowError(f"{self.source} has no rows; pass a non-empty file")
        if self.good == 0 or self.bad / self.total > max_bad_fraction:
            raise BadRowError(
                f"{self.bad} of {self.total} rows of {self.source} are bad (more than data.max_bad_fraction="
                f"{max_bad_fraction}); check data.format and the file. {self.summary()}"
            )
        return self

    def summary(self) -> str:
        """One line per reason: count, first row numbers, first problem."""
        head = f"{self.source}: {self.good} of {self.total} rows used"
        if self.truncated:
            head += f", {self.truncated} truncated"
        if not self.counts:
            return head + ", no bad rows"
        lines = [head + f", {self.bad} bad rows skipped:"]
        for reason in REASONS:
            if reason in self.counts:
                more = "..." if self.counts[reason] > len(self.rows[reason]) else ""
                lines.append(
                    f"  {reason}: {self.counts[reason]} (rows {self.rows[reason]}{more}); first: "
                    f"{self.first_message[reason]}"
                )
        return "\n".join(lines)

    def as_metrics(self, prefix: str = "data/") -> dict[str, float]:
        """Flat float metrics: rows, good, bad, truncated and bad/<reason> counts."""
        out = {
            f"{prefix}rows": float(self.total),
            f"{prefix}good_rows": float(self.good),
            f"{prefix}bad_rows": float(self.bad),
            f"{prefix}truncated_rows": float(self.truncated),
        }
        for reason, n in self.counts.items():
            out[f"{prefix}bad_rows/{reason}"] = float(n)
        return out
