"""`python -m minikv bench-sessions --quick` runs end to end: every cache at both pool sizes on
both workloads, ratios from the same run, every reply as no cache gives it, and the tree with
its tier computing fewer prefill tokens than hashed blocks everywhere (no timing asserted)."""
import json

import pytest

from minikv.bench import sessions
from minikv.course.tokenizer import load_tokenizer

CACHES = ["no cache", "hash blocks", "radix tree", "radix + tier"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench-sessions")
    assert sessions.main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    assert "| workload | pool (blocks) | cache |" in (out / "README.md").read_text()
    return json.loads((out / "results.json").read_text())


def test_every_cache_at_both_pool_sizes_on_both_workloads(results):
    rows = results["rows"]
    assert [(r["workload"], r["pool"], r["cache"]) for r in rows] == [
        (w, p, c) for w in ("dialogues", "agent") for p in ("roomy", "tight") for c in CACHES]
    for r in rows:
        assert r["same_replies"], r
        assert r["prefill"] + r["reused"] >= r["prompt_positions"]  # preemption: more
        assert 0 <= r["hit_rate"] < 1 and r["peak_blocks"] <= r["pool_blocks"]


def test_ratios_are_against_the_same_runs_baselines(results):
    at = {(r["workload"], r["pool"], r["cache"]): r for r in results["rows"]}
    for (w, p, c), r in at.items():
        none, hashed = at[w, p, "no cache"], at[w, p, "hash blocks"]
        for key in ("prefill", "ttft_p50_ms", "ttft_p99_ms"):
            assert r[f"{key}_vs_none"] == pytest.approx(r[key] / none[key])
            assert r[f"{key}_vs_hash"] == pytest.approx(r[key] / hashed[key])
        assert none["prefill"] == none["prompt_positions"] and none["reused"] == 0


def test_the_tree_with_its_tier_computes_fewer_prefill_tokens_than_hashed_blocks(results):
    at = {(r["workload"], r["pool"], r["cache"]): r for r in results["rows"]}
    assert sessions.tier_beats_hash(results["rows"]) == []
    for w in ("dialogues", "agent"):
        for p in ("roomy", "tight"):
            assert at[w, p, "radix + tier"]["prefill"] < at[w, p, "hash blocks"]["prefill"]
        # roomy: the tree keeps everything; tight: it must evict, and the tier takes it
        assert at[w, "roomy", "radix tree"]["evicted"] == 0
        assert at[w, "tight", "radix tree"]["evicted"] > 0
        assert at[w, "tight", "radix + tier"]["to_tier"] > 0
        assert at[w, "tight", "radix + tier"]["dropped"] == 0


def test_the_scripts_are_fixed_and_fit_the_context():
    tok = load_tokenizer()
    script = sessions.agent(tok, 48, 2, 3, 2)
    assert script == sessions.agent(tok, 48, 2, 3, 2)
    assert {op for op, *_ in script} == {"say", "fork", "rewind"}
    assert len(script[0][1][0][1]) >= 48  # the instruction, said once
    talk = sessions.dialogues(tok, 3, 3)
    assert [len(said) for _, said in talk] == [3, 3, 3]
    assert tok.decode(talk[1][1][0][1]).endswith(". What's the state? A:")
    roomy, alone = sessions.pool_sizes(talk, 4)
    assert roomy > alone > 0
