"""Deprecated alias: ``judgeloop.serving.llamacpp`` is :mod:`judgeloop.testing.llamacpp` (it starts
llama.cpp's server for tests and benchmarks; no library code uses it); this alias goes in 0.3.0."""

import sys

from judgeloop.deprecation import warn_moved_module
from judgeloop.testing import llamacpp

warn_moved_module(__name__, llamacpp.__name__)
sys.modules[__name__] = llamacpp
