"""``dkfac bench``: time DDP + SGD against the K-FAC strategies.

The harness, its configurations, the dry-run byte accounting report, the targets and the
report writers.
"""
