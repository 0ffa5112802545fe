"""Command implementations behind ``judgeloop COMMAND``: each module holds one config schema and ``run``."""
