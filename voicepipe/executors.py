"""Which executor runs a sweep's independent items: ``--executor local|ray|ray://HOST:PORT``.

:func:`executor_for` turns the option's text into a :class:`voicepipe.parallel.Executor`: the local fork
pool (:class:`voicepipe.parallel.LocalExecutor`), or a Ray cluster (:mod:`voicepipe.parallel_ray`, imported
only here and only when asked for, since it needs the optional ``ray`` extra). A bad value or a missing
extra is a :class:`~voicepipe.errors.UserError` before any run starts.
"""

from __future__ import annotations

from voicepipe.errors import UserError
from voicepipe.parallel import Executor, LocalExecutor

EXECUTOR_HELP = (
    "Where the independent runs go: local (forked processes here, the default), ray (a local Ray: the one "
    "RAY_ADDRESS or `ray start` names, else a new one on loopback) or ray://HOST:PORT (a Ray cluster's "
    "client server). Results are the same on any of them. Ray needs the ray extra."
)


def executor_for(spec: str | None, workers: int | None = None) -> Executor:
    """The executor ``--executor spec`` names (None or ``local``: :class:`LocalExecutor` with ``workers``);
    a Ray one is connected here, so a bad address or a missing extra is a :class:`UserError` before any run."""
    text = (spec or "local").strip()
    if text == "local":
        return LocalExecutor(workers)
    if text != "ray" and not text.startswith("ray://"):
        raise UserError("--executor", f"expected local, ray or ray://HOST:PORT, got {text!r}")
    if text == "ray://":
        raise UserError("--executor", "ray:// needs HOST:PORT (the cluster's client server, port 10001 by default)")
    if workers is not None:
        raise UserError("--jobs", "counts local processes; a Ray cluster runs as many items as it has CPUs")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UserError("", "ray executor needs the ray extra: pip install 'voicepipe[ray]'") from None
    from voicepipe.parallel_ray import RayExecutor

    return RayExecutor(None if text == "ray" else text)
