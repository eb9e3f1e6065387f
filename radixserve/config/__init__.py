"""A server's options: ``ServerArgs`` (server_args.py) and its areas, one module each."""

from radixserve.config.scheduling import SCHEDULE_POLICIES
from radixserve.config.server_args import ServerArgs

__all__ = ["SCHEDULE_POLICIES", "ServerArgs"]
