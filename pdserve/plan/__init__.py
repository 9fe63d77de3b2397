"""`pdserve plan`: the deployment for an SLO, from a profile of this machine (see cli.py)."""
