"""BOTH SIDES, imports no side.

What the parent and its workers share: messages, framing, shared memory, done pipes, info
columns, the autoreset rule, worker settings.
"""
