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


def test_quick_load_benchmark_writes_its_report(tmp_path):
    from minikv.bench import load
    assert load.main(["--quick", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "results.json").read_text())["load"]
    assert len({row["load"] for row in r["rates"]}) >= 2
    for row in r["rates"] + r["policies"]:
        for name in ("ttft", "itl", "e2e"):
            assert row[f"{name}_p50"] <= row[f"{name}_p90"] <= row[f"{name}_p99"]
        assert 0 <= row["goodput_per_s"] <= row["requests_per_s"]
    assert [row["policy"] for row in r["long_prompt"]][0] == "first come, first served"
    assert r["step_cost_fit"]["per_token_s"] == r["step_cost_fit"]["per_token_s"]  # not NaN
    assert all(row["same_tokens"] for row in r["vs_transformers"]["rows"])
    assert "| load | policy |" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "plots.png").stat().st_size > 0


def test_latency_report_by_hand():
    """Three requests with token times chosen by hand: the percentiles, throughput and goodput
    the report gives are the ones worked out here."""
    from minikv.bench.load import Timed, pct, report
    timed = [Timed(0.0, 4, [1.0, 1.5, 2.0]),    # TTFT 1.0, ITL 0.5, 0.5
             Timed(1.0, 4, [1.2, 3.2]),         # TTFT 0.2, ITL 2.0: too slow a stream
             Timed(2.0, 4, [6.0])]              # TTFT 4.0: too late a first token
    row = report(timed, step_1=0.5, slo_ttft=3, slo_itl=2)  # SLO: TTFT <= 1.5 s, mean ITL <= 1 s
    assert row["seconds"] == 6.0 and row["tokens_per_s"] == 1.0
    assert row["slo_met"] == 1 / 3 and row["goodput_per_s"] == 1 / 6
    assert row["ttft_p50"] == 1.0 and row["ttft_p50_steps"] == 2.0
    assert pct([0.5, 0.5, 2.0], 50) == 0.5 and pct([1, 2, 3, 4], 50) == 2.5
    assert abs(row["itl_p99"] - pct([0.5, 0.5, 2.0], 99)) < 1e-12


def test_quick_speculation_benchmark_writes_its_report(tmp_path):
    """Every proposer's output identical to the target's; the serving curve's rows complete."""
    from minikv.bench import speculation
    assert speculation.main(["--quick", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert {row["method"] for row in r["rows"]} == {"draft model", "feature head",
                                                   "feature tree 2x2"}
    assert all(row["identical"] for row in r["rows"] + r["serving"]["rows"])
    assert [row["batch"] for row in r["serving"]["rows"]] == [1, 2]
    assert all(row["verify_pass_rows"] > row["decode_pass_rows"] for row in r["serving"]["rows"])
    # plain and speculative on one kernel: the same tokens as the paged decode; spreads kept
    assert all(row["identical_to_paged"] and row["paged_decode_pass_s"] > 0
               and row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
               for row in r["serving"]["rows"])
    assert (tmp_path / "serving.png").stat().st_size > 0
    assert "| batch |" in (tmp_path / "README.md").read_text()
