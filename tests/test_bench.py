"""The benchmark's machinery runs end to end (--quick: tiny models, no timing asserted)."""
import json

from minikv import bench


def test_quick_benchmark_writes_its_report(tmp_path):
    assert bench.main(["--quick", "--out", str(tmp_path), "--device", "cpu"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"machine", "naive_vs_cached", "kv_counted", "roofline", "speculative",
            "deterministic"} <= set(results)
    # the engine's counters agree with N·P + N(N−1)/2 and P + N − 1
    for row in results["kv_counted"]:
        assert row["naive"] == row["naive_predicted"] and row["cached"] == row["cached_predicted"]
    assert all(r["identical"] for r in results["speculative"]["rows"])
    # plain and column-parallel minikv both decode transformers' greedy tokens
    if results["vs_transformers"]:
        assert {"minikv", "minikv column-parallel"} == set(results["vs_transformers"]["models"])
        assert all(r["same_tokens"] for r in results["vs_transformers"]["models"].values())
    assert {"minikv", "minikv column-parallel"} == set(results["roofline"]["models"])
    assert all(r["c_run"] > 0 and r["verify_cost"] > 0 and r["predicted_measured"] > 0
               for r in results["speculative"]["rows"])
    assert (tmp_path / "plots.png").stat().st_size > 0
    assert "| window |" in (tmp_path / "README.md").read_text()
