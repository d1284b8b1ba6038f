"""The traced prefill/decode programs: what the IR holds, in-place pools, logits against eager."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import ir
from llmkit.framework.compiler import available
from llmkit.infer.programs import trace_programs
from llmkit.infer.runner import DecodeBatch, ModelRunner, PrefillBatch


@pytest.mark.parametrize("compiler", ["none", "cinn"])
def test_programs_use_tiled_linears_with_relaid_weights(model, compiler):
    if compiler == "cinn" and not available():
        pytest.skip("no working C compiler")
    programs, spec = trace_programs(model, block_size=16, compiler=compiler)
    assert spec.block_size == 16 and spec.num_kv_heads == 2 and spec.max_model_len == 512
    assert (spec.prefill_tile, spec.decode_tile, spec.score_top_k) == (8, 1, 5)
    assert sorted(programs) == ["decode", "prefill", "score"]
    for name, p in programs.items():
        ops = [op.name for op in p.concrete.program.walk()]
        assert "llm.linear" not in ops
        # 7 per layer + lm_head (score: once, at every row, fused with its logsumexp, top-k and
        # picks; the sampled rows are picked from it)
        head = "llm.tiled_linear_logprobs" if name == "score" else "llm.tiled_linear"
        assert ops.count("llm.tiled_linear") == 2 * 7 + (head == "llm.tiled_linear")
        assert ops.count(head) >= 1 and not {"llm.logsumexp", "llm.topk", "llm.gather"} & set(ops)
        assert ops.count("llm.paged_kv_write") == ops.count("llm.paged_attention") == 2
        # BLAS's [in, out] for the reference kernels; when compiled, the C kernel's 16-column panels
        # where out_features is a multiple of 16 (not this model's MLP width, 344)
        assert len(p.layouts) == 2 * 7 + 1
        for i, layout in p.layouts.items():
            w = p.concrete.captures[i].numpy()
            assert layout == ("P16" if compiler == "cinn" and w.shape[0] % 16 == 0 else "T")
            got = p.capture_arrays({})[i]
            want = w.T if layout == "T" else w.T.reshape(w.shape[1], -1, 16).transpose(1, 0, 2)
            np.testing.assert_array_equal(got, want)
        text = str(p.concrete.program)
        assert "transposed = true" in text and "inplace = true" in text
        assert ("panel = 16" in text) == (compiler == "cinn")
        assert ("rows = 1" in text) == (name == "decode")  # rows = 8 is the default, not printed
        assert "NB" in text and ("B, 1]" in text if name == "decode" else "N]" in text)
    assert "tile-linear" in ir.registered_passes() and "transpose-weights" in ir.registered_passes()


def test_segments_of_several_sequences_match_the_eager_forward(model):
    runner = ModelRunner.from_model(model, num_blocks=16)
    rng = np.random.default_rng(0)
    a, b = rng.integers(3, 4096, 21).tolist(), rng.integers(3, 4096, 9).tolist()
    batch = PrefillBatch()
    rows = [batch.add_segment(a[:16], 0, [3, 7], 16), batch.add_segment(a[16:], 16, [3, 7], 16)]
    rows.append(batch.add_segment(b, 0, [5], 16))
    batch.logit_rows = rows
    pool = runner.pool
    logits = runner.prefill(batch)
    assert runner.pool is pool  # written in place: the pool is donated, never copied
    with lf.no_grad():
        ref_a = model(lf.tensor(np.array([a]))).logits.numpy()[0]
        ref_b = model(lf.tensor(np.array([b]))).logits.numpy()[0]
    np.testing.assert_allclose(logits, np.stack([ref_a[15], ref_a[20], ref_b[8]]), rtol=1e-4, atol=1e-5)
    # one decode step for both sequences
    step = DecodeBatch()
    step.add(11, 21, [3, 7], 16)
    step.add(12, 9, [5], 16)
    logits = runner.decode(step)
    with lf.no_grad():
        ra = model(lf.tensor(np.array([a + [11]]))).logits.numpy()[0, -1]
        rb = model(lf.tensor(np.array([b + [12]]))).logits.numpy()[0, -1]
    np.testing.assert_allclose(logits, np.stack([ra, rb]), rtol=1e-4, atol=1e-5)


def test_compiled_programs_fuse_the_mlp_and_generate_as_eager(tmp_path):
    """With the MLP width a multiple of 16 (both weights in panels) compiled programs run
    swiglu(gate, up) as one tiled_linear_swiglu; generation still equals eager generation, and a
    file exported so runs with the reference kernels once its panels are unpacked."""
    if not available():
        pytest.skip("no working C compiler")
    from llmkit.framework import jit
    from llmkit.generate import generate
    from llmkit.infer import Engine, EngineConfig, SamplingParams
    from llmkit.infer.programs import unpack_panel_weights
    from llmkit.serve.export import export_model
    from llmkit.train.corpus import builtin_tokenizer

    from .conftest import tiny_model

    model = tiny_model(intermediate_size=352)
    for compiler, fused in (("cinn", 2), ("none", 0)):
        programs, _ = trace_programs(model, compiler=compiler)
        for p in programs.values():
            ops = [op.name for op in p.concrete.program.walk()]
            assert ops.count("llm.tiled_linear_swiglu") == fused and ops.count("llm.swiglu") == 2 - fused
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 4096, n).tolist() for n in (6, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = Engine.from_model(model, config=EngineConfig(max_batch=4)).generate(prompts, params)
    for p, out in zip(prompts, got):
        assert out.token_ids == list(generate(model, [p], max_new_tokens=8, params=params)[0])[-8:]
    path = export_model(model, builtin_tokenizer(4096), tmp_path / "m.llmkit", model_name="m")
    sm = jit.load(path, compiler="none")
    assert unpack_panel_weights(sm.programs.values()) == 2 * 7 + 1  # every linear, the MLP's included
    text = str(sm.programs["decode"].program)
    assert "panel = 16" not in text and "llm.tiled_linear_swiglu" in text
    served = Engine.from_static(path, EngineConfig(max_batch=4, compiler="none"))
    ref = Engine.from_model(model, config=EngineConfig(max_batch=4, compiler="none"))
    assert [o.token_ids for o in served.generate(prompts, params)] == [
        o.token_ids for o in ref.generate(prompts, params)
    ]


@pytest.mark.parametrize("tied", [False, True])
def test_the_score_head_is_fused_where_its_kernel_reads_the_weight(tied):
    """Compiled, the fused head reads 16-column panels or the tied embedding's rows: an untied head
    of a vocabulary that is no multiple of 16 keeps tiled_linear and the separate reductions."""
    if not available():
        pytest.skip("no working C compiler")
    from .conftest import tiny_model

    model = tiny_model(vocab_size=4100, num_hidden_layers=1, tie_word_embeddings=tied)
    programs, _ = trace_programs(model, programs=("score",), compiler="cinn")
    ops = [op.name for op in programs["score"].concrete.program.walk()]
    assert ("llm.tiled_linear_logprobs" in ops) == tied and ("llm.logsumexp" in ops) != tied
