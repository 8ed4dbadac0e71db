"""A worker started inside an emulated cluster's namespace by tests/test_emulated_cluster.py.

``python tests/cluster_worker.py calibrate OUT``: join the gloo group from the environment the
cluster gives, fit the allreduce cost model over the shaped links; rank 0 writes it to OUT.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from dkfac.comm.cost_model import calibrate_alpha_beta


def main(argv: list[str]) -> int:
    """Run the action of ``argv`` on this rank."""
    action, out = argv
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if action == "calibrate":
            model = calibrate_alpha_beta()  # what SPD/PAD measure, at its defaults
            if dist.get_rank() == 0:
                with open(out, "w") as handle:
                    json.dump({"alpha": model.alpha, "beta": model.beta}, handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
