"""Everything the course needs around the engine: the generated corpora and the course tokenizer
(corpus, tokenizer; names: names the models never saw, for held-out questions), the shipped models
and how they are made (checkpoint, train, evaluate), device choice, and the exercises (notebooks:
exercises from solutions; checks: the checkers)."""
