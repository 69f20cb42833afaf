"""Planning a layout: hardware profiles, the cost model's terms, and predictions of a
training step (the automatic-parallelism issue builds its search on these)."""

from .cost import collective_time, op_time
from .hardware import Hardware, Link, load, names
from .predict import predict_step
from .simulate import GPTShape, Layout, Prediction, model_flops, simulate_gpt

__all__ = ["GPTShape", "Hardware", "Layout", "Link", "Prediction", "collective_time", "load",
           "model_flops", "names", "op_time", "predict_step", "simulate_gpt"]
