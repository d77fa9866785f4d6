"""Chapter 00: the checkers accept the solutions, let a stub's NotImplementedError through, and
reject every plausible wrong answer with a hint that names the mistake. count_params' and
encode_documents' named mistakes are their tables' (tests/test_checks_table.py feeds them)."""
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minikv
from minikv.course.checks import CheckFailed, ch00

from conftest import stub

count_params, encode_documents = ch00._num_params, ch00.ENCODE_DOCUMENTS.reference


def forward_spelled_out(model, idx, causal=True):
    """Also right (with causal=True): every block written out."""
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
    for block in tr.h:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, block.attn.n_head, -1).transpose(1, 2)
                   for t in block.attn.c_attn(block.ln_1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(tr.ln_f(x))


PROMPT = ch00.PREDICT_QUESTION + " What's the state? A:"
P = len(minikv.load_tokenizer().encode(PROMPT))


def predict_generation():
    return 3, P + 2  # " tails", ".", <|endoftext|>: the last one never fed


def loader(transpose, skip=(".attn.bias", ".attn.masked_bias")):
    return partial(ch00.shipped_load, transpose=transpose, skip=skip)


load_gpt2_fixed = loader(lambda name, t, ours: name.endswith(ch00.CONV1D))


def test_solutions_pass_and_leave_the_random_state_alone(capsys):
    state = torch.get_rng_state()
    ch00.check_count_params(lambda cfg: np.int64(count_params(cfg)))  # a numpy int is an int
    ch00.check_encode_documents(lambda tok, docs: tok.encode(  # also right: one text
        "".join(d + "<|endoftext|>" for d in docs), allowed_special={"<|endoftext|>"}))
    ch00.check_forward_by_hand(ch00._forward)
    ch00.check_forward_by_hand(forward_spelled_out)
    ch00.check_predict_generation(predict_generation)
    ch00.check_load_gpt2(load_gpt2_fixed)
    ch00.check_load_gpt2(loader(  # also right: the shape test, plus the square one by name
        lambda name, t, ours: t.shape != ours.shape or name.endswith("attn.c_proj.weight")))
    ch00.check_choose_width(lambda budget=24 * 2**20: ch00._widest(budget))
    assert capsys.readouterr().out.count("✓") == 8
    assert torch.equal(torch.get_rng_state(), state), "a checker moved the caller's random state"


@pytest.mark.parametrize("check", [ch00.check_forward_by_hand, ch00.check_predict_generation,
                                   ch00.check_load_gpt2, ch00.check_choose_width])
def test_a_stub_goes_through(check):
    with pytest.raises(NotImplementedError):
        check(stub)




def each(check, *pairs):
    return [(check, wrong, fragment) for wrong, fragment in pairs]


def load_gpt2_untied(state_dict, config):
    model = load_gpt2_fixed(state_dict, config)
    model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    return model


@pytest.mark.parametrize("check, wrong, fragment", [
    *each(ch00.check_count_params,  # what the tables cannot state: wrong types
          (lambda cfg: float(count_params(cfg)), "return an int, not a float: a parameter count "
           "is a whole number (count with integers: // not /, no float(), no math.pow)"),
          (lambda cfg: f"{count_params(cfg):,}", "return an int, not a str")),
    *each(ch00.check_encode_documents,
          (lambda tok, docs: [tok.encode(d) + [tok.eot_token] for d in docs],
           "one list per document"),
          (lambda tok, docs: torch.tensor(encode_documents(tok, docs)), "not a torch.Tensor"),
          (lambda tok, docs: np.array(encode_documents(tok, docs)), "not a numpy.ndarray"),
          (lambda tok, docs: [float(t) for t in encode_documents(tok, docs)],
           "every token id must be an int, got 104.0 (float)"),
          (lambda tok, docs: 7, "return a list of ints, not a int")),
    *each(ch00.check_forward_by_hand,
          (lambda model, idx: model(idx), "called minikv's own minikv.engine.model.GPT.forward"),
          *[(partial(ch00._forward, mistake=m), ch00.H["forward_by_hand"][m])
            for m in ch00.FORWARD_MISTAKES],
          (partial(forward_spelled_out, causal=False), "without the causal mask"),
          (partial(ch00._forward, blocks=2), "run only 2 of the model's 3 blocks"),
          (lambda model, idx: ch00._forward(model, idx)[:, -1], "return only the last position"),
          (lambda model, idx: ch00._forward(model, idx)[:, -1:], "return only the last position"),
          (lambda model, idx: ch00._forward(model, idx)[0], "dropped the batch dimension"),
          (lambda model, idx: ch00._forward(model, idx).detach().numpy(), "not a numpy array"),
          (lambda model, idx: ch00._forward(model, idx).argmax(-1), "not the argmax ids"),
          (lambda model, idx: (ch00._forward(model, idx), None), "the logits tensor itself"),
          (lambda model, idx: ch00._forward(model, idx)[:, :, :-1], "(B, T, vocab) = (1, 6, 512)"),
          (lambda model, idx: ch00._forward(model, idx) * 1.01, "then ln_f, then lm_head")),
    *each(ch00.check_predict_generation,  # each usual wrong prediction, with its own hint
          *[(lambda p=p, k=k: (3 if p is None else p, P + 2 if k is None else k), "hint: " + h)
            for (p, k), h in ch00._generation_mistakes(P, len(PROMPT.split()), len(PROMPT), 3, 40)],
          (lambda: 3, "a pair of ints"), (lambda: (3.0, 29.0), "a pair of ints"),
          (lambda: (5, 50), "the prompt is 27 tokens, fed once; the model wrote 3 tokens"),
          (lambda: minikv.generate(minikv.load_course_model("target")[0],
                                   minikv.load_tokenizer().encode(PROMPT), 40).stats.forward_passes,
           "your prediction ran the model (it called minikv's own")),
    *each(ch00.check_load_gpt2,
          (ch00.shipped_load, "these are the shipped loader's logits: the bug is still there"),
          (loader(lambda name, t, ours:  # by name, but c_proj only when the shape says so
                  name.endswith(ch00.CONV1D[0::2]) or t.shape != ours.shape),
           "the shipped loader's logits"),
          (loader(lambda name, t, ours: name.endswith(ch00.CONV1D[:3])), "a shape mismatch"),
          (loader(lambda name, t, ours: t.dim() == 2), "a shape mismatch"),
          (loader(lambda name, t, ours: name.endswith(ch00.CONV1D), skip=()), "causal-mask buffer"),
          (lambda sd, config: (sd["lm_head.weight"], load_gpt2_fixed(sd, config))[1],
           "no 'lm_head.weight'"),
          (load_gpt2_untied, "ties the LM head"),
          (lambda sd, config: load_gpt2_fixed(sd, config) and None, "forget to return it"),
          (lambda sd, config: minikv.GPT.from_gpt2_state_dict(sd, config),
           "called minikv's own minikv.engine.model.GPT.from_gpt2_state_dict")),
    *each(ch00.check_choose_width,
          (lambda: 208, "over budget: you left out the embeddings; wte and wpe hold 266,240 "),
          (lambda: 288, "over budget: you counted 2 bytes per parameter"),
          (lambda: 256, "over budget: you counted 2 bytes per parameter"),
          (lambda: 192, "a wider model fits too, and the goal is the widest: 24 MiB is 24 x 2**20"),
          (lambda: 184, "hint: n_embd=184 fits (19.61 MiB), but a wider model fits too"),
          (lambda: 204, "GPTConfig refuses n_embd=204 with n_head=8"),
          (lambda: 768, "over budget: count every parameter"),
          (lambda: 200.0, "a positive int"), (lambda: None, "a positive int"),
          (lambda *budget: 200, "choose from the `budget` argument")),
])
def test_wrong_answers_are_named(check, wrong, fragment):
    with pytest.raises(CheckFailed) as info:
        check(wrong)
    assert fragment in str(info.value), str(info.value)
