"""Deprecated alias: ``judgeloop.integrations.openrlhf`` is :mod:`judgeloop.serving.openrlhf` since 0.2.0 (the
OpenRLHF route answers through the judge server's batcher, so it lives with the server); this alias goes
in 0.3.0."""

import sys

from judgeloop.deprecation import warn_moved_module
from judgeloop.serving import openrlhf

warn_moved_module(__name__, openrlhf.__name__)
sys.modules[__name__] = openrlhf
