"""Deprecated alias: ``judgeloop.serving.openai_compat`` is :mod:`judgeloop.testing.openai_compat`
(a test and demo server that no library code uses, moved out of the judge server's package);
``python -m judgeloop.serving.openai_compat MODEL --port N`` still runs it, with a ``DeprecationWarning``
naming the new command. This alias goes in 0.3.0."""

import sys

from judgeloop.deprecation import warn_moved_main, warn_moved_module
from judgeloop.testing import openai_compat

if __name__ == "__main__":  # python -m judgeloop.serving.openai_compat ...
    warn_moved_main("judgeloop.serving.openai_compat", openai_compat.__name__)
    openai_compat.main()
else:
    warn_moved_module(__name__, openai_compat.__name__)
    sys.modules[__name__] = openai_compat
