"""judgeloop: train agents against evaluators whose feedback can be trusted.

``from judgeloop import CalibratedJudge`` loads a calibrated judge saved by ``judgeloop calibrate``
(:mod:`judgeloop.judges.calibrated`); the import is lazy, so ``import judgeloop`` stays light.
"""

from typing import Any

from judgeloop.version import __version__


def __getattr__(name: str) -> Any:
    if name in ("CalibratedJudge", "Comparison"):
        from judgeloop.judges import calibrated

        return getattr(calibrated, name)
    raise AttributeError(f"module 'judgeloop' has no attribute {name!r}")


__all__ = ["CalibratedJudge", "Comparison", "__version__"]
