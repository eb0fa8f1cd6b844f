"""The cost model and planner behind ``fastpar plan``.

    from fastpar.plan import (Cluster, ParallelConfig, Workload, evaluate, get_hardware,
                              memory_per_gpu, search)
    work = Workload(get_config("7b"), seq_len=4096, global_batch=512)
    cluster = Cluster(gpus=64, gpus_per_node=8, hardware=get_hardware("h100-80gb"))
    best, rejected = search(work, cluster)            # best first
    memory_per_gpu(work, cluster, ParallelConfig(tp=4, pp=2, dp=8))   # GB by kind
    evaluate(work, cluster, ParallelConfig(tp=4, pp=2, dp=8, micro_batch_size=1)).to_dict()
"""
from .cost import FASTPAR, Features, trainer_features
from .hardware import (BUILTIN, Hardware, device_profile, get_hardware, load_hardware,
                       save_hardware)
from ..models.parallel_config import ParallelConfig
from .planner import (Cluster, Estimate, Workload, candidates, evaluate, memory_per_gpu,
                      search)

__all__ = ["BUILTIN", "Cluster", "Estimate", "FASTPAR", "Features", "Hardware",
           "ParallelConfig", "Workload", "candidates", "device_profile", "evaluate",
           "get_hardware", "load_hardware", "memory_per_gpu", "save_hardware", "search",
           "trainer_features"]
