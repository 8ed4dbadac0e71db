"""Datasets that need no download.

scikit-learn's digits, synthetic tensors, local CIFAR-10 batches, and the named registry
behind ``dkfac train --dataset``.
"""
