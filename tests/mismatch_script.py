"""Launched by tests/test_launch.py: the ranks box differently (a divergent program).

With SBPFLOW_DEBUG=1 every rank raises CollectiveMismatchError; the job must end with
exit code 1 (the Python error), not a C++ abort during gloo teardown.
"""

import sbpflow
from sbpflow.sbp import broadcast, split

pl = sbpflow.placement.all("cpu")
x = sbpflow.ones(8, 4, placement=pl, sbp=split(0))
x.to_global(sbp=broadcast if sbpflow.distributed.get_rank() == 0 else split(1))
