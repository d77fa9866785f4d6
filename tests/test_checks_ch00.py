"""Chapter 00: the checkers accept the solutions, let the exercise stub's NotImplementedError
through, and reject every plausible wrong answer below with a hint that names the mistake."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minikv
from minikv.course import checks
from minikv.course.checks import CheckFailed, ch00
from minikv.engine.model import causal_attention

from conftest import stub

# --- the solutions ------------------------------------------------------------------------------


def count_params(cfg):
    C = cfg.n_embd
    per_block = (2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C)
                 + (4 * C * C + C))
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * per_block + 2 * C


def encode_documents(tok, docs):
    ids = []
    for doc in docs:
        ids += tok.encode(doc) + [tok.eot_token]
    return ids


def encode_documents_joined(tok, docs):
    """Also right: one text with the special token allowed."""
    return tok.encode("".join(d + "<|endoftext|>" for d in docs), allowed_special={"<|endoftext|>"})


def forward_by_hand(model, idx):
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1], device=idx.device))
    for i, block in enumerate(tr.h):
        x = block(x, None, i, causal_attention)
    return model.lm_head(tr.ln_f(x))


def attention_spelled_out(block, x, causal=True):
    """One block's attention written out: q kᵀ / √hs, the causal mask, softmax, times v."""
    B, T, C = x.shape
    nh = block.attn.n_head
    q, k, v = block.attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / (C // nh) ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
    return block.attn.c_proj(y)


def forward_spelled_out(model, idx, causal=True):
    """Also right (with causal=True): every block written out."""
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
    for block in tr.h:
        x = x + attention_spelled_out(block, block.ln_1(x), causal)
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(tr.ln_f(x))


def test_solutions_pass(capsys):
    state = torch.get_rng_state()
    ch00.check_count_params(count_params)
    ch00.check_count_params(lambda cfg: np.int64(count_params(cfg)))  # a numpy int is an int
    ch00.check_encode_documents(encode_documents)
    ch00.check_encode_documents(encode_documents_joined)
    ch00.check_forward_by_hand(forward_by_hand)
    ch00.check_forward_by_hand(forward_spelled_out)
    assert capsys.readouterr().out.count("✓") == 6
    assert torch.equal(torch.get_rng_state(), state), "a checker moved the caller's random state"


@pytest.mark.parametrize("check", [ch00.check_count_params, ch00.check_encode_documents,
                                   ch00.check_forward_by_hand])
def test_stub_raises_not_implemented(check):
    with pytest.raises(NotImplementedError):
        check(stub)


def test_a_patched_checker_does_not_silence_the_check_cell(monkeypatch):
    """What an exercise cell could do: replace the checker. The check cell's fresh copy runs."""
    monkeypatch.setattr(ch00, "check_forward_by_hand", lambda fn: print("✓ (patched)"))
    with pytest.raises(AssertionError, match="without the position embeddings"):
        checks.fresh("ch00").check_forward_by_hand(no_position_embeddings)


def fails_with(check, wrong, *fragments):
    with pytest.raises(CheckFailed) as info:
        check(wrong)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


# --- exercise 1: count the parameters -----------------------------------------------------------

def count_as_float(cfg):
    """124439808.0: a true division somewhere."""
    return float(count_params(cfg))


def count_half_mlp_as_float(cfg):
    C = cfg.n_embd
    per_block = 4 * C + 3 * C * C + 3 * C + C * C + C + 8 * C * C / 2 * 2 + 5 * C
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * per_block + 2 * C


def count_with_commas(cfg):
    return f"{count_params(cfg):,}"


def count_head_twice(cfg):
    return count_params(cfg) + cfg.vocab_size * cfg.n_embd


def count_without_ln_f(cfg):
    return count_params(cfg) - 2 * cfg.n_embd


def count_without_biases(cfg):
    return count_params(cfg) - cfg.n_layer * 9 * cfg.n_embd


def count_without_block_layernorms(cfg):
    return count_params(cfg) - cfg.n_layer * 4 * cfg.n_embd


def count_matrices_only(cfg):
    C = cfg.n_embd
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * 12 * C * C


def count_without_wpe(cfg):
    return count_params(cfg) - cfg.block_size * cfg.n_embd


def count_without_attention_proj(cfg):
    return count_params(cfg) - cfg.n_layer * (cfg.n_embd ** 2 + cfg.n_embd)


def count_mlp_width_c(cfg):
    C = cfg.n_embd
    per_block = 4 * C + 3 * C * C + 3 * C + C * C + C + (C * C + C) + (C * C + C)
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * per_block + 2 * C


@pytest.mark.parametrize("wrong, fragments", [
    (count_as_float, ["return an int, not a float"]),
    (count_half_mlp_as_float, ["return an int, not a float"]),
    (count_with_commas, ["return an int, not a str"]),
    (count_head_twice, ["count the LM head as well", "tied"]),
    (count_without_ln_f, ["forget the final LayerNorm"]),
    (count_without_biases, ["forget the biases"]),
    (count_without_block_layernorms, ["forget the two LayerNorms of each block"]),
    (count_matrices_only, ["count only the weight matrices"]),
    (count_without_wpe, ["forget the position embeddings"]),
    (count_without_attention_proj, ["output projection c_proj"]),
    (count_mlp_width_c, ["MLP's hidden width is C"]),
])
def test_count_params_wrong_answers(wrong, fragments):
    fails_with(ch00.check_count_params, wrong, "count_params: wrong for", *fragments)


# --- exercise 2: documents as one token stream --------------------------------------------------

def stream_without_eot(tok, docs):
    return [t for d in docs for t in tok.encode(d)]


def stream_eot_between(tok, docs):
    return tok.encode("<|endoftext|>".join(docs), allowed_special="all")


def stream_one_eot_at_the_end(tok, docs):
    return [t for d in docs for t in tok.encode(d)] + [tok.eot_token]


def stream_joined_with_spaces(tok, docs):
    return tok.encode(" ".join(docs)) + [tok.eot_token]


def stream_eot_before(tok, docs):
    return [t for d in docs for t in [tok.eot_token] + tok.encode(d)]


def stream_skips_empty(tok, docs):
    return [t for d in docs if d for t in tok.encode(d) + [tok.eot_token]]


def stream_eot_as_text(tok, docs):
    return [t for d in docs for t in tok.encode(d + "<|endoftext|>", disallowed_special=())]


def stream_gpt2_eot(tok, docs):
    return [t for d in docs for t in tok.encode(d) + [50256]]


def stream_per_document(tok, docs):
    return [tok.encode(d) + [tok.eot_token] for d in docs]


def stream_as_tensor(tok, docs):
    return torch.tensor(encode_documents(tok, docs), dtype=torch.long)


def stream_as_numpy(tok, docs):
    return np.array(encode_documents(tok, docs))


def stream_of_floats(tok, docs):
    return [float(t) for t in encode_documents(tok, docs)]


@pytest.mark.parametrize("wrong, fragments", [
    (stream_without_eot, ["forget <|endoftext|>"]),
    (stream_eot_between, ["only BETWEEN documents"]),
    (stream_one_eot_at_the_end, ["one <|endoftext|> at the very end"]),
    (stream_joined_with_spaces, ["join the documents into one text"]),
    (stream_eot_before, ["BEFORE each document"]),
    (stream_skips_empty, ["skip the empty document"]),
    (stream_eot_as_text, ["as ordinary characters"]),
    (stream_gpt2_eot, ["50256 is GPT-2's"]),
    (stream_per_document, ["one list per document"]),
    (stream_as_tensor, ["not a torch.Tensor"]),
    (stream_as_numpy, ["not a numpy.ndarray"]),
    (stream_of_floats, ["must be an int", "float"]),
])
def test_encode_documents_wrong_answers(wrong, fragments):
    fails_with(ch00.check_encode_documents, wrong, "encode_documents: wrong for", *fragments)


# --- exercise 3: the forward pass by hand -------------------------------------------------------

def calls_the_model(model, idx):
    return model(idx)


def calls_forward(model, idx):
    return model.forward(idx)


def calls_forward_through_an_alias(model, idx):
    run = minikv.GPT.forward
    return run(model, idx)


def no_position_embeddings(model, idx):
    tr = model.transformer
    x = tr.wte(idx)
    for i, block in enumerate(tr.h):
        x = block(x, None, i, causal_attention)
    return model.lm_head(tr.ln_f(x))


def positions_from_one(model, idx):
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(torch.arange(1, idx.shape[1] + 1))
    for i, block in enumerate(tr.h):
        x = block(x, None, i, causal_attention)
    return model.lm_head(tr.ln_f(x))


def no_final_layernorm(model, idx):
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
    for i, block in enumerate(tr.h):
        x = block(x, None, i, causal_attention)
    return model.lm_head(x)


def head_before_layernorm(model, idx):
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
    for i, block in enumerate(tr.h):
        x = block(x, None, i, causal_attention)
    return tr.ln_f(model.lm_head(x))


def last_position_only(model, idx):
    return forward_by_hand(model, idx)[:, -1]


def last_position_kept(model, idx):
    return forward_by_hand(model, idx)[:, -1:]


def as_numpy(model, idx):
    return forward_by_hand(model, idx).detach().numpy()


def argmax_ids(model, idx):
    return forward_by_hand(model, idx).argmax(-1)


def batch_dropped(model, idx):
    return forward_by_hand(model, idx)[0]


def no_causal_mask(model, idx):
    return forward_spelled_out(model, idx, causal=False)


def no_mask_through_sdpa(model, idx):
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
    for i, block in enumerate(tr.h):
        x = block(x, None, i, F.scaled_dot_product_attention)
    return model.lm_head(tr.ln_f(x))


def two_blocks_hardcoded(model, idx):
    """Written against the tiny preset's 2 layers."""
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
    x = tr.h[0](x, None, 0, causal_attention)
    x = tr.h[1](x, None, 1, causal_attention) if len(tr.h) > 1 else x
    return model.lm_head(tr.ln_f(x))


def a_tuple(model, idx):
    return forward_by_hand(model, idx), None


@pytest.mark.parametrize("wrong, fragments", [
    (calls_the_model, ["called minikv's own", "GPT.forward"]),
    (calls_forward, ["called minikv's own", "GPT.forward"]),
    (calls_forward_through_an_alias, ["called minikv's own", "GPT.forward"]),
    (no_position_embeddings, ["without the position embeddings"]),
    (positions_from_one, ["positions start at 1"]),
    (no_final_layernorm, ["forget the final LayerNorm"]),
    (head_before_layernorm, ["apply the LM head before the final LayerNorm"]),
    (last_position_only, ["return only the last position"]),
    (last_position_kept, ["return only the last position"]),
    (as_numpy, ["not a numpy array"]),
    (argmax_ids, ["not the argmax ids"]),
    (batch_dropped, ["dropped the batch dimension"]),
    (no_causal_mask, ["without the causal mask"]),
    (no_mask_through_sdpa, ["without the causal mask"]),
    (two_blocks_hardcoded, ["run only 2 of the model's 3 blocks"]),
    (a_tuple, ["return the logits tensor itself"]),
])
def test_forward_by_hand_wrong_answers(wrong, fragments):
    fails_with(ch00.check_forward_by_hand, wrong, *fragments)


# --- exercise 4: predict, then measure ------------------------------------------------------------
PROMPT = ch00.PREDICT_QUESTION + " What's the state? A:"


def predict_generation():
    P = len(minikv.load_tokenizer().encode(PROMPT))
    return 3, P + 2  # " tails", ".", <|endoftext|>: the last one never fed


def prompt_len():
    return len(minikv.load_tokenizer().encode(PROMPT))


@pytest.mark.parametrize("wrong, fragments", [
    (lambda: (40, prompt_len() + 39), ["you predicted all 40 tokens"]),
    (lambda: (3, prompt_len() + 39), ["that K/V count is for all 40 tokens"]),
    (lambda: (40, prompt_len() + 2), ["40 passes is max_new_tokens"]),
    (lambda: (3, prompt_len() + 3), ["the last new token as fed"]),
    (lambda: (4, prompt_len() + 2), ["the prefill's pass already yields the first new token"]),
    (lambda: (3, 2), ["you forgot the prompt"]),
    (lambda: (3, 3), ["you forgot the prompt"]),
    (lambda: (3, prompt_len()), ["that is the prefill alone"]),
    (lambda: (prompt_len() + 2, prompt_len() + 2), ["one pass per token"]),
    (lambda: (3, 3 * prompt_len() + 3), ["what the naive decoder computes"]),
    (lambda: (3, len(PROMPT.split()) + 2), ["word count"]),
    (lambda: (3, len(PROMPT) + 2), ["character count"]),
    (lambda: 3, ["a pair of ints"]),
    (lambda: (3.0, 29.0), ["a pair of ints"]),
    (lambda: minikv.generate(minikv.load_course_model("target")[0],
                             minikv.load_tokenizer().encode(PROMPT), 40).stats.forward_passes,
     ["your prediction ran the model", "BEFORE the measurement"]),
])
def test_predict_generation_wrong_answers(wrong, fragments):
    fails_with(ch00.check_predict_generation, wrong, "predict_generation: ", *fragments)


# --- exercise 5: debug the checkpoint loader ----------------------------------------------------
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def loader(transpose, skip=(".attn.bias", ".attn.masked_bias")):
    """A loader in the notebook's shape, with `transpose(name, tensor, ours)` deciding."""
    def load(state_dict, config):
        model = minikv.GPT(config)
        ours = model.state_dict()
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if skip and name.endswith(skip):
                    continue
                if transpose(name, tensor, ours[name]):
                    tensor = tensor.t()
                ours[name].copy_(tensor)
        return model
    return load


load_gpt2_fixed = loader(lambda name, t, ours: name.endswith(TRANSPOSED))
load_gpt2_shape_or_name = loader(  # also right: the shape test, plus the square one by name
    lambda name, t, ours: t.shape != ours.shape or name.endswith("attn.c_proj.weight"))
load_gpt2_shipped = loader(lambda name, t, ours: t.shape != ours.shape)
load_gpt2_forgets_mlp_proj = loader(lambda name, t, ours: name.endswith(TRANSPOSED[:3]))
load_gpt2_everything = loader(lambda name, t, ours: t.dim() == 2)
load_gpt2_keeps_buffers = loader(lambda name, t, ours: name.endswith(TRANSPOSED), skip=())
load_gpt2_name_and_shape = loader(  # by name, but c_proj only when the shape says so
    lambda name, t, ours: name.endswith(TRANSPOSED[0::2]) or t.shape != ours.shape)


def load_gpt2_needs_head(state_dict, config):
    state_dict["lm_head.weight"]  # noqa: B018 - "every checkpoint has its head"
    return load_gpt2_fixed(state_dict, config)


def load_gpt2_untied(state_dict, config):
    model = load_gpt2_fixed(state_dict, config)
    model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    return model


def load_gpt2_no_return(state_dict, config):
    load_gpt2_fixed(state_dict, config)


def load_gpt2_engine(state_dict, config):
    return minikv.GPT.from_gpt2_state_dict(state_dict, config)


@pytest.mark.parametrize("wrong, fragments", [
    (load_gpt2_shipped, ["the shipped loader's logits", "the same in both layouts"]),
    (load_gpt2_name_and_shape, ["the shipped loader's logits"]),
    (load_gpt2_forgets_mlp_proj, ["a shape mismatch", "transpose all four"]),
    (load_gpt2_everything, ["a shape mismatch", "and nothing else"]),
    (load_gpt2_keeps_buffers, ["causal-mask buffer"]),
    (load_gpt2_needs_head, ["no 'lm_head.weight'"]),
    (load_gpt2_untied, ["ties the LM head"]),
    (load_gpt2_no_return, ["forget to return it"]),
    (load_gpt2_engine, ["called minikv's own", "from_gpt2_state_dict"]),
])
def test_load_gpt2_wrong_answers(wrong, fragments):
    fails_with(ch00.check_load_gpt2, wrong, "load_gpt2_fixed: ", *fragments)


# --- exercise 6: design: the widest model in 24 MiB -----------------------------------------------
@pytest.mark.parametrize("wrong, fragments", [
    (lambda: 208, ["over budget", "left out the embeddings"]),
    (lambda: 288, ["over budget", "2 bytes per parameter"]),
    (lambda: 256, ["over budget", "2 bytes per parameter"]),
    (lambda: 192, ["a wider model fits too", "not 24 x 10**6"]),
    (lambda: 184, ["a wider model fits too"]),
    (lambda: 204, ["GPTConfig refuses n_embd=204", "multiple of 8"]),
    (lambda: 768, ["over budget"]),
    (lambda: 200.0, ["a positive int"]),
    (lambda: None, ["a positive int"]),
])
def test_choose_width_wrong_answers(wrong, fragments):
    fails_with(ch00.check_choose_width, wrong, "choose_width: ", *fragments)


def test_new_exercises_pass_and_leave_the_random_state_alone(capsys):
    state = torch.get_rng_state()
    ch00.check_predict_generation(predict_generation)
    ch00.check_load_gpt2(load_gpt2_fixed)
    ch00.check_load_gpt2(load_gpt2_shape_or_name)
    ch00.check_choose_width(lambda: 200)
    assert capsys.readouterr().out.count("✓") == 4
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("check", [ch00.check_predict_generation, ch00.check_load_gpt2,
                                   ch00.check_choose_width])
def test_new_stubs_raise_not_implemented(check):
    with pytest.raises(NotImplementedError):
        check(stub)


def test_check_cells_follow_their_exercises():
    from conftest import solution_check_cells
    cells = solution_check_cells("00_setup.ipynb", "ch00")
    for before, cell, _, passed in cells:
        assert f"def {passed[0]}(" in before and "✓" in str(cell.outputs)
    assert [called for _, _, called, _ in cells] == [
        "count_params", "encode_documents", "forward_by_hand", "predict_generation", "load_gpt2",
        "choose_width"]
