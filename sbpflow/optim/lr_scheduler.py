"""Learning-rate schedulers: torch's own, re-exported (``from sbpflow.optim.lr_scheduler
import StepLR`` as ``from torch.optim.lr_scheduler import StepLR``).

sbpflow's optimizers are ``torch.optim.Optimizer`` subclasses (their ``param_groups``
hold the learning rates), so torch's schedulers drive them unchanged, eagerly and in an
``nn.Graph`` (``add_optimizer(opt, lr_sch=...)``: stepped after each call).
"""

from torch.optim.lr_scheduler import *  # noqa: F403 - the module is torch's API
from torch.optim.lr_scheduler import __all__  # noqa: F401
