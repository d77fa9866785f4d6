"""A stand-in for Triton where it does not install (macOS, Windows, Linux on ARM): chapter 09's
kernel cell then still runs, its `@triton.jit` leaving the function as written and its
`tl.constexpr` annotations evaluating, and the exercise's check cell says it skipped the exercise
(nothing runs the kernel). Where Triton is installed the notebook imports the real one."""


class language:  # noqa: N801 - stands for the module triton.language
    constexpr = "constexpr"


def jit(fn=None, **options):
    """@triton.jit or @triton.jit(...): the function, unchanged."""
    return fn if fn is not None else (lambda f: f)
