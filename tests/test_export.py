"""The way out (issue 33): a course model exported as a Hugging Face checkpoint loads in
transformers, which then tokenizes as the course tokenizer does and decodes the same greedy tokens
as minikv, for the GPT-2 block (the shipped target), the Llama-style block (the shipped
target-rope) and a grouped-query Llama."""
import pytest
import torch

import minikv
from minikv.course import export
from minikv.course.checkpoint import save_checkpoint
from minikv.engine.config import LLAMA

from conftest import cli_exit, varied_model

transformers = pytest.importorskip("transformers")
TEXTS = ["A coin's state is heads. Alice flips, then Bob does not flip. What's the state? A:",
         "Once upon a time, there was a little dog named Max.", "Ünïcode, 12345 and  spaces\n"]


def greedy_equal(model, directory, prompt, n=40, eot=1023):
    """Both greedy, both stopping after <|endoftext|> (transformers reads it from the config)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=eot)[0, len(prompt):].tolist()
    mine = minikv.generate(model, prompt, n, eos_id=eot).tokens
    return mine == theirs and len(set(mine)) > 3, (mine, theirs)


@pytest.mark.parametrize("name, family", [("target", "GPT2LMHeadModel"),
                                          ("target-rope", "LlamaForCausalLM")])
def test_a_course_model_loads_in_transformers_and_decodes_the_same(tmp_path, name, family):
    model, tok = minikv.load_course_model(name, "cpu")
    out = export.export_hf(model, tmp_path / f"{name}-hf")
    assert transformers.AutoConfig.from_pretrained(out).architectures == [family]
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == tok.encode(text), text
    assert theirs.eos_token_id == tok.eot_token
    equal, tokens = greedy_equal(model, out, tok.encode(TEXTS[1]))
    assert equal, tokens


def test_a_llama_style_model_loads_as_a_llama(tmp_path):
    model = varied_model("tiny", seed=4, std=0.2, vocab_size=1024, n_kv_head=2, n_inner=176,
                         **LLAMA)
    out = export.export_hf(model, tmp_path / "llama-hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.num_key_value_heads == 2
    idx = torch.randint(0, 1024, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(idx).logits - model(idx)).abs().max() < 1e-4
    equal, tokens = greedy_equal(model, out, [5, 6, 7, 8])
    assert equal, tokens


def test_what_has_no_hugging_face_class_or_would_overwrite_is_refused(tmp_path):
    gqa, _ = minikv.load_course_model("target-gqa2", "cpu")
    with pytest.raises(ValueError, match="no Hugging Face architecture"):
        export.export_hf(gqa, tmp_path / "gqa")
    assert not (tmp_path / "gqa").exists()
    target, _ = minikv.load_course_model("target", "cpu")
    with pytest.raises(ValueError, match="inside the minikv package"):
        export.export_hf(target, export.PACKAGE / "course" / "models" / "target")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    for force in (False, True):  # a folder of someone's files is not replaced, --force or not
        with pytest.raises(ValueError, match=r"did not write \(notes.txt\)"):
            export.export_hf(target, tmp_path / "taken", force=force)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_the_command_line_exports_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(minikv.GPT(minikv.GPTConfig.preset("tiny", vocab_size=1024)),
                    tmp_path / "mine")
    code, _ = cli_exit("export", "--checkpoint", str(tmp_path / "mine"),
                       "--out", str(tmp_path / "mine-hf"))
    assert code == 0 and (tmp_path / "mine-hf" / "tokenizer.json").is_file()
    code, err = cli_exit("export", "--checkpoint", str(tmp_path / "mine"),
                         "--out", str(tmp_path / "mine-hf"))
    assert code == 2 and "--force" in err
    (tmp_path / "mine-hf" / "config.json").write_text("{}")  # what --force must put back
    code, _ = cli_exit("export", "--checkpoint", str(tmp_path / "mine"),
                       "--out", str(tmp_path / "mine-hf"), "--force")
    assert code == 0 and (tmp_path / "mine-hf" / "config.json").read_text() != "{}"
    assert (tmp_path / "mine-hf" / ".minikv-output").read_text().startswith(
        "python -m minikv export\n")  # still marked: a later --force may replace it again
    code, err = cli_exit("export", "--checkpoint", str(tmp_path / "nothing"))
    assert code == 2 and "nothing is not there: give a directory" in err


@pytest.mark.parametrize("choices, family", [
    (dict(tied_head=False), "LlamaForCausalLM"),
    (dict(rope_scaling=("llama3", 32.0, 1.0, 4.0, 64), rope_theta=500000.0), "LlamaForCausalLM"),
    (dict(qkv_bias=True), "Qwen2ForCausalLM"),
    (dict(qkv_bias=True, tied_head=False), "Qwen2ForCausalLM"),
    (dict(qk_norm=True, head_size=32), "Qwen3ForCausalLM"),
])
def test_the_real_models_choices_export_to_their_family(tmp_path, choices, family):
    """Issue 55's block choices: q/k/v biases make a Qwen2, q/k norms a Qwen3; an untied head
    and Llama 3's RoPE scaling are written into the config; transformers computes the same."""
    model = varied_model("tiny", seed=4, std=0.2, vocab_size=1024, n_kv_head=2, n_inner=176,
                         **LLAMA, **choices)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms' scales and biases, not their defaults
                p.uniform_(0.5, 1.5)
    out = export.export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == family
    assert hf.config.tie_word_embeddings == model.config.tied_head
    idx = torch.randint(0, 1024, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(idx).logits - model(idx)).abs().max() < 1e-4


def test_choices_no_hugging_face_family_has_are_refused(tmp_path):
    both = minikv.GPT(minikv.GPTConfig.preset("tiny", **LLAMA, qkv_bias=True, qk_norm=True))
    untied_gpt2 = minikv.GPT(minikv.GPTConfig.preset("tiny", tied_head=False))
    for model in (both, untied_gpt2):
        with pytest.raises(ValueError, match="no Hugging Face architecture"):
            export.export_hf(model, tmp_path / "out")
        assert not (tmp_path / "out").exists()
