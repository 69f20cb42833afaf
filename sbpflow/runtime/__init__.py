"""The pipeline runtime: actors decide each stage's order of forward and backward
tasks (:mod:`sbpflow.runtime.actors`); :mod:`sbpflow.graph` compiles each rank's plan
into its program."""

from .actors import SCHEDULES, Task, bubble_fraction, plan, registers

__all__ = ["SCHEDULES", "Task", "bubble_fraction", "plan", "registers"]
