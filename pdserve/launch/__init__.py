"""`pdserve launch`: a whole disaggregated cluster in one command.

    config.py        cluster.yaml (ClusterConfig) and each instance's worker config, checked up front
    local.py         on this host: every instance and the orchestrator as supervised processes
    ray_cluster.py   on a Ray cluster (`--ray`), and `pdserve scale`, which resizes it while it serves
"""
