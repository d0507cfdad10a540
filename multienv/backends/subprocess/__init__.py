"""PARENT SIDE, subprocess backend.

Worker processes on this machine, their pipes and shared memory, the data plane of the
healthy step, CPU claims.
"""
