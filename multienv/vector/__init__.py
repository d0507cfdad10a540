"""VECTOR API, PARENT SIDE, backend-neutral.

The ``gymnasium.vector.VectorEnv`` over env proxies: its checks, its fan-out of calls to the
workers, the assembly of their results, ``send``/``recv`` and planning.
"""
