"""WORKER SIDE, Ray backend: the actor class that hosts the k envs of one worker.

``MultienvWorker`` is a plain class; ``ray_env`` turns it into a Ray actor with
``ray.remote`` when the backend is first used, so importing this module imports no Ray. It
wraps the same ``EnvRunner`` as the subprocess worker, and speaks the same pickled
``Request`` / ``Reply`` as its pipe: the actor takes and returns bytes, so what reaches the
parent was unpickled by us (writable arrays, and the same "cannot be pickled" errors naming
the info key) rather than by Ray's zero-copy deserializer.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

from multienv.wire.framing import decode, encode
from multienv.wire.procfs import resident_mb
from multienv.wire.protocol import Reply
from multienv.worker.runner import BuildError, EnvRunner, encode_reply


class MultienvWorker:
    """The envs of one Ray actor, addressed by their position in it.

    Args:
        env_fn_bytes: The cloudpickled env factories, one per env of the actor.
    """

    def __init__(self, env_fn_bytes: Sequence[bytes]) -> None:
        """Keep the factories; ``build()`` calls them (so a failure is a reply, not a death)."""
        self._runner = EnvRunner(env_fn_bytes)

    def build(self) -> tuple[int, str, bytes]:
        """Build the envs: this process's pid and Ray node id, and the pickled descriptions."""
        import ray  # only ever called inside a Ray actor

        # The driver owns Ctrl-C and shutdown, as it does for a subprocess worker.
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not Ray's main thread; Ray handles SIGINT there itself
            pass
        try:
            reply = Reply(self._runner.build())
        except BuildError as exc:
            reply = Reply(failure=exc.failure)
        return os.getpid(), ray.get_runtime_context().get_node_id(), encode(reply)

    def serve(self, request_bytes: bytes) -> bytes:
        """Answer one pickled ``Request`` (a batch of orders, or a call of one env)."""
        request = decode(request_bytes)
        return encode_reply(self._runner.serve(request), request)

    def rss_mb(self) -> float | None:
        """This process's resident memory in MiB (None if it cannot be read)."""
        return resident_mb()

    def close(self) -> None:
        """Close the envs; the parent then kills the actor."""
        self._runner.close()
