"""Test setup: 8 host CPU devices (set before jax is imported), strict rank promotion."""
import gc
import os
import shutil
import tempfile

from dapo_jax.testing import FAST_COMPILE_XLA_FLAGS  # noqa: E402  (jax-free)

os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] != "cpu":  # On an accelerator, float32 means float32 (not TF32 or bf16 passes).
  os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One compilation cache for the whole test run: many tests jit the same tiny programs, which then
# compile once. The process that starts the run (the xdist controller, or pytest alone) makes a fresh
# directory; workers and the processes tests start inherit it; it is removed when the run ends.
_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dapo_jax_tests_jit_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
  from dapo_jax import testing
  path = str(tmp_path_factory.mktemp("tokenizer"))
  testing.build_tokenizer(path)
  return path


@pytest.fixture(autouse=True, scope="module")
def _free_programs_after_each_module():
  """A worker runs hundreds of tests: drop the compiled programs and arrays a module leaves behind, so
  its memory stays that of one module (programs come back from the persistent cache when needed)."""
  yield
  jax.clear_caches()
  gc.collect()


# --- CI: a skipped test is a failure unless it is allowed to skip there ---------------------------
# With CI=true (set by .ci/run and by CI services) every test must run: a skip means a missing
# dependency or file. Tests marked gpu/tpu, and those listed here with the reason, may skip.
CI_ALLOWED_SKIPS = {
    # Mounting a 16 MB tmpfs needs root with CAP_SYS_ADMIN, which CI containers usually lack.
    "tests/integration/reliability_test.py::test_full_disk_is_a_clear_error_and_keeps_checkpoints",
}
_ALLOWED_MARKERS = ("gpu", "tpu")


def _in_ci() -> bool:
  return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _fail_skip(report, what: str) -> None:
  reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
  report.outcome = "failed"
  report.longrepr = f"{what} was skipped in CI, where it must run ({reason}); see CI_ALLOWED_SKIPS in tests/conftest.py"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if (_in_ci() and report.skipped and not hasattr(report, "wasxfail")
      and item.nodeid not in CI_ALLOWED_SKIPS
      and not any(item.get_closest_marker(m) for m in _ALLOWED_MARKERS)):
    _fail_skip(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
  outcome = yield
  report = outcome.get_result()
  if _in_ci() and report.skipped:  # A module-level importorskip: a whole file would not run.
    _fail_skip(report, collector.nodeid)


# --- Order: the slow tests first, so that on -n 2 the two workers end together ----------------------
def pytest_collection_modifyitems(items):
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order otherwise


def pytest_sessionfinish(session):
  if _CACHE_DIR is not None:
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)
