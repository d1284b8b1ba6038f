"""A model trained by configs/tiny.yaml (shortened), once per session, for the quantization tests."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFIG = Path(__file__).parents[2] / "configs" / "tiny.yaml"
# Long enough for quantization to move perplexity by more than chance (after 150 steps int4 g128
# RTN changed it by +0.02%, within the spread of GPTQ's results; after 200 steps of 16 sequences,
# +0.3% against GPTQ's -0.04%), short enough for CI: 410K tokens, about 1.5 minutes on 2 free cores.
STEPS, BATCH = 200, 16


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of ``llmkit train configs/tiny.yaml`` with STEPS steps of BATCH x 128 tokens."""
    from llmkit.train.config import load_config
    from llmkit.train.trainer import Trainer

    out = tmp_path_factory.mktemp("runs") / "tiny"
    overrides = [f"train.steps={STEPS}", f"train.batch_size={BATCH}", f"out_dir={out}", "train.eval_every=0"]
    Trainer(load_config(CONFIG, overrides), quiet=True).fit()
    return out
