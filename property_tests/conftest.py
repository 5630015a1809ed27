"""Hypothesis profiles for the property suite; select one with ``HYPOTHESIS_PROFILE`` (default ``ci``).

- ``ci``: derandomized and fast (the whole suite, Triton interpreter cases included, in a few
  minutes on 2 CPU cores); no example database.
- ``dev``: random, more examples, failures remembered in the local example database.
- ``nightly``: many examples and the ``target`` phase, which steers generation towards the
  worst error / tolerance ratio each test reports through ``hypothesis.target``.

Without CUDA, the repository's top-level conftest.py sets ``TRITON_INTERPRET=1`` before any
test module imports Triton kernels.
"""
import os

from hypothesis import HealthCheck, Phase, settings

from .helpers import WORST

_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.differing_executors])
_no_target = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]
settings.register_profile("ci", max_examples=10, derandomize=True, database=None, phases=_no_target, **_common)
settings.register_profile("dev", max_examples=40, phases=_no_target, **_common)
settings.register_profile("nightly", max_examples=int(os.environ.get("OSDN_NIGHTLY_EXAMPLES", "400")), **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_report_header(config):
    return f"hypothesis profile: {settings.get_current_profile_name()} (max_examples={settings.default.max_examples})"


def pytest_terminal_summary(terminalreporter):
    """The worst error / tolerance ratio and example count each test saw."""
    if not WORST:
        return
    terminalreporter.section("worst error / tolerance per test")
    for name, (ratio, detail, count) in sorted(WORST.items()):
        terminalreporter.write_line(f"{ratio:10.3e}  {count:5d} examples  {name}  {detail}")


def pytest_configure(config):
    # The Triton interpreter's numpy scalar conversions; not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:triton.runtime.interpreter")
