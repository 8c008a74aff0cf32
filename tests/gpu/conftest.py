"""GPU tests build many models in one process; each compiles the decode glue (``glue.py``) again for its shapes.
Dynamo's per-function recompile limit (8) is meant for one model per process, as the service runs, so every
test starts from a reset compiler cache."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo_cache():
    torch._dynamo.reset()
    yield
