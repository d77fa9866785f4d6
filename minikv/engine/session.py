"""Conversations on a server: a `Session` is a history of turns, kept as tokens; its K/V
lives in the engine's radix tree (serve(prefix_caching=Radix())), where the next turn's
prompt, the whole history and the new message, finds it. So `fork` (n continuations of
one history) shares the history's blocks, copying at most the partly filled last one
when a branch first writes; `rewind` (drop the last turns, as when a user edits their
message) is a shorter prompt, whose prefix the tree still holds; and a session saved to
disk (course/sessions.py) goes on in another process with the tokens it would have
given (the same K/V bits, read through the same passes).
"""
from __future__ import annotations

from .sampling import Request
from .serving import Engine
from .validate import int_at_least, token_ids


class Session:
    """One conversation on `engine`: `history` (every turn's message and reply) and where
    each turn began."""

    def __init__(self, engine: Engine, history=(), starts=()):
        if not isinstance(engine, Engine):  # with a radix tree, each turn finds the last
            raise TypeError(f"a Session runs on a serving.Engine, not {engine!r:.30}")
        self.engine = engine
        self.history = token_ids(history, engine.model.config.vocab_size) if history else []
        self.starts = list(starts)  # the position each turn began at
        self.last = None  # the RequestOutput of its last turn (its stats: what it reused)

    def __repr__(self) -> str:
        return f"Session({len(self.starts)} turns, {len(self.history)} positions)"

    def say(self, message, max_new_tokens: int = 16, **sampling) -> list[int]:
        """One turn: `message` after the history; the reply (also added to the history)."""
        return turn([self], [message], max_new_tokens, **sampling)[0]

    def fork(self, n: int = 2) -> list[Session]:
        """n sessions that go on from this one's history, each its own way."""
        int_at_least("n", n, hint=" (sessions to fork)")
        return [Session(self.engine, self.history, self.starts) for _ in range(n)]

    def rewind(self, turns: int = 1) -> None:
        """Forget the last `turns` turns (their messages and replies)."""
        int_at_least("turns", turns, 1, " (turns to forget)", len(self.starts) + 1)
        self.history = self.history[:self.starts[-turns]]
        del self.starts[-turns:]


def turn(sessions: list[Session], messages: list, max_new_tokens: int = 16,
         **sampling) -> list[list[int]]:
    """A turn of every session at once, in one engine's batch: each message after its
    session's history; their replies, each added to its history."""
    sessions, messages = list(sessions), list(messages)
    if not all(isinstance(s, Session) for s in sessions):
        raise TypeError("turn takes a list of Sessions and a list of their messages")
    engine = sessions[0].engine if sessions else None
    if (not sessions or len(messages) != len(sessions) or len(set(map(id, sessions)))
            < len(sessions) or any(s.engine is not engine for s in sessions)):
        raise ValueError("turn takes different sessions of one engine and a message for each")
    vocab = engine.model.config.vocab_size
    prompts = [s.history + token_ids(m, vocab) for s, m in zip(sessions, messages)]
    requests = [Request(p, max_new_tokens, **sampling) for p in prompts]
    for r in requests:  # all checked before any is queued
        engine.check(r)
    indices = [engine.add(r) for r in requests]
    left = set(indices)
    while left:  # other requests on the engine move on too
        left -= {i for i, (_, done) in engine.step().items() if done}
    outputs = engine.outputs()
    for s, p, i in zip(sessions, prompts, indices):
        s.starts.append(len(s.history))
        s.history, s.last = p + outputs[i].tokens, outputs[i]
        engine.forget(i)
    return [outputs[i].tokens for i in indices]
