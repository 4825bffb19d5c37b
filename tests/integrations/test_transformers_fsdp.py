"""FSDP2 (fully_shard) with the fused LM loss: two gloo processes on CPU against one process.

The LM head and each decoder layer are sharded, so the head's weight exists whole only while
FSDP2's pre-forward hook has gathered it: the fused loss must read it inside the head's call.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import batch, model_pair, reference_loss, rel_err  # noqa: E402

import fusedops.integrations.transformers as fo_hf  # noqa: E402

WORLD = 2
DTYPE = torch.float64


def _worker(rank: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        _, model = model_pair("llama", DTYPE)
        fo_hf.apply_fusedops(model)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model.lm_head)
        fully_shard(model)
        model.train()
        inputs, labels = batch("right", seed=10 + rank)
        out = model(**inputs, labels=labels, use_cache=False)
        assert out.logits is None
        out.loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        losses = [torch.zeros((), dtype=DTYPE) for _ in range(WORLD)]
        dist.all_gather(losses, out.loss.detach())
        if rank == 0:
            torch.save({"losses": torch.stack(losses), "grads": grads}, out_file)
        dist.barrier()
        # FSDP2's state holds gloo work objects; drop them while the group is alive.
        del model, out, grads
        gc.collect()
    finally:
        dist.destroy_process_group()
    # Skip interpreter finalisation: gloo's worker threads torn down there can abort the
    # process after the results are written (seen on a loaded 2-core machine). Exceptions above
    # still reach mp.spawn as failures.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_fsdp2_matches_one_process(tmp_path):
    import torch.multiprocessing as mp

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out_file = str(tmp_path / "result.pt")
    ctx = mp.spawn(_worker, args=(str(tmp_path / "init"), out_file), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the FSDP2 workers did not finish in 120 s")
    result = torch.load(out_file)

    # One process, no FSDP, stock model: the mean of the two ranks' losses, whose gradients
    # FSDP2 averages.
    ref, _ = model_pair("llama", DTYPE)
    ref.train()
    losses = []
    for rank in range(WORLD):
        inputs, labels = batch("right", seed=10 + rank)
        losses.append(reference_loss(ref(**inputs, use_cache=False).logits, labels))
    (sum(losses) / WORLD).backward()
    assert rel_err(result["losses"], torch.stack(losses)) < 1e-10
    for name, p in ref.named_parameters():
        assert rel_err(result["grads"][name], p.grad) < 1e-10, name
