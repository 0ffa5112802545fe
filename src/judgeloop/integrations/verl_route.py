"""Deprecated alias: ``judgeloop.integrations.verl_route`` is :mod:`judgeloop.serving.verl_route` since 0.2.0
(verl's ``POST /verl/reward`` route answers through the judge server's batcher, so it lives with the
server, as the OpenRLHF route does; :func:`judgeloop.integrations.verl.compute_score`, what verl calls,
stays in ``integrations/``); this alias goes in 0.3.0."""

import sys

from judgeloop.deprecation import warn_moved_module
from judgeloop.serving import verl_route

warn_moved_module(__name__, verl_route.__name__)
sys.modules[__name__] = verl_route
