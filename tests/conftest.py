import os
import sys

import pytest

# Make `tests.*` importable in spawned ranks.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

UNIT = os.path.join(ROOT, "tests", "unit")


def pytest_collection_modifyitems(config, items):
    """Every single-process test is in `make test-fast` (`-m fast`), with the dist cases marked fast,
    except the few marked `heavy` (seconds each: a subprocess, a timed profile); `make test` runs all."""
    for item in items:
        if str(item.path).startswith(UNIT + os.sep) and item.get_closest_marker("heavy") is None:
            item.add_marker(pytest.mark.fast)
