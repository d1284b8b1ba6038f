"""README names a feature only once it works: the jobs its first line promises have their package."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a job README's opening line may name -> the package that does it (DESIGN's layers)
JOBS = {"train": "llmkit/train", "serve": "llmkit/serve", "align": "llmkit/rlhf", "quantize": "llmkit/quant"}


def test_readme_promises_only_jobs_that_exist():
    first = next(line for line in (ROOT / "README.md").read_text().splitlines() if line and line[0] != "#")
    named = [job for job in JOBS if re.search(rf"\b{job}", first, re.IGNORECASE)]
    assert named, first
    missing = [job for job in named if not (ROOT / JOBS[job] / "__init__.py").is_file()]
    assert not missing, f"README's first line promises {missing}, which do not exist: {first!r}"
