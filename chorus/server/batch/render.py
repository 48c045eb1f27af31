"""The File and Batch objects as OpenAI's API returns them, from the store's rows."""

from __future__ import annotations

import json
from typing import Any

from chorus.server.batch.runner import AnyStore

TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at")


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "status_details": None,
            "expires_at": None}


async def batch_object(row: dict[str, Any], store: AnyStore) -> dict[str, Any]:
    if row["completed"] is not None:  # finished: counted when its files were written (its lines are gone)
        completed, failed = row["completed"], row["failed"]
    else:
        counts = await store.counts(row["id"])
        completed, failed = counts["completed"], counts["failed"]
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": json.loads(row["errors"]) if row["errors"] else None, "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"], "status": row["status"],
            "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{t: row[t] for t in TIMES},
            "request_counts": {"total": row["total"], "completed": completed, "failed": failed},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None}
