"""WORKER SIDE, no transport but the subprocess loop.

Hosting k envs (``runner``), the process's pipe loop (``worker``), old-Gym envs, tracebacks
in the user's terms.
"""
