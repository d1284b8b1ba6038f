"""PIR throughput: build, verify, print, parse and a canonicalize + CSE + DCE pipeline.

Programs are stacks of a Llama-like block (rms_norm, projections, gated MLP) written the way a
tracer emits them — with duplicate projections, x*1, reshape and transpose round trips and dead
ops for the passes to remove. Each stage runs on a 10,000-op program and on one twice as large
(interleaved, best of --repeat); PIR is linear when the larger takes at most twice as long. One
JSON line per figure:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/pir.py [--ops 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from llmkit.framework import ir

D, HEADS = 64, 4
F32 = "float32"


def build(n_ops: int) -> ir.Program:
    """A program of ``n_ops`` ops or a few more (layers of the block below until the count is
    reached), built the way a tracer builds, with the cyclic GC paused (``ir.paused_gc``)."""
    with ir.paused_gc():
        return _build(n_ops)


def _build(n_ops: int) -> ir.Program:
    p = ir.Program()
    f = p.add_function("forward", [("x", ir.TensorType(["B", "S", D], F32))])
    b = ir.Builder.at_end(f.body)
    L = b.llm
    h = f.args[0]
    one = L.full(shape=[], value=1.0)
    layer = 0
    while len(f.body) < n_ops:
        w = {
            k: b.parameter(f"layers.{layer}.{k}", ir.TensorType(s, F32))
            for k, s in (
                ("norm", [D]),
                ("wq", [D, D]),
                ("wg", [2 * D, D]),
                ("wu", [2 * D, D]),
                ("wd", [D, 2 * D]),
            )
        }
        n = L.rms_norm(h, w["norm"])
        q = L.mul(L.matmul(n, w["wq"], transpose_y=True), one)  # x * 1
        q2 = L.matmul(n, w["wq"], transpose_y=True)  # a duplicate for CSE
        r = L.reshape(L.reshape(q, shape=["B", "S", HEADS, D // HEADS]), shape=["B", "S", D])
        t = L.transpose(L.transpose(r, perm=[0, 2, 1]), perm=[0, 2, 1])
        gate = L.matmul(L.add(t, q2), w["wg"], transpose_y=True)
        up = L.matmul(n, w["wu"], transpose_y=True)
        d = L.matmul(L.mul(L.silu(gate), up), w["wd"], transpose_y=True)
        L.exp(d)  # dead
        h = L.add(h, d)
        layer += 1
    b.ret(h)
    return p


def run_once(n_ops: int) -> dict[str, tuple[float, int]]:
    """Seconds and op count of each stage, once."""
    out: dict[str, tuple[float, int]] = {}
    t = time.perf_counter()
    p = build(n_ops)
    ops = p.num_ops()
    out["build"] = (time.perf_counter() - t, ops)
    t = time.perf_counter()
    p.verify()
    out["verify"] = (time.perf_counter() - t, ops)
    t = time.perf_counter()
    text = str(p)
    out["print"] = (time.perf_counter() - t, ops)
    t = time.perf_counter()
    q = ir.parse(text)
    out["parse"] = (time.perf_counter() - t, ops)
    assert str(q) == text
    t = time.perf_counter()
    ir.PassManager(["canonicalize", "cse", "dce"], verify=False).run(q)
    out["canonicalize+cse+dce"] = (time.perf_counter() - t, ops)
    out["ops_after_pipeline"] = (0.0, q.num_ops())
    return out


def measure(n_ops: int, repeat: int) -> dict[str, dict]:
    """Per stage: best seconds at ``n_ops`` and ``2 * n_ops`` and the median over repeats of the
    time ratio 2N/N. The two sizes run back to back in each repeat, so a burst of load from
    other processes skews one ratio, not the median."""
    run_once(n_ops // 10)  # warm up: imports, op-table caches, interned types
    runs: list[tuple[dict, dict]] = []
    for _ in range(repeat):
        gc.collect()
        small = run_once(n_ops)
        gc.collect()
        runs.append((small, run_once(2 * n_ops)))
    out: dict[str, dict] = {}
    for stage in runs[0][0]:
        ratios = sorted(b[stage][0] / a[stage][0] for a, b in runs if a[stage][0] > 0)
        out[stage] = {
            "ops": runs[0][0][stage][1],
            "ops_2x": runs[0][1][stage][1],
            "seconds": min(a[stage][0] for a, _ in runs),
            "seconds_2x": min(b[stage][0] for _, b in runs),
            "ratio": ratios[len(ratios) // 2] if ratios else 0.0,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--ops", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    results = measure(args.ops, args.repeat)
    for stage, m in results.items():
        if stage == "ops_after_pipeline":
            before = results["build"]["ops"]
            print(
                json.dumps(
                    {
                        "bench": "pir",
                        "figure": "ops_after_pipeline",
                        "ops_before": before,
                        "ops_after": m["ops"],
                    }
                )
            )
            continue
        size_ratio = m["ops_2x"] / m["ops"]
        print(
            json.dumps(
                {
                    "bench": "pir",
                    "stage": stage,
                    "ops": m["ops"],
                    "seconds": round(m["seconds"], 4),
                    "ops_per_s": round(m["ops"] / m["seconds"]),
                    "ops_2x": m["ops_2x"],
                    "seconds_2x": round(m["seconds_2x"], 4),
                    "time_ratio_2x": round(m["ratio"], 3),
                    "at_most_double": m["ratio"] <= size_ratio,
                }
            )
        )


if __name__ == "__main__":
    main()
