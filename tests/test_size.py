"""The line budget: llmkit/ stays under 30,000 lines of code, and the README's count is current.

Lines are counted as tinygrad's ``sz.py`` counts them: a line counts when an operator, name, number
or string token starts on it (``tokenize``), so blank lines, comment-only lines and the continuation
lines of a multi-line string (a docstring's body) do not.
"""

from __future__ import annotations

import re
import token
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 30_000
CODE_TOKENS = {token.OP, token.NAME, token.NUMBER, token.STRING}


def code_lines(path: Path) -> int:
    with tokenize.open(path) as f:
        return len({t.start[0] for t in tokenize.generate_tokens(f.readline) if t.type in CODE_TOKENS})


def package_lines() -> int:
    return sum(code_lines(p) for p in (ROOT / "llmkit").rglob("*.py"))


def test_code_lines_are_counted_as_sz_py_counts_them(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""A docstring\n\nover three lines."""\n\n# a comment\nx = (1,\n     2)  # trailing\n\n')
    assert code_lines(src) == 3  # the docstring's first line, "x = (1," and "2)"


def test_the_package_stays_within_the_line_budget():
    n = package_lines()
    assert n <= BUDGET, f"llmkit/ has {n:,} lines of code, over the budget of {BUDGET:,}"


def test_the_readme_states_the_count():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"about ([\d,]+) lines of code", text)
    assert m, "README.md: no 'about N lines of code' sentence"
    stated, n = int(m.group(1).replace(",", "")), package_lines()
    assert abs(stated - n) <= 0.04 * n, f"README.md says {stated:,} lines of code; llmkit/ has {n:,}"
