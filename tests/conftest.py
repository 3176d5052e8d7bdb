import os

# Must be set before anything imports cutlass: with no GPU the CuTe DSL would target sm_100a.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# Tests stub cute.compile and count compiles: no binary from a wheel or an earlier process may stand in
# (tests/test_cache.py turns both on in its own subprocesses).
os.environ.setdefault("CULA_PREBUILT", "0")
os.environ.setdefault("CULA_DISK_CACHE", "0")
# The FLA column must always be FLA's own Triton kernels, never FlashKDA, nor cula's own kernels through FLA's
# dispatch (cula.fla_dispatch; tests/test_fla_dispatch.py turns it on where it tests it).
os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLA_CULA", "0")
# GPU tests run in deterministic mode (the ``poisoned`` fixture below), where cuBLAS needs a fixed workspace
# configuration or warns on every matmul; it must be set before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def _fla_untuned() -> None:
    """Let FLA's Triton kernels skip autotuning in tests: one config each, the lightest.

    Tests compare numbers, and every config of a Triton autotuner computes the same result; but tuning
    compiles and times every config on the first call per shape (a KDA forward: ~90 s), which would eat
    most of a session's GPU time. Benchmarks do not load this file, so FLA is fully tuned there.
    CULA_TEST_FLA_AUTOTUNE=1 restores tuning.
    """
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def lightest(self, *args, **kwargs):
        configs = prune(self, *args, **kwargs)
        return sorted(configs, key=lambda c: (c.num_stages, c.num_warps))[:1]

    Autotuner.prune_configs = lightest


if HAS_CUDA and os.environ.get("CULA_TEST_FLA_AUTOTUNE") != "1":
    _fla_untuned()


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


@pytest.fixture
def poisoned():
    """Every uninitialised allocation of the test starts as NaN (integers: their largest value), whatever its
    size: ``cula.testing.poisoned_allocations``. An output element a kernel leaves unwritten then fails
    ``assert_close``. On for every GPU test (``_poison_gpu_tests``); CPU tests ask for it by name."""
    from cula.testing import poisoned_allocations

    with poisoned_allocations():
        yield


@pytest.fixture(autouse=True)
def _poison_gpu_tests(request):
    # Autouse fixtures are set up before the test's own function-scoped ones, so buffers those fixtures allocate
    # are poisoned too. Tensors allocated once and cached across calls are not: cula keeps none but the constant
    # placeholders of absent optional inputs (``cula.ops._host.placeholder``), which no kernel writes.
    if request.node.get_closest_marker("gpu") is not None:
        request.getfixturevalue("poisoned")


@pytest.fixture
def pretend_sm90(monkeypatch):
    """Let CPU tensors select the cula-sm90 backends: a CUDA device of compute capability 9.0 with every package
    installed, as far as ``cula.backends`` can tell. Tests stub the kernels themselves."""
    import cula.arch
    import cula.backends

    monkeypatch.setattr(cula.backends, "cuda_only", lambda dev: (True, None))
    monkeypatch.setattr(cula.backends, "has_package", lambda name: True)
    monkeypatch.setattr(cula.arch, "device_arch", lambda dev: (9, 0))
    # an H200's SM count (every planner reads it through cula.time_split)
    monkeypatch.setattr("cula.time_split.sm_count", lambda index: 132)


@pytest.fixture
def plan_counter(monkeypatch):
    """``count(module, checked="_checked")``: a fresh plan cache ``module._plans`` and a list whose one element counts
    the calls of ``module.<checked>`` (full validations), ``CULA_BACKEND`` unset."""
    from cula.backends import PlanCache

    monkeypatch.delenv("CULA_BACKEND", raising=False)

    def count(module, checked: str = "_checked"):
        calls = [0]
        monkeypatch.setattr(module, "_plans", PlanCache())
        real = getattr(module, checked)

        def counting(*a, **kw):
            calls[0] += 1
            return real(*a, **kw)

        monkeypatch.setattr(module, checked, counting)
        return calls

    return count


def _tuning_fixture(table):
    """A fixture function: ``set(**changes)`` overrides the sm_90 entry of ``table`` until the test ends (plans made
    under other numbers dropped on the way in and out)."""

    @pytest.fixture
    def fixture():
        import contextlib

        with contextlib.ExitStack() as stack:
            yield lambda **changes: stack.enter_context(table().override((9, 0), **changes))

    return fixture


def _kda_table():
    from cula.kda.plan import KDA_TUNING

    return KDA_TUNING


kda_tuning = _tuning_fixture(_kda_table)


def _lightning_table():
    from cula.lightning.plan import LIGHTNING_TUNING

    return LIGHTNING_TUNING


lightning_tuning = _tuning_fixture(_lightning_table)


def _gdn_table():
    from cula.gated_delta_rule.plan import GDN_TUNING

    return GDN_TUNING


gdn_tuning = _tuning_fixture(_gdn_table)


def pytest_runtest_logreport(report):
    # A step of scripts/device/validate.sh killed at its time limit prints no failure summary: each failure goes to
    # CULA_FAILURE_LOG as it happens, so the device run brings back what failed even when the step did not finish.
    path = os.environ.get("CULA_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
