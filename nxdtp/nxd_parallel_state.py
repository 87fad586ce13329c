"""Deprecated: NxD's parallel_state names are defined in nxdtp.parallel_state (NxD's path); import them from there.

``nxdtp.nxd_parallel_state.X`` still gives ``nxdtp.parallel_state.X``, with a DeprecationWarning, for one release.
"""

from __future__ import annotations

import warnings

from nxdtp import parallel_state


def __getattr__(name: str):
    value = getattr(parallel_state, name)
    warnings.warn(f"nxdtp.nxd_parallel_state is deprecated: use nxdtp.parallel_state.{name}", DeprecationWarning,
                  stacklevel=2)
    return value
