"""Chapter 00: the checkers accept the solutions and reject plausible wrong answers."""
import pytest

from minikv.course.checks import CheckFailed, ch00

from conftest import stub


def count_params(cfg):
    C = cfg.n_embd
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * (12 * C * C + 13 * C) + 2 * C


def encode_documents(tok, docs):
    return [t for doc in docs for t in tok.encode(doc) + [tok.eot_token]]


def test_solutions_pass(capsys):
    ch00.check_count_params(count_params)
    ch00.check_next_tokens(lambda logits: logits[:, -1].argmax(-1))
    ch00.check_encode_documents(encode_documents)
    ch00.check_encode_documents(lambda tok, docs: tok.encode(  # also right
        "".join(d + "<|endoftext|>" for d in docs), allowed_special={"<|endoftext|>"}))
    assert capsys.readouterr().out.count("✓") == 4


@pytest.mark.parametrize("check, wrong", [
    # counts the tied head twice
    (ch00.check_count_params, lambda cfg: count_params(cfg) + cfg.vocab_size * cfg.n_embd),
    # forgets ln_f
    (ch00.check_count_params, lambda cfg: count_params(cfg) - 2 * cfg.n_embd),
    # forgets the biases
    (ch00.check_count_params, lambda cfg: count_params(cfg) - cfg.n_layer * 13 * cfg.n_embd),
    # first position
    (ch00.check_next_tokens, lambda logits: logits[:, 0].argmax(-1)),
    # every position
    (ch00.check_next_tokens, lambda logits: logits.argmax(-1)),
    # shape (B, 1)
    (ch00.check_next_tokens, lambda logits: logits[:, -1].argmax(-1, keepdim=True)),
    # no EOT
    (ch00.check_encode_documents, lambda tok, docs: [t for d in docs for t in tok.encode(d)]),
    # EOT between only
    (ch00.check_encode_documents,
     lambda tok, docs: tok.encode("<|endoftext|>".join(docs), allowed_special="all")),
    (ch00.check_encode_documents, lambda tok, docs: tok.encode(" ".join(docs)) + [tok.eot_token]),
])
def test_wrong_answers_fail(check, wrong):
    with pytest.raises(CheckFailed):
        check(wrong)


def test_stub_fails():
    for check in (ch00.check_count_params, ch00.check_next_tokens, ch00.check_encode_documents):
        with pytest.raises(NotImplementedError):
            check(stub)
