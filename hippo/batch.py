"""Deprecated: the records `Pipeline.map` takes and the results it yields are `hippo.records`. This
module re-exports them for one minor version and warns on import; it goes in 0.3."""

from __future__ import annotations

import warnings

from hippo.records import (
    GENERATION_FIELDS,
    RECORD_FIELDS,
    VIDEO_FIELDS,
    Record,
    Result,
    check_batching,
    check_fields,
    check_id,
    failed,
    group_by_length,
    map_records,
)

warnings.warn(
    "hippo.batch is deprecated and goes in 0.3: import Record, Result and the rest from hippo.records",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["GENERATION_FIELDS", "RECORD_FIELDS", "VIDEO_FIELDS", "Record", "Result", "check_batching",
           "check_fields", "check_id", "failed", "group_by_length", "map_records"]  # fmt: skip
