"""Deprecated: cutting a padded processor batch into its rows (and back) is `hippo.padded`. This
module re-exports it for one minor version and warns on import; it goes in 0.3."""

from __future__ import annotations

import warnings

from hippo.padded import SEQUENCE_KEYS, pad_rows, split_rows

warnings.warn(
    "hippo.rows is deprecated and goes in 0.3: import split_rows and pad_rows from hippo.padded",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["SEQUENCE_KEYS", "pad_rows", "split_rows"]
