"""Training: batches start at document starts and are seeded, the schedule warms up then decays,
and a short CPU run lowers the loss and saves a checkpoint that loads back."""
import math
import shutil

import pytest
import torch

import minikv
from minikv.course import train as T
from minikv.course.checkpoint import load_checkpoint, read_metadata

SMALL_DOCS = {"coinflip": 300, "facts": 300, "stories": 300}


@pytest.fixture(scope="module")
def tok():
    return minikv.load_tokenizer()


@pytest.fixture(scope="module")
def data(tok):
    return T.load_corpora(tok, SMALL_DOCS)


def test_batches_are_whole_documents_and_are_seeded(tok, data):
    docs = {n: T.documents(t, tok.eot_token) for n, t in data.items()}
    mix = {"coinflip": 0.5, "stories": 0.5}
    x, y = T.get_batch(data, docs, mix, 8, 32, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (8, 32) and torch.equal(x[:, 1:], y[:, :-1])
    openings = [tok.decode(row.tolist()).startswith(("A coin's state is", "Once upon a time"))
                for row in x]
    assert all(openings)  # as a prompt does, every row starts a document
    x2, _ = T.get_batch(data, docs, mix, 8, 32, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2)
    x3, _ = T.get_batch(data, docs, mix, 8, 32, torch.Generator().manual_seed(2))
    assert not torch.equal(x, x3)


def test_documents_cover_the_corpus(tok, data):
    for name, tokens in data.items():
        docs = T.documents(tokens, tok.eot_token)
        assert docs[0, 0] == 0 and docs[-1, 1] == len(tokens)
        assert torch.equal(docs[1:, 0], docs[:-1, 1])  # back to back
        assert (tokens[docs[:, 1] - 1] == tok.eot_token).all()
        assert (tokens[docs[:, 0]] != tok.eot_token).all()


def test_curriculum_limits_the_people_then_lifts_the_limit():
    tc = T.TrainConfig(steps=100, curriculum=0.5)
    limits = [T.people_limit(s, tc) for s in range(100)]
    assert limits[0] == 2 and limits[-1] == minikv.course.corpus.MAX_PEOPLE
    assert all(a <= b for a, b in zip(limits, limits[1:]))
    assert set(limits[50:]) == {minikv.course.corpus.MAX_PEOPLE}
    assert {T.people_limit(s, T.TrainConfig(steps=100)) for s in range(100)} == {8}
    with pytest.raises(ValueError, match="curriculum"):
        T.TrainConfig(curriculum=1.5)


def test_people_pools_limit_and_weight_the_coin_flips():
    docs = torch.arange(8).reshape(4, 2)  # four documents' (start, end)
    people = torch.tensor([1, 8, 3, 2])
    plain = T.people_pools(docs, people, power=0)
    assert plain[2].tolist() == [[0, 1], [6, 7]]  # only documents of at most 2 people
    assert plain[8].tolist() == docs.tolist()  # every document once
    for power, times in ((1, [1, 8, 3, 2]), (2, [1, 64, 9, 4])):
        weighted = T.people_pools(docs, people, power=power)
        listed = [row[0] // 2 for row in weighted[8].tolist()]
        assert [listed.count(d) for d in range(4)] == times  # people ** power times
    for bad in (True, 1.5, -1):
        with pytest.raises(ValueError, match="people_power"):
            T.TrainConfig(people_power=bad)


def test_learning_rate_schedule():
    tc = T.TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup=10)
    lrs = [T.lr_at(s, tc) for s in range(tc.steps)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)  # linear warmup
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # then only decays
    assert lrs[-1] == pytest.approx(1e-4) and lrs[(10 + 99) // 2] == pytest.approx(5.5e-4, rel=0.02)
    assert all(math.isfinite(lr) and lr > 0 for lr in lrs)


def test_course_presets_match_the_course_tokenizer(tok):
    for name in ("target", "draft"):
        assert minikv.GPTConfig.preset(name).vocab_size == tok.n_vocab


def test_short_cpu_run_lowers_the_loss_and_saves(tmp_path, tok):
    tc = T.TrainConfig(steps=40, batch_size=8, lr=3e-3, min_lr=3e-4, warmup=5, docs=SMALL_DOCS,
                       seed=0)
    torch.manual_seed(0)
    fresh = minikv.GPT(minikv.GPTConfig.preset("tiny", vocab_size=tok.n_vocab))  # untrained
    val = T.load_corpora(tok, {"stories": 50}, split="val")["stories"]
    before = T.corpus_loss(fresh, val, tok.eot_token)
    model, meta = T.train("tiny", tc, device="cpu", progress=False)
    after = T.corpus_loss(model, val, tok.eot_token)
    assert before > math.log(1024) - 0.5 and after < before - 1.5, (before, after)
    assert (meta["tokens_seen"] == 40 * 8 * 256 and meta["preset"] == "tiny"
            and meta["config"]["vocab_size"] == 1024)
    assert set(meta["val_loss"]) == set(SMALL_DOCS) and meta["final_train_loss"] < before
    for key in ("wall_time_s", "torch", "device", "date", "num_params", "train"):
        assert key in meta
    T.save_checkpoint(model, tmp_path / "run", meta)
    loaded = load_checkpoint(tmp_path / "run", device="cpu")
    ids = torch.tensor([tok.encode("Once upon a time")])
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))
    assert read_metadata(tmp_path / "run")["final_train_loss"] == meta["final_train_loss"]


def test_training_is_seeded(tok):
    tc = T.TrainConfig(steps=3, batch_size=2, warmup=1, docs=SMALL_DOCS, seed=7)
    a, _ = T.train("tiny", tc, device="cpu", progress=False)
    b, _ = T.train("tiny", tc, device="cpu", progress=False)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_command_line_trains_and_saves(tmp_path, monkeypatch):
    monkeypatch.setitem(T.TRAINING, "tiny",
                        T.TrainConfig(steps=2, batch_size=2, warmup=1, docs=SMALL_DOCS))
    assert T.main(["--preset", "tiny", "--steps", "2", "--device", "cpu",
                   "--out", str(tmp_path / "cli")]) == 0
    assert read_metadata(tmp_path / "cli")["train"]["steps"] == 2
    load_checkpoint(tmp_path / "cli", device="cpu")


def kl_to(teacher, student, x) -> float:
    with torch.no_grad():
        p, q = teacher(x).log_softmax(-1), student(x).log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_distillation_learns_the_teachers_distribution(tok):
    tc = T.TrainConfig(steps=30, batch_size=4, lr=3e-3, warmup=3, docs=SMALL_DOCS, distill=True)
    with pytest.raises(ValueError, match="teacher"):
        T.train("tiny", tc, device="cpu", progress=False)  # distill, but nobody to learn from
    with pytest.raises(ValueError, match="teacher"):
        T.train("tiny", T.TrainConfig(steps=1, docs=SMALL_DOCS), device="cpu", progress=False,
                teacher=minikv.GPT(minikv.GPTConfig.preset("tiny", vocab_size=tok.n_vocab)))
    teacher, _ = T.train("tiny", T.TrainConfig(steps=30, batch_size=4, lr=3e-3, warmup=3,
                                               docs=SMALL_DOCS, seed=1), "cpu", progress=False)
    torch.manual_seed(2)
    student = minikv.GPT(minikv.GPTConfig.preset("tiny", vocab_size=tok.n_vocab))
    x = torch.tensor([tok.encode("Once upon a time, there was a little dog named Max.")])
    before = kl_to(teacher, student, x)
    learned, _ = T.train("tiny", tc, "cpu", progress=False, init=student, teacher=teacher)
    # the same steps on the text's own next tokens move it less close to this teacher
    plain, _ = T.train("tiny", T.TrainConfig(**{**T.asdict(tc), "distill": False}), "cpu",
                       progress=False, init=student)
    assert kl_to(teacher, learned, x) < 0.5 * before, (before, kl_to(teacher, learned, x))
    assert kl_to(teacher, learned, x) < kl_to(teacher, plain, x)


def test_second_phase_goes_on_from_the_shipped_model(tmp_path, monkeypatch):
    first = T.TrainConfig(steps=2, batch_size=2, warmup=1, docs=SMALL_DOCS)
    monkeypatch.setitem(T.TRAINING, "tiny", first)
    monkeypatch.setitem(T.FINISHING, "tiny", T.TrainConfig(steps=3, batch_size=2, warmup=1,
                                                           lr=1e-4, docs=SMALL_DOCS, seed=5))
    assert T.main(["--preset", "tiny", "--phase", "1", "--device", "cpu",
                   "--out", str(tmp_path / "first")]) == 0
    shipped = read_metadata(tmp_path / "first")
    assert [p["train"]["steps"] for p in shipped["phases"]] == [2]
    shutil.copytree(tmp_path / "first", tmp_path / "models" / "tiny")
    monkeypatch.setattr(T, "MODELS_DIR", tmp_path / "models")  # as if it were shipped
    assert T.main(["--preset", "tiny", "--phase", "2", "--device", "cpu",
                   "--out", str(tmp_path / "run")]) == 0
    meta = read_metadata(tmp_path / "run")
    assert [p["train"]["steps"] for p in meta["phases"]] == [2, 3]
    assert meta["phases"][0] == shipped["phases"][0] and meta["train"]["seed"] == 5
    assert meta["wall_time_s"] == round(sum(p["wall_time_s"] for p in meta["phases"]), 1)
    monkeypatch.delitem(T.FINISHING, "tiny")
    with pytest.raises(SystemExit):  # no second phase to run
        T.main(["--preset", "tiny", "--phase", "2", "--out", str(tmp_path / "x")])


@pytest.mark.cuda
def test_trains_on_cuda(tok):
    tc = T.TrainConfig(steps=3, batch_size=2, warmup=1, docs=SMALL_DOCS)
    model, meta = T.train("tiny", tc, device="cuda", progress=False)
    assert model.device.type == "cuda" and "cuda" in meta["device"]


def test_a_stopped_run_goes_on_as_if_never_stopped(tmp_path):
    tc = T.TrainConfig(steps=6, batch_size=2, warmup=1, docs=SMALL_DOCS, seed=3)
    straight, _ = T.train("tiny", tc, device="cpu", progress=False)
    state = tmp_path / "tiny.state"

    def stop(step, model):
        if step == 3:  # the state was saved after step index 2 (3 steps done)
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        T.train("tiny", tc, "cpu", progress=False, callback=stop, state=state, save_every=3)
    assert state.exists()
    seen = []
    resumed, meta = T.train("tiny", tc, "cpu", progress=False, state=state, save_every=3,
                            callback=lambda step, model: seen.append(step))
    assert seen == [3, 4, 5] and not state.exists() and meta["tokens_seen"] == 6 * 2 * 256
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters()))
    T.save_state(state, {"preset": "tiny"}, 3, 1.0, 1.0, resumed, torch.optim.SGD(
        resumed.parameters(), lr=0.1), torch.Generator())
    with pytest.raises(ValueError, match="another run's state"):
        T.train("tiny", tc, "cpu", progress=False, state=state)


def test_float16_storage_halves_the_file_and_loads_as_float32(tmp_path, tok):
    torch.manual_seed(0)
    model = minikv.GPT(minikv.GPTConfig.preset("tiny", vocab_size=tok.n_vocab))
    T.save_checkpoint(model, tmp_path / "32")
    T.save_checkpoint(model, tmp_path / "16", dtype=torch.float16)
    size = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("32", "16")}
    assert size["16"] < 0.51 * size["32"]
    loaded = load_checkpoint(tmp_path / "16", device="cpu")
    assert loaded.dtype == torch.float32
    for p, q in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(q, p.half().float())
    with pytest.raises(ValueError, match="dtype must be one of"):
        T.save_checkpoint(model, tmp_path / "b", dtype=torch.bfloat16)


def test_a_second_phase_goes_on_from_a_first_phase_saved_anywhere(tmp_path, monkeypatch):
    monkeypatch.setitem(T.TRAINING, "tiny", T.TrainConfig(steps=2, batch_size=2, warmup=1,
                                                          docs=SMALL_DOCS))
    monkeypatch.setitem(T.FINISHING, "tiny", T.TrainConfig(steps=2, batch_size=2, warmup=1,
                                                           docs=SMALL_DOCS, seed=5))
    assert T.main(["--preset", "tiny", "--phase", "1", "--device", "cpu",
                   "--out", str(tmp_path / "first")]) == 0
    assert T.main(["--preset", "tiny", "--phase", "2", "--init", str(tmp_path / "first"),
                   "--device", "cpu", "--out", str(tmp_path / "second")]) == 0
    assert [p["train"]["seed"] for p in read_metadata(tmp_path / "second")["phases"]] == [0, 5]
    for bad in (["--init", str(tmp_path / "first")],  # a start for a second phase only
                ["--phase", "2", "--init", str(tmp_path / "nothing")]):
        with pytest.raises(SystemExit):
            T.main(["--preset", "tiny", "--out", str(tmp_path / "x"), *bad])
