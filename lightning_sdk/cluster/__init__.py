"""The job placed on a Ray cluster (``[cluster] ray = ADDRESS``, ``lightning-sdk daemon --ray ADDRESS``).

    driver (the daemon: store, proxy, training loop; verl's ranks are Ray actors of their own)
      ├── learner actor   (``[cluster] learner``, the embedded learner on ``learner_resource``'s node)
      ├── engine actors   (``[cluster] engines``, each needing ``engine_resource``: where the GPUs are)
      ├── proxy actors    (``[cluster] proxies``, CPU nodes: token mode over the engine actors, the daemon's store)
      └── worker actors   (``[cluster] workers``, each running ``worker_concurrency`` agent workers, CPU nodes)

Every actor is restarted by Ray when it dies (``max_restarts``). Ray is imported only here and only when a cluster
is configured: the single-process default never imports it (docs/scale-out.md, "Placed by Ray").
"""

from lightning_sdk.cluster.placement import ClusterRun, RayEngine, RayLearner, connect, ray_learner_parts

__all__ = ["ClusterRun", "RayEngine", "RayLearner", "connect", "ray_learner_parts"]
