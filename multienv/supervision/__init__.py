"""PARENT SIDE, backend-neutral.

The control plane. Keeping one worker alive (lifecycle, failures, restart budget, recycling,
stats) behind the ``WorkerHandle`` seam, and the env proxies built on it.
"""
