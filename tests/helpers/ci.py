"""Whether the suite runs under CI (``CI`` set, as ``.ci/run``'s caller does).

CI installs the system tools some tests drive for real (Slurm, Chromium); there a missing
tool is a failure, elsewhere a skip.
"""

from __future__ import annotations

import os


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
