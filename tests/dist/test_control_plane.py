"""The driver's control plane on real gloo ranks: results come back with the dtype and shape their sender gave.

Under attention-DP the driver may score (fp32 logits [N, V]) while another rank runs an idle step and sends empty
int64 token ids; the receiver once assumed its own step's kind for every rank, read a shape of the wrong length,
and built a tensor from uninitialised memory (test_multirank's dp2xep2 score failed now and then)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from liveness import free_port

from k3runtime.dist.comm import ControlPlane

SENT = [torch.zeros(0, dtype=torch.int64), torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor([7, 8, 9]), torch.zeros(0, 5, dtype=torch.float32),
        torch.tensor([[-0.5, 42.0, -1.25]], dtype=torch.float64)]  # a logprobs row: a token id among its values


def _rank(rank: int, port: int, out: str):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    control = ControlPlane()
    if rank == 1:
        for t in SENT:
            control.send_result(t, dst=0)
    else:
        torch.save([control.recv_result(1) for _ in SENT], out)
    dist.destroy_process_group()


def test_results_carry_their_own_dtype_and_shape(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path / "got")), nprocs=2)
    got = torch.load(tmp_path / "got")
    for sent, back in zip(SENT, got):
        assert back.dtype == sent.dtype and back.shape == sent.shape and torch.equal(back, sent)


def test_unsupported_results_are_refused_before_sending():
    with pytest.raises(TypeError, match="int64 token ids, fp64 logprob rows or fp32 logits"):
        ControlPlane.send_result(None, torch.zeros(2, dtype=torch.bfloat16))  # checked before the group is used
