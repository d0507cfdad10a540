"""Where worker processes come from.

The module server (a process that imports the env's modules once and forks workers),
multiprocessing's forkserver, and what both import before forking.
"""
