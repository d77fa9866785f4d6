"""The command line works end to end on the course model and on random ones, and bad input exits
with a clear message."""
import subprocess
import sys

import minikv
from minikv import __main__ as cli


def test_generate_prints_tokens_and_stats(capsys):
    assert cli.main(["generate", "--prompt", "Once upon a", "--mode", "naive",
                     "--max-new-tokens", "5", "--preset", "tiny", "--trace"]) == 0
    out = capsys.readouterr().out
    assert "prompt tokens: [" in out and "new tokens:" in out
    # seed 003: 3+4+5+6+7
    assert "forward_passes=5 positions_processed=25 kv_computed_per_layer=25" in out
    assert out.count("recompute") == 5


def test_bad_input_exits_2_with_a_message(capsys):
    assert cli.main(["generate", "--prompt", "x", "--max-new-tokens", "9999",
                     "--preset", "tiny"]) == 2
    assert "lower max_new_tokens" in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "minikv", "generate",
                             "--prompt", "The color of dog", "--max-new-tokens", "3",
                             "--preset", "tiny"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # 4-token prefill + 2 decodes
    assert "mode=cached forward_passes=3 positions_processed=6" in result.stdout
    assert "Warning" not in result.stderr


def test_generate_with_the_course_model(capsys):
    assert cli.main(["generate", "--prompt", "The color of dog", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    target, _ = minikv.load_course_model("target", device="cpu")
    assert f"model: course target ({target.num_params():,} parameters)" in out
    assert "text:          'The color of dog " in out


def test_generate_with_tensor_parallelism_prints_each_ranks_heads(capsys):
    """--tp 2: the same tokens as one process, each rank's half of the heads and its cache."""
    argv = ["generate", "--prompt", "The color of dog", "--max-new-tokens", "6", "--device",
            "cpu"]
    assert cli.main(argv) == 0
    alone = capsys.readouterr().out
    assert cli.main(argv + ["--tp", "2"]) == 0
    split = capsys.readouterr().out
    line = next(x for x in alone.splitlines() if x.startswith("new tokens:"))
    assert line in split
    assert "rank 0: query heads 0..3, K/V heads 0..3, cache " in split
    assert "rank 1: query heads 4..7, K/V heads 4..7, cache " in split
    assert cli.main(argv + ["--tp", "3"]) == 2
    assert "world=3 does not split 8 heads" in capsys.readouterr().err
