"""Reward sources: built-in tasks (rewards from their definitions), Python functions by name
(TRL's signature), reward-model checkpoints (transformers' layout), and their errors."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from llmkit.rlhf import tasks
from llmkit.rlhf.config import RewardSection
from llmkit.rlhf.data import DataError, load_pairs, load_prompts, read_jsonl, split_heldout, step_rows
from llmkit.rlhf.reward_model import LlamaRewardModel, RewardModelScorer
from llmkit.rlhf.rewards import RewardError, build_reward, check_rewards, load_function

# ---- built-in tasks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,args,text,want",
    [
        ("avoid_letter", {"letter": "e"}, " the cat sat, on a mat!", 5 / 6),  # "the" has an e
        ("avoid_letter", {"letter": "a"}, "Banana", 0.0),
        ("use_letter", {"letter": "s"}, " sets of strings and lists", 3 / 5),
        ("target_length", {"words": 4}, " one two three four", 1.0),
        ("target_length", {"words": 4}, " one two", 0.5),
        ("target_length", {"words": 4}, " 1 2 3 4 5 6 7 8 9", 0.0),  # digits are not words
        ("end_word", {"word": "list"}, " a list of items in a List.", 1.0),
        ("end_word", {"word": "list"}, " a list of items", 0.5),
        ("end_word", {"word": "list"}, " nothing here", 0.0),
        ("avoid_letter", {}, " ... !!!", 0.0),  # no words
    ],
)
def test_task_rewards(name, args, text, want):
    task = tasks.make_task(name, args)
    assert task(prompts=["p"], completions=[text]) == [pytest.approx(want)]


def test_task_errors_name_the_key():
    with pytest.raises(ValueError, match=r"reward.task: unknown task 'avoid' \(known: avoid_letter"):
        tasks.make_task("avoid")
    with pytest.raises(ValueError, match=r"reward.task_args.colour: avoid_letter has no setting 'colour'"):
        tasks.make_task("avoid_letter", {"colour": "e"})
    with pytest.raises(ValueError, match=r"reward.task_args.letter: expected one letter"):
        tasks.make_task("avoid_letter", {"letter": "ee"})
    with pytest.raises(ValueError, match=r"reward.task_args.words: expected int, got '3'"):
        tasks.make_task("target_length", {"words": "3"})


def test_corpus_prompts_and_pairs_are_seeded():
    assert (
        tasks.corpus_prompts(5, seed=1) == tasks.corpus_prompts(5, seed=1) != tasks.corpus_prompts(5, seed=2)
    )
    assert all(2 <= len(p.split()) <= 4 for p in tasks.corpus_prompts(50))
    task = tasks.make_task("avoid_letter")
    pairs = tasks.preference_pairs(task, 40, seed=0)
    assert len(pairs) == 40
    for p in pairs:
        assert task.score(p["chosen"]) >= task.score(p["rejected"]) + 0.5


# ---- functions by name -------------------------------------------------------------------------------


def test_load_function_from_a_module_and_a_file(tmp_path, monkeypatch):
    module = types.ModuleType("my_rewards")
    module.short = lambda prompts, completions, **kw: [-len(c) for c in completions]
    monkeypatch.setitem(__import__("sys").modules, "my_rewards", module)
    assert load_function("my_rewards:short")(prompts=["a"], completions=["xyz"]) == [-3]
    f = tmp_path / "rw.py"
    f.write_text(
        "def has_x(prompts, completions, label, **kw):\n"
        "    return [float(x in c) for c, x in zip(completions, label)]\n"
    )
    reward = build_reward(RewardSection(function=f"{f}:has_x"))
    out = reward(["p", "q"], ["axb", "ab"], [[1], [2]], {"label": ["x", "x"]})  # JSONL columns as kwargs
    assert out.tolist() == [1.0, 0.0] and out.dtype == np.float64


@pytest.mark.parametrize(
    "spec,match",
    [
        ("nocolon", "expected 'module:function'"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("json:no_such_function", "'json' has no function 'no_such_function'"),
        ("missing.py:f", "file 'missing.py' not found"),
    ],
)
def test_load_function_errors(spec, match):
    with pytest.raises(RewardError, match=f"reward.function: .*{match}"):
        load_function(spec)


def test_rewards_are_checked():
    assert check_rewards([1, 2.5], 2, "f").tolist() == [1.0, 2.5]
    with pytest.raises(RewardError, match="f returned 1 rewards for 2 completions"):
        check_rewards([1.0], 2, "f")
    with pytest.raises(RewardError, match="f returned nan for completion 1"):
        check_rewards([1.0, float("nan")], 2, "f")
    with pytest.raises(RewardError, match="f must return a list of numbers"):
        check_rewards([None, 1.0], 2, "f")


# ---- reward models -----------------------------------------------------------------------------------


def test_reward_model_checkpoint_is_transformers_sequence_classification(policy_dir, tmp_path, tok):
    rm = LlamaRewardModel.from_pretrained(policy_dir)  # from a causal LM: its backbone, a fresh head
    cfg = json.loads((policy_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    saved = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForSequenceClassification"] and saved["num_labels"] == 1
    back = LlamaRewardModel.from_pretrained(tmp_path / "rm")
    for (k, a), (k2, b) in zip(rm.state_dict().items(), back.state_dict().items()):
        assert k == k2
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert "score.weight" in back.state_dict()
    # the scorer: one number per completion, the same whatever the batch
    scorer = RewardModelScorer.load(str(tmp_path / "rm"))
    one = scorer(["The value"], [" of x"])
    two = scorer(["The value", "A long prompt with many words"], [" of x", " and a completion"])
    assert len(two) == 2 and two[0] == pytest.approx(one[0], rel=1e-5)


# ---- data files --------------------------------------------------------------------------------------


def test_jsonl_errors_name_file_line_and_field(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": ""}\n')
    with pytest.raises(DataError, match=r"p.jsonl:3: field 'prompt' must be a non-empty string"):
        read_jsonl(str(f), ("prompt",), "data.prompts")
    f.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: invalid JSON"):
        load_prompts(str(f))
    with pytest.raises(DataError, match=r"data.pairs: file 'nope.jsonl' not found"):
        load_pairs("nope.jsonl")
    with pytest.raises(DataError, match=r"data.pairs: unknown task 'nope'"):
        load_pairs("builtin:nope")


def test_step_rows_cover_every_row_once_per_epoch():
    rows = list(range(10))
    seen = [r for step in range(5) for r in step_rows(rows, 4, seed=1, step=step)]
    assert sorted(seen[:10]) == rows and sorted(seen[10:20]) == rows
    assert step_rows(rows, 4, 1, 3) == step_rows(rows, 4, 1, 3) != step_rows(rows, 4, 2, 3)
    train, held = split_heldout(list(range(100)), 0.1, 0)
    assert len(held) == 10 and sorted(train + held) == list(range(100))


RAISES = """
calls = 0


def flaky(prompts, completions, **kwargs):
    global calls
    calls += 1
    if calls == 3:
        return [len(c) / 0 for c in completions]
    return [float(len(c)) for c in completions]
"""


@pytest.mark.slow
def test_a_reward_function_that_raises_stops_the_run_in_one_line(tmp_path, policy_dir, capsys):
    """Through the CLI: the error names the function, its file and line, and the exception; exit 2;
    the checkpoint of step 2 (before the failing step 3) is intact and nothing newer is written."""
    from llmkit.cli import main as cli_main
    from llmkit.train import checkpoint

    fn_file = tmp_path / "my_reward.py"
    fn_file.write_text(RAISES)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        json.dumps(
            {
                "algorithm": "grpo",
                "model": {"init_from": str(policy_dir)},
                "reward": {"function": f"{fn_file}:flaky"},
                "rollout": {"prompts_per_step": 2, "n": 2, "max_tokens": 4},
                "train": {"steps": 4, "save_every": 2},
                "out_dir": str(tmp_path / "run"),
            }
        )
    )
    assert cli_main(["rlhf", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"llmkit rlhf: reward.function {fn_file}:flaky raised ZeroDivisionError: ")
    assert err.endswith(f", {fn_file}:9)") and "division by zero" in err, err  # the raising line
    done = checkpoint.checkpoints(tmp_path / "run")
    assert [p.name for p in done] == ["step-00000002"], done
    assert (done[0] / "COMPLETE").is_file() and (done[0] / "model" / "model.safetensors").is_file()
    assert checkpoint.latest(tmp_path / "run") == done[0]
