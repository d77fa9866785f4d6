"""bench-batch's roofline: its bytes and FLOPs as the formula defines them (checked against the
engine's own counts), and its machinery on a tiny model (timings are a benchmark's)."""
import json

import torch

import minikv
from minikv.bench.batch import bench, predicted


def test_bytes_are_the_weights_once_and_each_rows_cache_flops_grow_with_the_batch():
    torch.manual_seed(0)
    model = minikv.GPT(minikv.GPTConfig.preset("tiny")).eval()
    cfg = model.config
    one, many = (predicted(model, b, 32, bandwidth=1.0, peak=1.0) for b in (1, 8))
    kv = minikv.kv_cache_bytes(cfg, 32, dtype=torch.float32)
    assert many["bytes"] - one["bytes"] == 7 * kv  # the weights are read once for all rows
    assert many["flops"] == 8 * one["flops"]
    numbers = sum(p.numel() for p in model.parameters())
    matmul = numbers - cfg.block_size * cfg.n_embd  # the position table is looked up
    assert one["flops"] == 2 * matmul + 4 * cfg.n_embd * cfg.n_layer * 32
    weights = (numbers - (cfg.block_size - 1) * cfg.n_embd) * 4  # one row of wpe read
    assert one["bytes"] == weights + kv


def test_the_bench_runs_and_finds_where_the_step_turns_compute_bound():
    torch.manual_seed(0)
    model = minikv.GPT(minikv.GPTConfig.preset("tiny")).eval()
    r = bench(model, torch.device("cpu"), (16,), (1, 64), 1)
    assert [row["batch"] for row in r["rows"]] == [1, 64]
    assert all(row["measured_s"] > 0 for row in r["rows"])
    first = r["first_compute_bound_batch"][16]
    assert first in (None, 1, 64)
    assert r["rows"][0]["bound"] in ("memory", "compute")


def test_the_chapters_quote_each_committed_run_and_say_which_is_missing(tmp_path):
    """quote_committed (chapters 01 and 06): per context its batches, measured and predicted
    times and the roofline's call, for the runs present; the command for one that is not."""
    from minikv.bench.batch import main, quote_committed
    assert main(["--quick", "--out", str(tmp_path / "batch-cpu")]) == 0
    text = quote_committed(tmp_path)
    run = json.loads((tmp_path / "batch-cpu" / "results.json").read_text())["batch"]
    contexts = {r["context"] for r in run["rows"]}
    assert text.count("measured ms") == text.count("predicted ms") == len(contexts)
    for r in run["rows"]:
        assert f"{r['measured_s'] * 1e3:.2f}" in text and f"{r['predicted_s'] * 1e3:.2f}" in text
    assert text.endswith("benchmarks/gpu/batch: not committed yet "
                         "(python -m minikv bench-batch --device cuda)")
