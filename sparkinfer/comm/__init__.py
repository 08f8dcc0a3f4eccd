"""sparkinfer.comm: peer collectives for decode-sized tensors."""

from sparkinfer.comm.channel import Channel, ChannelLayout
from sparkinfer.comm.communicator import Communicator
from sparkinfer.comm.pool import EAGER, ChannelPool, Checkpoint
from sparkinfer.comm.topology import LaunchConfig, TopologyCaps, launch_config, select_algorithm

__all__ = [
    "Communicator",
    "ChannelPool",
    "Checkpoint",
    "Channel",
    "ChannelLayout",
    "EAGER",
    "TopologyCaps",
    "LaunchConfig",
    "select_algorithm",
    "launch_config",
]
