"""Experiment drivers and their reports: each runs components on data and writes what it found.

Components (``judges/``, ``calibration/``, ``retrieval/``, ``routing/``, ``raft/``, ``loop/``) import no study.
"""
