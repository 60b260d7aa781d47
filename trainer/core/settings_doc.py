"""The documentation's generated tables: `docs/settings.md`'s table of variables, the README's exit codes in a few
words and docs/preemption-and-failures.md's in full.

All are written from the code (`settings.TABLE`, `errors.EXIT_SUMMARY`, `errors.EXIT_CODES`) between `<!-- name:start -->` and
`<!-- name:end -->` markers, so the prose around them stays hand-written; tests/test_settings.py fails when
a file drifts from the code.  Regenerate them after changing a setting or an exit code:

    python -m trainer.core.settings_doc
"""

from __future__ import annotations

from pathlib import Path

from trainer.core.errors import EXIT_CODES, EXIT_SUMMARY
from trainer.core.settings import TABLE

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_DOC = Path("docs") / "settings.md"
README = Path("README.md")
FAILURES_DOC = Path("docs") / "preemption-and-failures.md"
CHANGES_COLUMN = {"": "no", "data": "yes (data)", "training": "yes"}


def settings_table() -> str:
    """The table of variables, one sub-table per group.

    "Changes the result": a changed value makes checkpoints on the volume belong to another computation
    (resuming them exits 2 unless FT_ALLOW_CONFIG_CHANGE); "yes (data)" also re-tokenizes the data."""
    out, group = [], None
    for s in TABLE:
        if s.group != group:
            group = s.group
            out += ["", f"**{group}**", "", "| Variable | Type | Default | Changes the result | Meaning |", "|---|---|---|---|---|"]
        default = "*(empty)*" if s.default == "" else f"`{s.default}`"
        out.append(f"| `{s.env_name}` | {s.type_name} | {default} | {CHANGES_COLUMN[s.changes]} | {s.help} |")
    return "\n".join(out).strip() + "\n"


def exit_code_summary() -> str:
    """The README's table: a few words a code, whether a retry helps, and the link to its whole meaning."""
    rows = (f"| {code} | {words} | {retry} | [more](docs/preemption-and-failures.md#exit-{code}) |\n" for code, (words, retry) in EXIT_SUMMARY.items())
    return "| Code | Meaning | Does a retry help? | |\n|---|---|---|---|\n" + "".join(rows)


def exit_code_table() -> str:
    """docs/preemption-and-failures.md's table: every code's whole meaning, each row its own anchor for the README's links."""
    rows = (f'| <a id="exit-{code}"></a>{code} | {meaning} |\n' for code, meaning in EXIT_CODES.items())
    return "| Code | Meaning |\n|---|---|\n" + "".join(rows)


def between_markers(text: str, marker: str, body: str) -> str:
    """`text` with what lies between the marker pair replaced by `body`; a missing marker is an error, not a no-op."""
    start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one {start.strip()} and one {end} in the file")
    head, rest = text.split(start)
    return head + start + body + end + rest.split(end, 1)[1]


def regenerate(root: Path = ROOT) -> list[Path]:
    """Rewrite the generated tables under `root`; returns the files that changed."""
    changed = []
    tables = ((SETTINGS_DOC, "settings", settings_table()), (README, "exit-codes", exit_code_summary()), (FAILURES_DOC, "exit-codes", exit_code_table()))
    for path, marker, body in tables:
        path = root / path
        text = path.read_text(encoding="utf-8")
        new = between_markers(text, marker, body)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


if __name__ == "__main__":
    for path in regenerate():
        print(f"rewrote {path.relative_to(ROOT)}")
