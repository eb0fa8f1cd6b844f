"""Pipeline parallelism. Schedules are data: one executor runs them, a simulator times
them.

    sched = build_schedule("1f1b", mesh.pp_size, num_microbatches=8)
    stages = build_stages(model, mesh.pp_rank, mesh.pp_size)
    pipe = PipelineExecutor(stages, sched, mesh.pp_group, loss_fn=F.cross_entropy)
    loss = pipe.step(inputs, targets)          # the loss on the last stage, None elsewhere
    simulate(sched).gantt("1f1b.png")
"""
from .executor import PipelineExecutor
from .p2p import PipelineTimeoutError
from .partition import estimate_layer_costs, partition
from .actions import Action, Schedule, ScheduleError
from .schedules import SCHEDULES, build_schedule, forward_schedule, make_schedule
from .simulate import Event, Simulation, chrome_trace, plot_gantt, simulate
from .stage import PipelineStage, build_stages

__all__ = ["Action", "Event", "PipelineExecutor", "PipelineStage", "PipelineTimeoutError",
           "SCHEDULES", "Schedule", "ScheduleError", "Simulation", "build_schedule",
           "build_stages", "chrome_trace", "estimate_layer_costs", "forward_schedule",
           "make_schedule", "partition", "plot_gantt", "simulate"]
