"""The judge server: a saved calibrated judge over HTTP, comparisons batched across requests
(``judgeloop serve-judge``; :mod:`judgeloop.serving.app`)."""
