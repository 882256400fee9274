"""The expert exchange of attention-DP + EP: the graph's EPGather (dispatch) and EPScatter (combine) nodes, which
the runtime's communicator runs through one of these backends, chosen at start-up (k3runtime.dist.exchange).

    local   one EP rank: nothing to exchange (no object).
    nccl    (default, nccl.py) torch.distributed collectives on fixed-capacity buffers: each rank contributes
            `capacity` rows (its tokens, zero-padded, routing weight 0 on the padding), all ranks gather them, run
            their local experts on the rows routed to them, and reduce-scatter the partial sums back to the owners.
            Shapes never depend on the routing, so there is no device->host sync and the step can be captured
            as a CUDA graph. A fixed-size all-to-all would move the same bytes (NCCL sends the padding too);
            the per-local-expert grouping DeepEP's buffers give is done by the MoE plugin's on-device sort.
    deepep  (deepep.py) DeepEP's low-latency kernels (`deep_ep.Buffer.low_latency_dispatch/combine`): a token
            travels only to the ranks owning its experts and arrives in per-local-expert buffers
            [local experts, ranks x capacity, width] with a count per expert. The MoE plugin sees those rows
            with top-1 routing to their expert (weight 1, id -1 past the count, so padding is skipped), and
            DeepEP's combine applies the routing weights on the way back.

Both take dispatch(z, ids, weights, capacity) -> (rows, ids, weights) for the local experts and combine(y,
num_tokens, capacity) -> this rank's tokens' sums.
"""

from .deepep import DeepEPExchange
from .nccl import NcclExchange, gather_cat

__all__ = ["DeepEPExchange", "NcclExchange", "gather_cat"]
