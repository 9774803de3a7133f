"""Small actor calls as a plain Dask RPC to a handler on the actor's worker.

A Dask actor call goes through the actor machinery on both ends: the caller wraps every argument for
serialization, hands the call to its event loop by a thread-safe callback (a self-pipe wakeup) and waits on
an ``ActorFuture``; the worker's ``actor_execute`` handler wraps the answer again. For the one-frame
messages of this system (:mod:`storage._wire`) that machinery costs more than the message: measured here
(interleaved, medians of 600 calls, 2 workers, load average ~11), a call echoing ~250 bytes took
1.2-2.4 ms as an actor call and 0.6-1.2 ms as a plain RPC to a worker handler over Dask's own
connection pool. So the calls on an evaluation's critical path (the coordinator's work calls to the
replicas, a replica's fetch and push to a shard on another worker) go straight to a handler,
:data:`HANDLER`, that the actor classes called this way install on their worker when they are built
(:func:`install`). They still travel over Dask's comms (its transport, security settings and connection
pool), fail with ``OSError`` when the worker is gone, and raise the method's own exception otherwise, as an
actor call does (``KeyError`` for an actor no longer on its worker). Only the methods a class lists in
``DIRECT_METHODS`` can be called this way; each takes one ``bytes`` frame.

Examples
--------
>>> class Echo:
...     DIRECT_METHODS = frozenset({"echo"})
...     async def echo(self, payload): return payload
>>> import asyncio
>>> asyncio.run(_call_method(Echo(), "echo", b"hi"))
b'hi'
"""

from __future__ import annotations

import contextvars
from typing import Any

from distributed.protocol import to_serialize

from distbelief.errors import ClusterError

from ._calls import current_worker

__all__ = ["HANDLER", "call_from_worker", "direct_call", "direct_call_to", "install"]

#: The worker handler's name (the ``op`` of the RPC message).
HANDLER = "distbelief_actor_call"


def _worker_var() -> contextvars.ContextVar[Any] | None:
    """Dask's "current worker" context variable (``get_worker`` reads it), if this version has it."""
    import distributed.worker

    var = getattr(distributed.worker, "_worker_cvar", None)
    return var if isinstance(var, contextvars.ContextVar) else None


async def _call_method(obj: Any, method: str, payload: bytes) -> Any:
    """``await obj.method(payload)`` if ``obj``'s class allows ``method`` to be called directly."""
    if method not in getattr(type(obj), "DIRECT_METHODS", ()):
        raise AttributeError(f"{type(obj).__name__}.{method} cannot be called directly")
    return await getattr(obj, method)(payload)


def install(worker: Any = None) -> None:
    """Install :data:`HANDLER` on ``worker`` (default: the worker running the caller); does nothing
    outside a worker or when it is installed already. Called by the actors' constructors."""
    worker = current_worker() if worker is None else worker
    if worker is None or HANDLER in worker.handlers:
        return
    var = _worker_var()

    async def handle(comm: Any, actor: str, method: str, payload: bytes) -> Any:
        # As Dask's own actor calls do: the method (and the tasks it starts) see this worker as current.
        token = var.set(worker) if var is not None else None
        try:
            obj = worker.state.actors.get(actor)
            if obj is None:
                raise KeyError(f"no actor {actor!r} on worker {worker.address}; it was released")
            answer = await _call_method(obj, method, payload)
        except Exception as exc:
            # Sent back to be raised by the caller, as Dask's actor calls do (a handler's own exception
            # would be logged on the worker with its traceback first: not an error of the worker's).
            return {"error": to_serialize(exc)}
        finally:
            if var is not None and token is not None:
                var.reset(token)
        # One bytes frame travels as it is; anything else (a big answer) as Dask serializes it.
        return answer if isinstance(answer, bytes) else {"object": to_serialize(answer)}

    worker.handlers[HANDLER] = handle


async def direct_call(pool: Any, actor: Any, method: str, payload: bytes) -> Any:
    """``await actor.method(payload)`` as a plain RPC through the connection pool ``pool`` (a client's
    or worker's ``rpc``); raises ``OSError`` if the actor's worker cannot be reached."""
    return await direct_call_to(pool, actor._address, actor.key, method, payload)


async def direct_call_to(pool: Any, address: str, key: str, method: str, payload: bytes) -> Any:
    """:func:`direct_call` of the actor with key ``key`` on the worker at ``address``."""
    answer = await pool(address).distbelief_actor_call(actor=key, method=method, payload=payload)
    if isinstance(answer, bytes):
        return answer
    if not isinstance(answer, dict):  # Dask answers None for an op the worker has no handler for
        raise ClusterError(
            f"the worker at {address} takes no direct calls: build the actor {key!r} from a class that "
            "calls storage._direct.install() in its constructor"
        )
    if "error" in answer:
        raise answer["error"]
    return answer["object"]


async def call_from_worker(worker: Any, address: str, key: str, method: str, payload: bytes) -> Any:
    """``await actor.method(payload)`` from ``worker``'s event loop: in-process when the actor lives on
    ``worker`` itself (no message), else :func:`direct_call_to` through the worker's connection pool.

    Examples
    --------
    >>> class Echo:
    ...     DIRECT_METHODS = frozenset({"echo"})
    ...     async def echo(self, payload): return payload
    >>> class Worker:  # the two attributes used of a Dask worker
    ...     address = "tcp://w"
    ...     class state: actors = {"e": Echo()}
    >>> import asyncio
    >>> asyncio.run(call_from_worker(Worker(), "tcp://w", "e", "echo", b"hi"))
    b'hi'
    """
    if address == worker.address:
        obj = worker.state.actors.get(key)
        if obj is None:
            raise KeyError(f"no actor {key!r} on worker {worker.address}; it was released")
        return await _call_method(obj, method, payload)
    return await direct_call_to(worker.rpc, address, key, method, payload)
