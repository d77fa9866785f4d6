"""The host's waits for a GPU, counted on a CPU (bench/syncs.py, issue 56 item 1): the counter
counts what a GPU would wait for, and every decoder waits as little as its design needs: one
read back a step or a round, no blocking upload behind queued kernels."""
import json
from types import SimpleNamespace

import pytest
import torch

import minikv
from minikv.bench import random_model
from minikv.bench.syncs import count_waits, main, per_token
from minikv.engine import FeatureHead, validate
from minikv.engine.cache import upload


@pytest.fixture(scope="module")
def tiny():
    return random_model("tiny", torch.device("cpu"))


# --- the counter --------------------------------------------------------------------
def test_a_read_of_a_computed_value_is_a_wait_and_so_is_a_blocking_upload_behind_kernels():
    x = torch.arange(8.0)
    with count_waits() as waits:
        torch.tensor([1, 2], device="cpu")     # nothing queued: waits for its own copy only
        y = (x * 2).sum()                      # a kernel queued
        torch.tensor([3], device="cpu")        # behind it: waits
        upload([4], torch.device("cpu"))       # non_blocking: queued, no wait
        int(y)                                 # a read: waits
        x[x > 3]                               # a boolean mask: its size is read back
        torch.tensor([5], device="cpu")        # behind the mask's gather: waits
    assert sum(waits.reads.values()) == 2 and sum(waits.uploads.values()) == 2
    assert [what for what, _ in waits.reads] == ["__int__", "index"]


def test_value_checks_take_their_gpu_branch_while_counting_and_come_back_after():
    assert validate.reads_are_free(torch.zeros(1))
    with pytest.raises(RuntimeError), count_waits():
        assert not validate.reads_are_free(torch.zeros(1))
        raise RuntimeError("inside")
    assert validate.reads_are_free(torch.zeros(1))


# --- the decoders ---------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_reads_one_token_a_step_and_uploads_behind_nothing(tiny, temperature):
    """Sampling used to check its probabilities were finite with a second read a step."""
    reads, uploads, _ = per_token(
        lambda n: len(minikv.generate(tiny, [1, 2, 3], n, temperature=temperature).tokens), 8)
    assert (reads, uploads) == (1.0, 0.0)


def test_a_batch_reads_its_tokens_back_once_a_step_whatever_its_rows(tiny):
    """It used to read each row's done flag, then all of them: B + 2 reads a step."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    reads, uploads, waits = per_token(lambda n: sum(
        len(o.tokens) for o in minikv.generate_batch(tiny, prompts, n)), 8)
    assert (reads, uploads) == (1 / 4, 0.0), waits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_speculative_round_reads_twice_the_proposals_and_the_verdict(tiny, temperature):
    """The draft reads its γ tokens back once, at the round's end (it used to read each
    as it made it), and the verdict needs one read when greedy (it used to read each
    position's choice) and two when sampled (the γ tests, then the token drawn)."""
    def rounds(n):
        out = minikv.speculative_generate(tiny, tiny, [1, 2, 3], n, gamma=4,
                                          temperature=temperature)
        return out.stats.rounds
    reads, uploads, waits = per_token(rounds, 10)
    assert (reads, uploads) == (2.0 if temperature == 0 else 3.0, 0.0), waits


def test_a_feature_head_chain_reads_its_guesses_once_a_round(tiny):
    head = FeatureHead(FeatureHead.config_for(tiny)).eval()
    reads, uploads, waits = per_token(lambda n: minikv.feature_generate(
        tiny, head, [1, 2, 3], n, gamma=4).stats.rounds, 8)
    assert (reads, uploads) == (2.0, 0.0), waits


@pytest.mark.parametrize("graphs", [None, (1, 2, 4)])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_server_step_reads_its_tokens_once_whatever_its_batch(tiny, graphs, sampled):
    """Greedy and sampled rows alike (a sampled row used to read its own token back)."""
    def steps(n):
        engine = minikv.engine.Engine(tiny, num_blocks=32, graphs=graphs)
        for i, prompt in enumerate(([1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12])):
            temperature = 1.0 if sampled and i % 2 else 0.0
            engine.add(minikv.Request(prompt, n, temperature=temperature, seed=i))
        count = 0
        while engine.has_work():
            engine.step()
            count += 1
        return count
    reads, uploads, waits = per_token(steps, 8)
    assert (reads, uploads) == (1.0, 0.0), waits


def test_bench_syncs_writes_its_table(tmp_path):
    assert main(["--quick", "--new", "4", "--out", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    names = [row["decoder"] for row in results["rows"]]
    assert "generate, greedy" in names and "server, 4 requests, CUDA-graph pass" in names
    assert all(row["reads"] >= 0 and row["uploads"] >= 0 for row in results["rows"])
    assert "| generate, greedy | 1.00 | 0.00 |" in (tmp_path / "out" / "README.md").read_text()


def test_an_engine_from_before_the_switch_has_its_cpu_only_checks_left_out():
    """An earlier engine (bench-syncs --previous) checked ids only on a CPU, in
    model._check_values, with no switch to turn: those reads are not a GPU's."""
    earlier = SimpleNamespace(validate=SimpleNamespace())

    def _check_values(t):
        return bool(t.sum() > 0)
    with count_waits(earlier) as waits:
        _check_values(torch.ones(2))
        int(torch.ones(1).sum())
    assert [what for what, _ in waits.reads] == ["__int__"]
    assert not hasattr(earlier.validate, "FREE_READS")


def test_bench_syncs_counts_an_earlier_engine_beside(tmp_path):
    out = tmp_path / "out"
    assert main(["--quick", "--new", "2", "--previous", "HEAD", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert all("previous" in row for row in rows)
    assert "at `HEAD`: reads / uploads" in (out / "README.md").read_text()
