import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  keep torch loaded across pytester's in-process runs

import transformers  # noqa: F401  likewise: a heavy package must not be re-imported per run

sys.path.insert(0, str(Path(__file__).parent))

TINY_MODELS_SOURCE = (Path(__file__).parent / "tiny_models.py").read_text()


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester project with the tiny models importable and stable output."""
    pytester.makeini("[pytest]\nconsole_output_style = classic\n")
    pytester.makepyfile(tiny_models=TINY_MODELS_SOURCE)
    return pytester


def _warm_up() -> None:
    """Count once before any pytester run, so every module torch imports lazily while
    tracing is loaded here: pytester drops modules first imported inside a run, and some
    of torch's (operator libraries) cannot be imported twice."""
    import tiny_models

    from pytest_attncost import profile

    profile(tiny_models.torch_encoder(), 8)
    profile(tiny_models.bert_like(), 8)
    profile(tiny_models.llama_like(), 8)


_warm_up()
