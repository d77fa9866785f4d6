"""Everything the course needs around the engine: the generated corpora and the course tokenizer
(corpus, tokenizer), the shipped models and how they are made (checkpoint, train, evaluate),
device choice, and the exercises (notebooks: exercises from solutions; checks: the checkers)."""
