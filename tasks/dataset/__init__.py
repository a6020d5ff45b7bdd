"""Datasets: the tasks table (schemas.tables.TASKS) in the object store.

    key = build_dataset(cfg.dataset, store, cfg.sandbox)   # "datasets/<id>/tasks.parquet", cached
    rows = store.read_table(key, stage="tasks").to_pylist()
    patch = gold_patch(rows[0])                             # unified diff, `git apply` in /testbed
    ids = training_order(train_ids, epoch, seed, "fixed")   # order of training problems

- source "mini" (mini.py, templates.py, archive.py): generated R2E-Gym-format tasks with
  locally built environment archives, verified in sandboxes by build.py.
- source "r2e" (r2e.py): R2E-Gym rows as published (Parquet / JSON Lines, local or s3://).
"""

from tasks.dataset.build import build_dataset, build_mini_benchmark
from tasks.dataset.verify import DatasetVerificationError, verify_tasks
from tasks.dataset.mini import GenerationError, gold_patch
from tasks.dataset.order import training_batch, training_order
from tasks.dataset.r2e import DatasetError, LoadReport, load_r2e_dataset, read_rows, to_tasks

__all__ = ["build_dataset", "build_mini_benchmark", "verify_tasks", "gold_patch", "training_order",
           "training_batch", "load_r2e_dataset", "read_rows", "to_tasks", "LoadReport", "DatasetError",
           "DatasetVerificationError", "GenerationError"]
