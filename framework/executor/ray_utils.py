"""Ray helpers shared by the Ray executor and the Ray data-parallel launcher: joining or starting a cluster,
placement groups, the environment actors inherit, and waiting on actor calls so that a dead actor is
noticed at once.

Ray is imported inside the functions: ``import tokenmill.executor.ray_utils`` works without Ray installed.

Environment variables:

* ``RAY_ADDRESS`` (or ``--ray-address``): the cluster to join; without it a local Ray instance is started.
* ``TOKENMILL_RAY_CPUS_PER_WORKER``: CPUs each CPU-platform rank asks for (and its torch threads); default:
  this machine's cores divided by the ranks of all engine cores, at least 1.
* ``TOKENMILL_RAY_PLACEMENT_STRATEGY``: ``PACK`` (default), ``SPREAD``, ``STRICT_PACK`` or
  ``STRICT_SPREAD`` (Ray's placement-group strategies).
* ``TOKENMILL_RAY_BUNDLE_RESOURCES``: extra resources per bundle, as JSON: one object for every bundle
  (``{"trn": 1}``) or a list with one object per rank (``[{"node_a": 0.01}, {"node_b": 0.01}]``), e.g. to pin
  ranks to nodes that advertise a custom resource (``ray start --resources``).
* ``TOKENMILL_RAY_PLACEMENT_TIMEOUT_S``: how long to wait for the cluster to place a group (default 120).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

CPUS_PER_WORKER_ENV = "TOKENMILL_RAY_CPUS_PER_WORKER"
STRATEGY_ENV = "TOKENMILL_RAY_PLACEMENT_STRATEGY"
BUNDLE_RESOURCES_ENV = "TOKENMILL_RAY_BUNDLE_RESOURCES"
PLACEMENT_TIMEOUT_ENV = "TOKENMILL_RAY_PLACEMENT_TIMEOUT_S"
RAY_NAMESPACE = "tokenmill"  # actors are named in it: tokenmill-<engine id>-dp<d>-rank<r>
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# environment variables every actor inherits from the process that creates it
_FORWARDED_PREFIXES = ("TOKENMILL_", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class RayPlacementError(RuntimeError):
    """The cluster cannot place the requested bundles (not enough CPUs, GPUs or custom resources)."""


def connect_ray(address: str | None, num_cpus_if_local: int | None = None) -> bool:
    """Join the Ray cluster at ``address`` (else ``$RAY_ADDRESS``), or start a local one.

    Nothing happens when this process is already connected (e.g. inside a Ray actor, or a script that
    called ``ray.init`` itself).

    Args:
        address: ``host:port`` of the cluster's GCS (``ray start --head`` prints it), ``"auto"``, or ``None``.
        num_cpus_if_local: logical CPUs of a local instance started here (at least the bundles asked for).

    Returns:
        Whether this call connected (the caller then disconnects with ``ray.shutdown()`` when done).

    Raises:
        ConnectionError: no cluster answers at ``address``.
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": True}
    if address is None:
        # "local": always a new instance, never some other cluster that happens to run on this machine
        address = "local"
        cores = os.cpu_count() or 1
        kwargs.update(num_cpus=max(cores, num_cpus_if_local or 0), include_dashboard=False)
        logger.info("no Ray cluster given (--ray-address / RAY_ADDRESS): starting a local Ray instance")
    # ray.init installs its own SIGTERM handler in a driver (exit at once); the server's must stay in charge.
    saved = _signal_handlers()
    try:
        ray.init(address=address, namespace=RAY_NAMESPACE, **kwargs)
    finally:
        _restore_signal_handlers(saved)
    return True


def _signal_handlers() -> dict[int, Any]:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}


def _restore_signal_handlers(saved: dict[int, Any]) -> None:
    import signal

    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


def forwarded_env() -> dict[str, str]:
    """The ``TOKENMILL_*`` (and tokenizer / hub offline) variables of this process, for actors'
    ``runtime_env`` (a Ray worker inherits the raylet's environment, not the creating process's)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIXES)}


def cpus_per_worker(total_ranks: int) -> int:
    """CPUs a CPU-platform rank asks for: ``TOKENMILL_RAY_CPUS_PER_WORKER`` or cores // ranks (>= 1)."""
    value = os.environ.get(CPUS_PER_WORKER_ENV)
    if value:
        return max(1, int(value))
    return max(1, (os.cpu_count() or 1) // max(1, total_ranks))


def bundle_specs(
    num_bundles: int, base: dict[str, float], first: int = 0, total: int | None = None
) -> list[dict[str, float]]:
    """``num_bundles`` copies of ``base`` plus ``TOKENMILL_RAY_BUNDLE_RESOURCES``.

    A list in the variable names every bundle of all engine cores (``total``, default ``num_bundles``);
    these bundles are its entries ``first .. first + num_bundles - 1``.

    Raises:
        ValueError: the variable is not a JSON object or a list of ``total`` objects.
    """
    total = num_bundles if total is None else total
    bundles = [dict(base) for _ in range(num_bundles)]
    text = os.environ.get(BUNDLE_RESOURCES_ENV)
    if not text:
        return bundles
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{BUNDLE_RESOURCES_ENV}: not JSON ({exc})") from None
    if isinstance(extra, dict):
        extra = [extra] * total
    if not isinstance(extra, list) or len(extra) != total or not all(isinstance(e, dict) for e in extra):
        raise ValueError(f"{BUNDLE_RESOURCES_ENV}: expected an object or a list of {total} objects, got {text!r}")
    for bundle, more in zip(bundles, extra[first : first + num_bundles]):
        for key, value in more.items():
            bundle[key] = bundle.get(key, 0) + float(value)
    return bundles


def placement_strategy() -> str:
    """Raises:
    ValueError: ``TOKENMILL_RAY_PLACEMENT_STRATEGY`` is not one of Ray's strategies.
    """
    strategy = os.environ.get(STRATEGY_ENV, "PACK").upper()
    if strategy not in _STRATEGIES:
        raise ValueError(f"{STRATEGY_ENV}: must be one of {', '.join(_STRATEGIES)}, got {strategy!r}")
    return strategy


def create_placement_group(bundles: Sequence[dict[str, float]], name: str = "") -> Any:
    """Reserve ``bundles`` on the cluster and wait until they are placed.

    Raises:
        RayPlacementError: not placed within ``TOKENMILL_RAY_PLACEMENT_TIMEOUT_S`` (the group is removed;
            the message lists what was asked and what the cluster has).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    strategy = placement_strategy()
    pg = placement_group(list(bundles), strategy=strategy, name=name)
    timeout = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "120"))
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        raise RayPlacementError(
            f"the Ray cluster could not place {len(bundles)} bundles {list(bundles)} ({strategy}) within "
            f"{timeout:.0f} s; cluster resources: {ray.cluster_resources()}, available: "
            f"{ray.available_resources()} (add nodes, lower the parallel sizes, or set {CPUS_PER_WORKER_ENV})"
        )
    return pg


def remove_placement_group(pg: Any) -> None:
    """Release a placement group (best effort; it may already be gone with its job)."""
    from ray.util.placement_group import remove_placement_group as remove

    try:
        remove(pg)
    except Exception:  # noqa: BLE001 - the cluster may be gone
        logger.debug("removing placement group failed", exc_info=True)


def wait_all(refs: Sequence[Any], timeout_s: float | None) -> list[Any]:
    """``ray.get`` of every ref, but returning or raising as soon as any of them fails.

    ``ray.get(refs)`` would wait for all of them, and the live ranks of a broken group may be stuck in a
    collective waiting for the dead one; here the first error (e.g. ``RayActorError`` of a killed actor)
    surfaces at once.

    Raises:
        ray.exceptions.GetTimeoutError: not all done within ``timeout_s``.
        ray.exceptions.RayActorError / RayTaskError: an actor died or its call raised.
    """
    import ray

    results: dict[Any, Any] = {}
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} calls not done")
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for ref in ready:
            results[ref] = ray.get(ref)
    return [results[ref] for ref in refs]
