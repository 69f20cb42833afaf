"""The layers of ``sbpflow.nn`` (torch.nn's names, arguments, parameter names and
initialisation), one file per family."""

from .activation import *  # noqa: F403
from .container import *  # noqa: F403
from .conv import *  # noqa: F403
from .embedding_bag import *  # noqa: F403
from .embedding_collection import *  # noqa: F403
from .lazy import *  # noqa: F403
from .linear import *  # noqa: F403
from .loss import *  # noqa: F403
from .margin import *  # noqa: F403
from .norm import *  # noqa: F403
from .padding import *  # noqa: F403
from .pooling import *  # noqa: F403
from .rnn import *  # noqa: F403
from .sparse import *  # noqa: F403
from .transformer import *  # noqa: F403
