"""fl reproduce's results.csv escapes what a spreadsheet would run as a formula, as fl export does (issue 36): row ids,
table names, titles and provenance fields come from table files and run files, which are untrusted; numbers stay
numbers ("-0.02" is a difference, not a formula)."""
from __future__ import annotations

import csv
import io

from pflkit.core.results.published import PROVENANCE, results_csv


def test_formula_text_is_escaped_and_numbers_are_not():
    provenance = {p: "" for p in PROVENANCE}
    provenance.update({"machine": "=HYPERLINK(\"http://x\",\"y\")", "command": "@SUM(1+1)"})
    text = results_csv(["table", "row", "difference", "paper_mean"],
                       [{"table": "=cmd|' /C calc'!A0", "row": "+1+1", "difference": "-0.02", "paper_mean": "83.30"}],
                       provenance)
    header, row = list(csv.reader(io.StringIO(text)))
    cells = dict(zip(header, row))
    assert cells["table"] == "'=cmd|' /C calc'!A0" and cells["row"] == "'+1+1"
    assert cells["machine"].startswith("'=HYPERLINK") and cells["command"] == "'@SUM(1+1)"
    assert cells["difference"] == "-0.02" and cells["paper_mean"] == "83.30"
