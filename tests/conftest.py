import os

# Must be set before anything imports cutlass: with no GPU the CuTe DSL would target sm_100a.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# The FLA column must always be FLA's own Triton kernels, never FlashKDA.
os.environ.setdefault("FLA_FLASH_KDA", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    # A CULA_BACKEND left in the environment would silently change what every test exercises.
    monkeypatch.delenv("CULA_BACKEND", raising=False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
