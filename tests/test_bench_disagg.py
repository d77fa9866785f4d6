"""`python -m minikv bench-disagg` in its quick mode: the shape of what it measures and writes
(never its timings, which belong to the committed run in benchmarks/disagg)."""
import json

import pytest

from minikv.__main__ import main
from minikv.bench import disagg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One quick run of the command (a tiny random model, one repeat): its folder, and what
    it printed."""
    import contextlib
    import io
    out, printed = tmp_path_factory.mktemp("bench-disagg") / "out", io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["bench-disagg", "--quick", "--out", str(out)]) == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def results(run):
    return json.loads((run[0] / "results.json").read_text())


def test_the_long_prompt_case_runs_in_every_configuration(results):
    rows = results["long_prompt"]
    assert [r["config"] for r in rows] == list(disagg.CONFIGS)
    assert all(r["same_tokens"] for r in rows)  # every configuration, the same tokens
    base = rows[0]
    assert base["itl_p99_vs_1t"] == base["long_ttft_vs_1t"] == 1.0
    for r in rows:
        assert r["itl_p99_vs_1t"] == pytest.approx(r["itl_p99"] / base["itl_p99"])
        assert r["itl_p50"] <= r["itl_p99"] <= r["itl_max"] and r["long_ttft"] > 0
    # colocated moves nothing; disaggregated moves every prompt but its last token, K and V
    n, long = results["long"]["n_running"], results["long"]["long_len"]
    per_position = results["break_even"][0]["bytes_per_position"]
    assert [r["bytes_moved"] for r in rows[:2]] == [0, 0]
    assert rows[2]["bytes_moved"] == per_position * (n * (8 - 1) + long - 1)


def test_the_break_even_is_fitted_and_checked_at_every_length(results):
    [be] = results["break_even"]  # quick: the one model's
    assert be["model"] == "tiny preset, random weights"
    assert [r["positions"] for r in be["rows"]] == [8, 32, 64]
    for r in be["rows"]:
        assert r["bytes"] == r["positions"] * be["bytes_per_position"]
        assert {r["predicted"], r["measured"]} <= {"transfer", "recompute"}
        slower = r["predicted_transfer_s"] > r["predicted_recompute_s"]
        assert r["predicted"] == ("recompute" if slower else "transfer")
    assert be["agree"] == sum(r["predicted"] == r["measured"] for r in be["rows"])
    assert be["ship_per_position_s"] == pytest.approx(
        be["bytes_per_position"] * be["seconds_per_byte"])
    # the break-even is where the fitted lines cross
    cut = be["break_even"]
    assert be["latency_s"] + be["ship_per_position_s"] * cut == pytest.approx(
        be["prefill_fixed_s"] + be["prefill_per_position_s"] * cut)


def test_the_command_writes_its_readme_and_json(run, results):
    assert set(results) >= {"machine", "long_prompt", "break_even", "command"}
    readme = (run[0] / "README.md").read_text()
    assert "| disaggregated, 1 + 1 threads |" in readme and "L* =" in readme
    assert readme in run[1]  # printed as written
