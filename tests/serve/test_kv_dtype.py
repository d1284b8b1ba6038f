"""``llmkit serve --kv-dtype``: the engine's option, its error in one line."""

from __future__ import annotations

import json

import numpy as np

from llmkit.cli import main as cli_main


def test_serve_kv_dtype_int8_sizes_its_pool_and_rejects_other_dtypes(model_file, monkeypatch, capsys):
    import llmkit.serve.server as server

    monkeypatch.setattr(server, "spin_between_kernels", lambda: False)
    monkeypatch.setattr(server, "set_blas_threads", lambda n: True)
    spec = json.loads((model_file / "manifest.json").read_text())["metadata"]["engine"]
    rows = spec["num_layers"] * 2 * spec["num_kv_heads"] * spec["block_size"]
    block = rows * (spec["head_dim"] + 4)  # int8 codes and a float32 scale per row
    args = [str(model_file), "--kv-memory", str(5 * block + 7), "--kv-dtype", "int8", "--compiler", "none"]
    engine = server.load_engine(server.parse_args(args))
    assert engine.runner.pool.dtype == np.int8 and engine.runner.pool.nbytes == 5 * block
    assert cli_main(["serve", str(model_file), "--kv-dtype", "int4", "--host", "256.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "(--kv-dtype, kv_dtype) must be the model's (float32) or int8, got 'int4'" in err
    )
