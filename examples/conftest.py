"""The examples' one marker: ``slow`` for the examples that take most of the suite's time.

``pytest examples --attncost-report`` (the README's first command) leaves them out and says so;
``--slow`` (``.ci/run``, ``nox``) runs every example::

    pytest examples --attncost-report           # about a quarter of a minute
    pytest examples --attncost-report --slow    # all of them
"""


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run the slow examples too (999 decode steps, timed "
                     "real forwards); without it they are deselected")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a long example (999 decode steps, timed real forwards); run with --slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow") or config.getoption("markexpr"):
        return  # every example, or the ones -m names
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
        config._attncost_slow_left_out = len(slow)


def pytest_terminal_summary(terminalreporter, config):
    left_out = getattr(config, "_attncost_slow_left_out", 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} slow example(s) left out: run them with --slow")
