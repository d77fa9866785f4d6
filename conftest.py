"""Repository-wide pytest hooks: report how long each notebook took under nbval."""
from collections import defaultdict

_notebook_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    if report.nodeid.split("::")[0].endswith(".ipynb"):
        _notebook_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _notebook_seconds:
        return
    terminalreporter.section("notebook run times (budget: 60 s each, on 2 CPU cores)")
    for path, seconds in sorted(_notebook_seconds.items()):
        over = "  over its 60 s" if seconds > 60 else ""
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}{over}")
    terminalreporter.write_line(f"{sum(_notebook_seconds.values()):7.1f} s  total")
