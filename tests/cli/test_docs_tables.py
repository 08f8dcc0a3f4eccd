"""README.md and docs/performance.md carry the results tables exactly as
`sparkinfer bench summarize` prints them from the committed result files
(`--brief` for the README): a new result file, or a change to summarize, that
is not pasted into the docs fails here instead of leaving stale numbers (the
decode table and a MoE note once drifted for several commits).

A block is a caption (a paragraph ending in ':'), the table after it and the
notes paragraph after that, if any: summarize prints several blocks per result
file, and the docs place them in different sections with prose between them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkinfer.bench.summarize import tables

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NOTE_MARKS = ("† ", "‡ ", "l: ")  # the note lines summarize prints under a table


def blocks(text: str) -> list[str]:
    """summarize's output cut into caption + table (+ notes) blocks."""
    out: list[str] = []
    for para in text.split("\n\n"):
        if para.rstrip().endswith(":") and not para.startswith("|"):
            out.append(para)
        elif out:
            out[-1] += "\n\n" + para
        else:
            raise AssertionError(f"summarize printed a paragraph before any caption: {para[:80]!r}")
    return out


@pytest.mark.parametrize("doc, brief", [("README.md", True), ("docs/performance.md", False)])
def test_every_table_block_appears_verbatim(doc, brief):
    text, refused = tables(RESULTS, brief)
    assert not refused, refused  # a refused row would make the docs' table differ for another reason
    got = blocks(text)
    assert len(got) >= (5 if brief else 7), [b[:60] for b in got]  # every bench's tables, not an empty run
    body = (ROOT / doc).read_text()
    stale = [b.split("\n", 1)[0][:120] for b in got if b not in body]
    assert not stale, (f"{doc}: paste `sparkinfer bench summarize{' --brief' if brief else ''}`'s block for "
                       f"each of these captions (caption, table and notes exactly as printed): {stale}")
    # and no note line that summarize no longer prints (a deleted table's or condition's leftovers)
    notes = {ln for b in got for ln in b.split("\n") if ln.startswith(NOTE_MARKS)}
    extra = [ln[:100] for ln in body.split("\n") if ln.startswith(NOTE_MARKS) and ln not in notes]
    assert not extra, f"{doc}: note lines summarize does not print: {extra}"
