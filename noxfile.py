"""The version matrix: the test suite and the examples on the floor stack and the newest stack.

    pip install nox && nox                 # both stacks, one after the other
    nox -k floor                           # one of them (or: nox -k newest)

Each stack is a fresh virtual environment with torch, transformers and pytest pinned (torch through a
constraint file, so that no other requirement moves it). Every torch here but the one the README installs is
a CUDA build of several GB: nox builds one environment at a time; ``nox --no-reuse-existing-virtualenvs``
starts over, ``rm -r .nox`` frees the disk.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

#: The stacks pyproject.toml's floors and the README's "Tested with" name. A change here changes those three.
STACKS = {
    "floor": {"torch": "2.6.0", "transformers": "4.57.6", "pytest": "8.0.2"},
    "newest": {"torch": "2.15.0", "transformers": "5.25.0", "pytest": "9.2.0"},
}


@nox.session(python="3.11")
@nox.parametrize("stack", list(STACKS))
def stack(session: nox.Session, stack: str) -> None:
    """Install one stack from nothing, then run `pytest tests` and `pytest examples --attncost-report`."""
    versions = STACKS[stack]
    constraints = session.create_tmp() + "/constraints.txt"
    with open(constraints, "w", encoding="utf-8") as out:
        out.write(f"torch=={versions['torch']}\n")  # replaces a machine-wide cap on torch for these installs
    env = {"PIP_CONSTRAINT": constraints}
    session.install(f"torch=={versions['torch']}", env=env)
    session.install("-e", ".[test]", f"transformers=={versions['transformers']}", f"pytest=={versions['pytest']}",
                    env=env)
    session.run("python", "-c", "import torch, transformers, pytest; "
                "print('torch', torch.__version__, 'transformers', transformers.__version__, "
                "'pytest', pytest.__version__)")
    session.run("pytest", "tests", "-n", "2", *session.posargs)
    session.run("pytest", "examples", "--attncost-report", "--slow")
