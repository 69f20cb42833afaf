"""The pipeline runtime: actors decide each stage's order of forward and backward
tasks (:mod:`sbpflow.runtime.actors`); :mod:`sbpflow.graph` compiles each rank's plan
into its program. :mod:`sbpflow.runtime.schedules` has the schedules as data (per rank a
list of actions, communication included) and the simulator that checks them."""

from . import schedules
from .actors import SCHEDULES, Task, bubble_fraction, plan, registers
from .schedules import Action, ScheduleError, Timeline, build, simulate

__all__ = ["SCHEDULES", "Action", "ScheduleError", "Task", "Timeline", "bubble_fraction",
           "build", "plan", "registers", "schedules", "simulate"]
