"""sparkinfer.comm: peer collectives for decode-sized tensors."""

from sparkinfer.comm.channel import Channel, ChannelLayout
from sparkinfer.comm.communicator import Communicator
from sparkinfer.comm.context import OpContext
from sparkinfer.comm.pool import EAGER, ChannelPool, Checkpoint
from sparkinfer.comm.topology import GridConfig, TopologyCaps, grid_config, select_algorithm

__all__ = [
    "Communicator",
    "ChannelPool",
    "Checkpoint",
    "Channel",
    "ChannelLayout",
    "EAGER",
    "OpContext",
    "TopologyCaps",
    "GridConfig",
    "select_algorithm",
    "grid_config",
]
