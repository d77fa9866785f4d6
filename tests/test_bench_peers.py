"""bench-peers (optional: llama.cpp needs a compiler and its converter): the rows that need
neither run here, the same greedy tokens from transformers and this engine; what is missing is
named with what to do; with llama-cpp-python and LLAMA_CPP_SRC present, llama.cpp's rows too."""
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest

from minikv.bench.peers import converter

from conftest import cli_exit

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def rows(out: Path) -> dict:
    return {r["name"]: r for r in json.loads((out / "results.json").read_text())["peers"]["rows"]}


def test_without_llama_cpp_transformers_and_the_engine_give_the_same_greedy_tokens(tmp_path):
    code, err = cli_exit("bench-peers", "--quick", "--without-llama-cpp", "--out", str(tmp_path))
    assert code == 0, err
    got = rows(tmp_path)
    assert set(got) == {"transformers fp32", "minikv fp32", "minikv bf16", "minikv int8"}
    assert got["transformers fp32"]["same_tokens"] and got["minikv fp32"]["same_tokens"]
    assert got["transformers fp32"]["bytes"] == got["minikv fp32"]["bytes"]  # the same weights
    assert got["minikv int8"]["bytes"] < got["minikv fp32"]["bytes"] / 3
    # times are the benchmark's (--quick: one noisy run); here only that each was taken
    assert all(math.isfinite(r["step_s"]) and r["prompt_tps"] > 0 for r in got.values())
    report = (tmp_path / "README.md").read_text()
    assert "llama.cpp was not run" in report and "× transformers fp32" in report


@pytest.mark.skipif(HAVE_LLAMA_CPP, reason="llama-cpp-python is installed here")
def test_without_llama_cpp_python_the_bench_says_how_to_get_it(tmp_path):
    code, err = cli_exit("bench-peers", "--quick", "--out", str(tmp_path))
    assert code == 2 and "pip install llama-cpp-python" in err and "--without-llama-cpp" in err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_the_converters_folder_is_checked_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="pass --llama-cpp-src"):
        converter(None)
    with pytest.raises(ValueError, match="holds no convert_hf_to_gguf.py"):
        converter(tmp_path)


@pytest.mark.skipif(not HAVE_LLAMA_CPP or not os.environ.get("LLAMA_CPP_SRC"),
                    reason="needs llama-cpp-python and LLAMA_CPP_SRC (benchmarks/peers/README.md)")
def test_llama_cpp_decodes_the_converted_target_to_the_engines_tokens(tmp_path):
    code, err = cli_exit("bench-peers", "--quick", "--out", str(tmp_path))
    assert code == 0, err
    got = rows(tmp_path)
    assert all(got[f"llama.cpp {k}"]["same_tokens"] for k in ("F32", "F16", "Q8_0"))
    assert got["llama.cpp Q8_0"]["bytes"] < got["llama.cpp F16"]["bytes"] < \
        got["llama.cpp F32"]["bytes"]
