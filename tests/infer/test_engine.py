"""The engine against eager generation, and its batch-invariance guarantee, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.generate import generate
from llmkit.infer import Engine, EngineConfig, FinishReason, SamplingParams

from .conftest import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True, logprobs=3
)


def prompts_of(lengths, seed=0, vocab=4096):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def engine(model):
    return Engine.from_model(model, config=EngineConfig(max_batch=8))


def fresh(model, **kw):
    return Engine.from_model(model, config=EngineConfig(**{"max_batch": 8, **kw}))


def signature(c):
    """Everything a request's output is: tokens, and (when asked for) logprobs, compared exactly."""
    lps = None if c.logprobs is None else [(x.token_id, x.logprob, tuple(x.top)) for x in c.logprobs]
    return c.token_ids, lps, c.finish_reason


def test_greedy_equals_eager_generation_token_for_token(model, engine):
    # lengths around the block size (16): one chunk, several chunks, a partial last chunk
    prompts = prompts_of([1, 5, 15, 16, 17, 33, 40, 64])
    outs = engine.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == generate(model, [p], max_new_tokens=12)[0]
        assert o.finish_reason == FinishReason.LENGTH


def test_prefill_logits_match_the_eager_forward(model, engine):
    prompt = prompts_of([37], seed=3)[0]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    with lf.no_grad():
        logits = model(lf.tensor(np.array([prompt]))).logits.numpy()[0, -1].astype(np.float64)
    ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    top = [t for t, _ in out.logprobs[0].top]
    assert top == list(np.argsort(-ref, kind="stable")[:5])
    np.testing.assert_allclose([lp for _, lp in out.logprobs[0].top], ref[top], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiler", ["none", "cinn"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batch_invariance_alone_batch_of_8_and_prefix_hit(model, params, compiler):
    """The documented guarantee (docs/serve.md), with the reference kernels and with compiled ones."""
    eng = fresh(model, compiler=compiler)
    target = prompts_of([41], seed=7)[0]
    alone = signature(eng.generate([target], params)[0])
    eng.reset_prefix_cache()
    # in a batch of 8 with prompts of other lengths (and other seeds)
    others = prompts_of([3, 18, 29, 50, 9, 33, 64], seed=8)
    mixed = [target, *others]
    plist = [params] + [
        params.replace(seed=None if params.seed is None else params.seed + k) for k in range(1, 8)
    ]
    batch = eng.generate(mixed, plist)
    assert signature(batch[0]) == alone
    assert batch[0].num_cached_tokens == 0
    # after a prefix-cache hit: a request sharing the first 32 tokens ran before
    eng.reset_prefix_cache()
    eng.generate([target[:32] + [5, 6, 7]], GREEDY)
    hit = eng.generate([target], params)[0]
    assert hit.num_cached_tokens == 32
    assert signature(hit) == alone
    assert eng.blocks.num_used == 0


def test_batch_invariance_across_several_row_tiles(model):
    """12 requests decode in two 8-row tiles; each still matches its run alone."""
    eng = fresh(model, max_batch=16, enable_prefix_caching=False)
    prompts = prompts_of([5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49], seed=21)
    plist = [SEEDED.replace(seed=100 + i) for i in range(12)]
    together = eng.generate(prompts, plist)
    for p, sp, t in zip(prompts, plist, together):
        assert signature(eng.generate([p], sp)[0]) == signature(t)


def test_requests_join_and_leave_between_steps(model):
    eng = fresh(model, max_batch=4)
    prompts = prompts_of([12, 30, 7, 19, 44, 3], seed=11)
    alone = [signature(eng.generate([p], SEEDED)[0]) for p in prompts]
    eng.reset_prefix_cache()
    outs = {}
    ids = [eng.add_request(prompts[0], SEEDED), eng.add_request(prompts[1], SEEDED.replace(max_tokens=5))]
    steps = 0
    while eng.has_work() or len(ids) < len(prompts):
        if steps % 3 == 2 and len(ids) < len(prompts):  # a new request arrives every third step
            ids.append(eng.add_request(prompts[len(ids)], SEEDED))
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        assert len(eng.scheduler.running) <= 4
        steps += 1
    got = ["".join(str(t) for o in outs[i] for t in o.new_token_ids) for i in ids]
    assert got[0] == "".join(map(str, alone[0][0]))
    assert got[1] == "".join(map(str, alone[1][0][:5]))
    for i in range(2, len(prompts)):
        assert got[i] == "".join(map(str, alone[i][0]))
    assert eng.blocks.num_used == 0


def test_streaming_callbacks_and_cancellation_free_blocks(model, tok):
    eng = Engine.from_model(model, tok, EngineConfig(max_batch=4))
    seen: dict[str, list] = {}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    keep = eng.add_request("The cat", params, callback=lambda o: seen.setdefault("keep", []).append(o))
    drop = eng.add_request("A dog", params, callback=lambda o: seen.setdefault("drop", []).append(o))
    for _ in range(5):
        eng.step()
    assert eng.blocks.num_used > 0
    eng.abort(drop)
    while eng.has_work():
        eng.step()
    assert seen["drop"][-1].finished and seen["drop"][-1].finish_reason == FinishReason.ABORT
    assert seen["drop"][-1].num_output_tokens < 40
    assert sum(o.finished for o in seen["drop"]) == 1
    ks = seen["keep"]
    assert ks[-1].finish_reason == FinishReason.LENGTH and ks[-1].num_output_tokens == 40
    assert sum(len(o.new_token_ids) for o in ks) == 40
    full = eng.generate(["The cat"], params)[0]
    assert "".join(o.new_text for o in ks) == full.text == tok.decode(full.token_ids)
    assert eng.blocks.num_used == 0
    eng.abort(keep)  # finished already: ignored
    assert eng.step() == []


def test_stop_strings_stop_ids_and_eos(model, tok):
    eng = Engine.from_model(model, tok, EngineConfig(max_batch=4))
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = eng.generate(["Once upon"], base)[0]
    # stop at the third token's id
    stop_id = ref.token_ids[2]
    out = eng.generate(["Once upon"], base.replace(stop_token_ids=(stop_id,)))[0]
    first = ref.token_ids.index(stop_id)
    assert out.token_ids == ref.token_ids[: first + 1] and out.finish_reason == FinishReason.STOP
    assert out.text == tok.decode(ref.token_ids[:first])
    # a stop string in the middle of the text: the output ends right before it
    text = ref.text
    cut = text[len(text) // 3 : len(text) // 3 + 3]
    out = eng.generate(["Once upon"], base.replace(stop=(cut,)))[0]
    assert out.text == text[: text.index(cut)] and out.finish_reason == FinishReason.STOP
    # eos ends the output when not ignored (force it with an eos-only stop id set)
    out = eng.generate(["Once upon"], base.replace(ignore_eos=False, stop_token_ids=(ref.token_ids[0],)))[0]
    assert out.token_ids == ref.token_ids[:1] and out.text == ""


def test_context_limits_name_the_parameter(model, engine):
    with pytest.raises(ValueError, match="prompt: 512 tokens do not fit"):
        engine.add_request([5] * 512, GREEDY)
    with pytest.raises(
        ValueError, match=r"max_tokens: 100 new tokens after a 500-token prompt .* \(at most 12\)"
    ):
        engine.add_request([5] * 500, GREEDY.replace(max_tokens=100))
    with pytest.raises(ValueError, match="token id 4096 is out of range"):
        engine.add_request([4096], GREEDY)
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="text prompt needs a tokenizer"):
        engine.add_request("hello", GREEDY)


def test_admission_waits_for_free_blocks_and_nothing_leaks(model):
    # 6 blocks of 16: each request needs 2 (up to 32 tokens), so at most 3 run at once
    eng = fresh(model, num_blocks=6, max_batch=8)
    prompts = prompts_of([10, 14, 6, 12, 9], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    peak, done = 0, {}
    while eng.has_work():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        peak = max(peak, len(eng.scheduler.running))
    assert peak == 3 and len(done) == 5
    assert all(done[i].num_output_tokens == 16 for i in ids)
    assert eng.blocks.num_used == 0


def test_kv_memory_caps_the_pool_at_the_blocks_that_fit(model):
    c = model.config  # a KV block: keys and values of every layer, float32
    block = (
        c.num_hidden_layers * 2 * c.num_key_value_heads * 16 * (c.hidden_size // c.num_attention_heads) * 4
    )
    assert block == 16384  # 2 layers x 2 x 2 kv heads x 16 tokens x 32 dims x 4 bytes
    for cap in (block, 7 * block + block - 1, 2**20):
        eng = fresh(model, kv_memory_bytes=cap)
        assert eng.blocks.num_blocks == cap // block and eng.runner.pool.nbytes <= cap
    eng = fresh(model, kv_memory_bytes=6 * block)  # a cap that makes requests wait, as num_blocks=6
    outs = eng.generate(prompts_of([10, 14, 6], seed=5), GREEDY)
    assert [len(o.token_ids) for o in outs] == [12] * 3 and eng.blocks.num_used == 0
    for kw, words in [
        (
            {"kv_memory_bytes": block - 1},
            f"at least one KV block of this model \\({block} bytes\\), got 16383",
        ),
        ({"kv_memory_bytes": 0}, "got 0 bytes"),
        ({"kv_memory_bytes": 2.5e6}, "got 2500000.0 bytes"),
        ({"kv_memory_bytes": 2**20, "num_blocks": 6}, "num_blocks or kv_memory_bytes, not both"),
    ]:
        with pytest.raises(ValueError, match=words):
            fresh(model, **kw)


def test_long_prompt_prefills_in_chunks_within_the_token_budget(model):
    eng = fresh(model, max_batch=2, max_tokens_per_step=18)
    prompt = prompts_of([100], seed=9)[0]
    out = eng.generate([prompt], GREEDY)[0]
    assert out.token_ids == generate(model, [prompt], max_new_tokens=12)[0]
    assert eng.num_steps >= 100 // 16 + 12


def test_engine_follows_live_weights():
    model = tiny_model(seed=1)
    eng = Engine.from_model(model, config=EngineConfig(max_batch=2))
    prompt = prompts_of([9], seed=2)[0]
    before = eng.generate([prompt], GREEDY)[0].token_ids
    w = model.lm_head.weight
    w.set_value(w.numpy() * -1.0)  # an "optimizer step" that rebinds the weight
    eng.reset_prefix_cache()
    after = eng.generate([prompt], GREEDY)[0].token_ids
    assert after == generate(model, [prompt], max_new_tokens=12)[0]
    assert after != before
    w._data *= -1.0  # written in place: only weights_changed() makes the engine see it
    eng.weights_changed()
    assert eng.generate([prompt], GREEDY)[0].token_ids == before


def test_cli_generate_runs_the_engine_and_matches_eager(model, tok, tmp_path, capsys):
    from llmkit.cli import main as cli_main

    model.save_pretrained(str(tmp_path / "m"))
    tok.save_pretrained(tmp_path / "m")
    args = [
        "generate",
        "--model",
        str(tmp_path / "m"),
        "--prompt",
        "The",
        "--max-new-tokens",
        "8",
        "--seed",
        "3",
    ]
    assert cli_main(args) == 0
    engine_text = capsys.readouterr().out
    assert cli_main([*args, "--eager"]) == 0
    assert capsys.readouterr().out == engine_text and engine_text.startswith("The")


def test_engine_thread_fails_requests_of_a_broken_step_and_keeps_serving(model):
    import threading

    from llmkit.infer import EngineThread

    eng = fresh(model, max_batch=2)
    real = eng.runner.decode
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real(batch)

    eng.runner.decode = flaky
    thread = EngineThread(eng).start()
    done: dict[str, object] = {}
    ev = threading.Event()

    def cb(o):
        if o.finished:
            done[o.request_id] = o
            ev.set()

    rid = thread.submit([5, 6, 7], GREEDY, callback=cb)
    assert ev.wait(30)
    assert done[rid].finish_reason == FinishReason.ERROR and isinstance(thread.error, RuntimeError)
    ev.clear()
    rid2 = thread.submit([5, 6, 7], GREEDY, callback=cb)
    assert ev.wait(30) and done[rid2].finish_reason == FinishReason.LENGTH
    thread.stop(drain_timeout=0)
    assert not thread.alive and eng.blocks.num_used == 0


def test_engine_on_each_device_matches_eager_generation(device, assert_on_device):
    """The GPU twin of the engine: weights moved to the device (initialized on the CPU, so both
    runs start from the same numbers), the KV pool living there after the first step, the
    greedy tokens those of eager generation on the CPU and the prefill logits close to them."""
    prompts = prompts_of([5, 17, 33], seed=4)
    lf.set_device("cpu")  # the reference and the weights: made on the CPU
    try:
        ref, m = tiny_model(), tiny_model()
        want = [generate(ref, [p], max_new_tokens=6)[0] for p in prompts]
        with lf.no_grad():
            last = [ref(lf.tensor(np.array([p]))).logits.numpy()[0, -1].astype(np.float64) for p in prompts]
    finally:
        lf.set_device(device)
    m.to(device)
    eng = Engine.from_model(m, config=EngineConfig(max_batch=8))
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5))
    assert_on_device(eng.runner.pool, *[p._data for p in m.parameters()])
    for o, tokens, logits in zip(outs, want, last):
        assert o.token_ids == tokens
        lse = logits.max() + np.log(np.exp(logits - logits.max()).sum())
        top = [t for t, _ in o.logprobs[0].top]
        np.testing.assert_allclose(
            [lp for _, lp in o.logprobs[0].top], logits[top] - lse, rtol=1e-4, atol=1e-4
        )
