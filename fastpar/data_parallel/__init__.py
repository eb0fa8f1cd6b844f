"""Data parallelism (bucketed gradient reduction overlapped with backward, ZeRO-1)."""
from .buckets import BucketSpec, assign_buckets
from .data_parallel import DataParallel
from .zero import DistributedOptimizer

__all__ = ["BucketSpec", "DataParallel", "DistributedOptimizer", "assign_buckets"]
