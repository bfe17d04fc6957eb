"""A robot reached through the Tandem driver protocol, as a gymnasium env.

* :mod:`envs.robot.protocol`   the message schemas, errors, and helpers both ends share
                               (the protocol itself is described there)
* :mod:`envs.robot.client`     :class:`RobotEnv`, the gym env talking to a driver, and
                               :func:`make_robot_env` (the registry's factory)
* :mod:`envs.robot.heartbeat`  the client's heartbeat thread
* :mod:`envs.robot.driver`     the reference driver serving any registered env
                               (``python -m envs.robot.driver``); it opens sockets, so it is
                               a process entry point and is not imported here
"""

from envs.robot.client import RobotEnv, make_robot_env
from envs.robot.protocol import (
    DEFAULT_PORT, DRIVER_PROTOCOL_VERSION, DRIVER_SCHEMAS, MAX_DRIVER_MESSAGE_BYTES, RobotError,
    RobotLinkLost, RobotStopped, endpoint_is_loopback, jsonable, obs_from_message, obs_to_arrays,
    spec_message,
)

__all__ = [
    "RobotEnv", "make_robot_env", "DEFAULT_PORT", "DRIVER_PROTOCOL_VERSION", "DRIVER_SCHEMAS",
    "MAX_DRIVER_MESSAGE_BYTES", "RobotError", "RobotLinkLost", "RobotStopped", "endpoint_is_loopback",
    "jsonable", "obs_from_message", "obs_to_arrays", "spec_message",
]
