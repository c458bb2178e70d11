"""The examples' one marker: ``slow`` for the examples that take most of the suite's time.

The README's first command leaves them out (``-m "not slow"``); the full run (``.ci/run``,
``nox``) runs every example::

    pytest examples -m "not slow" --attncost-report    # about a quarter of a minute
    pytest examples --attncost-report                   # all of them
"""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a long example (999 decode steps, timed real forwards); -m 'not slow' leaves it out")
