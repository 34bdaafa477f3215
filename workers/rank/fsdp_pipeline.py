"""Pipeline parallelism with ``torch.distributed.pipelining`` (its docs, "Pipeline Parallelism",
and torchtitan's ``pipeline_llama``): each rank's stage modules (already TP-, checkpoint- and
FSDP-wrapped) become ``PipelineStage`` objects over the pp process group, and one schedule runs
a step's micro-batches through them: ``ScheduleGPipe``, ``Schedule1F1B``, or
``ScheduleInterleaved1F1B`` with several stages per rank in a loop (stage ``i`` on rank
``i % pp``). The loss is computed on the last stage, per micro-batch; the schedule scales the
gradients by the number of micro-batches (``scale_grads``), so a step's gradient is that of the
mean loss, as without a pipeline. Under FSDP2 the stage defers the gradient reduce-scatter to
the last micro-batch's backward itself (``PipelineStage`` knows ``FSDPModule``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from workers.fsdp_spec import FsdpPlan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: a stage's (input, output) tensor, by stage index: given, the stage skips the exchange of shapes
#: with its neighbours at the first step (a memory trace's fake process group carries no objects)
StageShapes = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def pipeline_schedule(modules: list[nn.Module], stage_ids: list[int], plan: FsdpPlan, device: torch.device,
                      group: Any, loss_fn: LossFn, shapes: StageShapes | None = None) -> Any:
    """The schedule that runs this rank's stages (``modules``, ``stage_ids``) of ``plan``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    def stage(module: nn.Module, index: int) -> Any:
        if shapes is None:
            return PipelineStage(module, index, plan.stages, device, group=group)
        inputs, outputs = shapes(index)
        return PipelineStage(module, index, plan.stages, device, input_args=inputs, output_args=outputs, group=group)

    stages: list[Any] = [stage(m, s) for m, s in zip(modules, stage_ids, strict=True)]
    if plan.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches=plan.microbatches, loss_fn=loss_fn)
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[plan.schedule]
    return single(stages[0], n_microbatches=plan.microbatches, loss_fn=loss_fn)


def pipeline_step(schedule: Any, stage_ids: list[int], plan: FsdpPlan, ids: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor | None:
    """One step's forward and backward through the pipeline: the first stage's rank feeds the
    replica's rows, the last stage's rank gets the targets; returns the mean micro-batch loss on
    the rank holding the last stage, None on the others."""
    first, last = 0 in stage_ids, plan.stages - 1 in stage_ids
    args = (ids,) if first else ()
    losses: list[torch.Tensor] = []
    if last:
        schedule.step(*args, target=labels, losses=losses)
        return torch.stack([x.detach().float() for x in losses]).mean()
    schedule.step(*args)
    return None
