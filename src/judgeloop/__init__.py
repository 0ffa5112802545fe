"""judgeloop: train agents against evaluators whose feedback can be trusted."""

__version__ = "0.1.0"
