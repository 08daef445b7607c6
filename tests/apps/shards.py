"""What each rank of a sharding strategy should hold of a model's full weights, for the apps to record
beside what the rank really holds. The sweep app and the template project both copy this module: the
template is a project of its own and gets it as src/shards.py."""

import torch


def shards_of(net, world):
    """What each of ``world`` ranks should hold of ``net``'s full weights, by sharding strategy: the sum
    of each rank's part. "flat": HydraFSDP's one unit, all parameters in one flat tensor, padded and
    split evenly; "rows": FSDP2 (HydraModelParallel's fully_shard), each parameter split along dim 0."""
    params = [p.detach().double() for p in net.parameters()]
    flat = torch.cat([p.flatten() for p in params])
    size = -(-flat.numel() // world)
    rows = [0.0] * world
    for p in params:
        for rank, chunk in enumerate(torch.chunk(p, world, dim=0)):
            rows[rank] += float(chunk.sum())
    return {"flat": [float(flat[r * size : (r + 1) * size].sum()) for r in range(world)], "rows": rows}
