"""The Ray backend.

Envs in Ray actors, k per actor, under the same failure table.
"""
