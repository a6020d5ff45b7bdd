"""pytest-cov's command-line options, without the coverage: enough for a setup.cfg that sets them."""


def pytest_addoption(parser):
    group = parser.getgroup("fakecov")
    group.addoption("--cov", action="append", default=[], help="measure coverage of a package (no-op)")
    group.addoption("--cov-report", action="append", default=[], help="coverage report type (no-op)")


def pytest_terminal_summary(terminalreporter, config):
    terminalreporter.write_line(f"fakecov: would measure {', '.join(config.getoption('--cov'))}")
