"""A deployment's replicas, placed: the host of each, by its config's ``placement``.

``"local"`` (and any deployment that is not replicated, such as an upstream's) runs
the engine in this process (:class:`~tokenmill.replicas.local.LocalHost`); the rest
are supervised (:class:`~tokenmill.replicas.supervisor.SupervisedHost`) over what
launches them: a child process, a Ray actor, or a pool's named actor. Ray is imported
only for a deployment that asks for it.
"""

from __future__ import annotations

from tokenmill.config import DeploymentConfig, ReplicatedDeployment
from tokenmill.engines import create_engine
from tokenmill.replicas.host import ReplicaHost
from tokenmill.replicas.local import LocalHost
from tokenmill.replicas.process import ProcessLauncher
from tokenmill.replicas.supervisor import Launcher, SupervisedHost


def build_host(
    config: DeploymentConfig, *, ray_address: str | None = None, index: int = 0
) -> ReplicaHost:
    """The host of replica ``index`` of ``config``: where its engine runs is its
    placement (a Ray placement joins the cluster at ``ray_address``, or starts a local
    one; in a pool, replica ``index`` is the pool's actor of that index)."""
    config = config.for_replica(index)
    if not isinstance(config, ReplicatedDeployment) or config.placement == "local":
        return LocalHost(create_engine(config))
    launcher: Launcher
    if config.pool is not None:
        from tokenmill.replicas.pool import PoolLauncher

        launcher = PoolLauncher(config, index, ray_address)
    elif config.placement == "ray":
        from tokenmill.replicas.rayactor import RayLauncher

        launcher = RayLauncher(config, ray_address)
    else:
        launcher = ProcessLauncher(config.model_dump(mode="json"), nice=config.replica_nice)
    return SupervisedHost(
        launcher,
        slots=config.max_num_seqs,
        context_length=config.n_ctx,
        probe_interval_s=config.health_check_interval_s,
        probe_timeout_s=config.health_check_timeout_s,
    )


__all__ = ["build_host"]
