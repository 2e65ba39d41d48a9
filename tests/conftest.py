import os
import sys

import pytest

# Make `tests.*` importable in spawned ranks.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

UNIT = os.path.join(ROOT, "tests", "unit")


def pytest_collection_modifyitems(config, items):
    """Every single-process test is in `make test-fast` (`-m fast`), with the dist cases marked fast."""
    for item in items:
        if str(item.path).startswith(UNIT + os.sep):
            item.add_marker(pytest.mark.fast)
