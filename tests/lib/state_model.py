"""What a recurrent model does to its state tensors between steps, for the state tests.

After each step a model writes a new state into every request's slot (``req_to_state``)
and into the slots of its speculative tokens (``spec_state``). The writes are made on the
device, for every row at once, through ``index_copy_``. Two facts shape them:

* ``spec_state[r, :1 + k]`` is defined only while r has a step of 1 + k tokens in flight;
  every other entry is unspecified and may name a slot freed since, even one another row's
  current step now uses (docs/state_slots.md). Writing every entry, as this model does, then
  hands ``index_copy_`` the same slot twice.
* With a repeated index, which write lands is unspecified on CUDA (it depends on thread
  order). So each value written here depends only on the step and the slot written, never
  on the position in the index: repeated slots get the same value, and the result does not
  depend on the order of the writes. (A value per position made two identical runs -- a
  graph-replayed and an eager allocator -- differ on an H100 from operation 99 on.)

``reverse=True`` applies the writes in the other order, as a GPU may: a test can show its
comparison does not depend on the order. Cost: two ``index_copy_`` calls, no sync.
"""

from __future__ import annotations

import torch

__all__ = ["model_writes"]


def model_writes(alloc, conv: torch.Tensor, ssm: torch.Tensor, step: int,
                 reverse: bool = False) -> None:
    """``conv`` ``[L, slots + 1, ...]`` (slots on dimension 1) gets ``step * 100 + slot`` in
    every request's slot; ``ssm`` ``[slots + 1, ...]`` gets ``step * 100 + 50 + slot`` in
    every slot ``spec_state`` names (rows without one write the sink, slot 0)."""
    for table, tensor, dim, base in ((alloc.req_to_state, conv, 1, 0.0),
                                     (alloc.spec_state.reshape(-1), ssm, 0, 50.0)):
        index = table.long()
        if reverse:
            index = index.flip(0)
        values = step * 100.0 + base + index.to(tensor.dtype)
        shape = [1] * tensor.dim()
        shape[dim] = -1
        size = list(tensor.shape)
        size[dim] = len(index)
        tensor.index_copy_(dim, index, values.reshape(shape).expand(size).contiguous())
