"""lm-evaluation-harness itself against ``llmkit serve``: its ``local-completions`` model (echo
requests, token ids in batches, concurrent clients) on local task files written here, compared with
its ``hf`` model (transformers) on the same weights: the same accuracies, the same perplexity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from .conftest import start_server

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf model

pytestmark = pytest.mark.slow

WORDS = [
    *("the", "a", "fox", "dog", "cat", "bird", "river", "stone", "tree", "house", "little", "big"),
    *("old", "new", "red", "green", "runs", "sleeps", "jumps", "sings", "under", "over", "near"),
    *("far", "happy", "sad", "quick", "slow", "morning", "night", "sun", "moon", "rain", "snow"),
]
MAX_LENGTH = 256  # the model's context; both lm-eval models truncate to it


def write_tasks(d: Path, n_docs: int = 24) -> None:
    """A multiple-choice task (4 choices) and a loglikelihood_rolling perplexity task, each over
    ``n_docs`` documents of a local jsonl file (no hub access)."""
    rng = np.random.default_rng(0)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS, n))

    mc = [
        {"query": sentence(8).capitalize() + ":", "choices": [" " + sentence(3) for _ in range(4)]}
        for _ in range(n_docs)
    ]
    for i, doc in enumerate(mc):
        doc["gold"] = i % 4
    ppl = [{"text": sentence(int(rng.integers(20, 60))).capitalize() + "."} for _ in range(n_docs)]
    for name, docs in (("mc", mc), ("ppl", ppl)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    common = "dataset_path: json\ntest_split: test\n"
    (d / "llmkit_mc.yaml").write_text(
        f"task: llmkit_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: query\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (d / "llmkit_ppl.yaml").write_text(
        f"task: llmkit_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'ppl.jsonl'}\n"
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )


def evaluate(model: str, model_args: dict, tasks_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["llmkit_mc", "llmkit_ppl"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        use_cache=None,
        log_samples=False,
    )
    return out["results"]


def test_local_completions_through_llmkit_serve_equal_the_hf_model(
    hf_model, hf_model_file, tmp_path, monkeypatch
):
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    _, model_dir = hf_model
    write_tasks(tmp_path)
    server = start_server(hf_model_file, tmp_path / "server.log", "--max-batch", "8")
    try:
        served = evaluate(
            "local-completions",
            {
                "model": "hf-tiny",
                "base_url": server.base_url + "/completions",
                "tokenizer": str(model_dir),
                "tokenizer_backend": "huggingface",
                "batch_size": 8,  # 8 prompts (token-id lists) per request
                "num_concurrent": 4,  # 4 requests at once: the engine batches across them
                "max_length": MAX_LENGTH,
                "add_bos_token": False,  # as the hf model below: the same tokens go to both
            },
            tmp_path,
        )
    finally:
        assert server.stop() == 0, server.log.read_text()
    reference = evaluate(
        "hf",
        {
            "pretrained": str(model_dir),
            "dtype": "float32",
            "device": "cpu",
            "max_length": MAX_LENGTH,
            # lm-eval's hf model otherwise takes the tokenizer's own default (BOS on), its
            # local-completions model never: both without, so they score the same token ids
            "add_bos_token": False,
        },
        tmp_path,
    )
    mc, mc_ref = served["llmkit_mc"], reference["llmkit_mc"]
    assert mc["acc,none"] == mc_ref["acc,none"] and mc["acc_norm,none"] == mc_ref["acc_norm,none"]
    ppl, ppl_ref = served["llmkit_ppl"], reference["llmkit_ppl"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ppl[metric] == pytest.approx(ppl_ref[metric], rel=1e-4), metric
