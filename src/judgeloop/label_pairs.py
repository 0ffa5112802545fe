"""Deprecated alias: ``judgeloop.label_pairs`` is :mod:`judgeloop.preference_labels` since 0.2.0 (the
``label-pairs`` command keeps its name, in ``judgeloop.commands.label_pairs``); this alias goes in 0.3.0."""

import sys

from judgeloop import preference_labels
from judgeloop.deprecation import warn_moved_module

warn_moved_module(__name__, preference_labels.__name__)
sys.modules[__name__] = preference_labels
