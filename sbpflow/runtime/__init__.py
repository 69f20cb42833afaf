"""The pipeline runtime: :mod:`sbpflow.runtime.schedules` has the schedules as data (per
rank a list of actions, communication included: 1F1B, GPipe, interleaved, zero-bubble)
and the simulator that checks them; :mod:`sbpflow.graph` compiles each rank's list into
its program (``passes.pipeline``). :mod:`sbpflow.runtime.actors` decides the first three
orders by registers (the actors' model, which gives the same orders)."""

from . import schedules
from .actors import SCHEDULES, Task, bubble_fraction, plan, registers
from .schedules import Action, ScheduleError, Timeline, build, simulate

__all__ = ["SCHEDULES", "Action", "ScheduleError", "Task", "Timeline", "bubble_fraction",
           "build", "plan", "registers", "schedules", "simulate"]
