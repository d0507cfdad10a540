"""PARENT SIDE.

The backends that start workers: ``subprocess`` (processes on this machine) and ``ray``
(actors on a cluster). Found through the ``multienv.backends`` entry points.
"""
