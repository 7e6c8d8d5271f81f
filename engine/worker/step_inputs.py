"""What every tensor-parallel rank needs to run one step: the block
operations, the flat batch and the rows whose logits are wanted, made by the
driver's model runner from the scheduler's decisions (``ModelRunner
.prepare_inputs``) and sent to the other ranks as one int64 payload
(``TensorParallelGroup.broadcast_ints``): ranks receive a step's inputs,
never the scheduler's state.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

STEP, STOP = 1, 2  # broadcast kinds: a step's inputs follow; the workers leave their loop


@dataclass
class StepInputs:
    """One step's inputs (int64 arrays).

    Attributes:
        swap_out, swap_in, copy: [n, 2] (source, destination) KV blocks: device -> CPU swap, CPU -> device,
            copy-on-write; applied in that order before the forward pass.
        input_ids, positions, slot_mapping: [num_tokens] (``AttentionMetadata``'s meaning).
        query_start_loc: [num_seqs + 1]; seq_lens: [num_seqs]; block_tables: [num_seqs, max_blocks].
        logits_rows: [rows] the rows of the step's hidden states whose logits are computed, in order.
    """

    swap_out: np.ndarray
    swap_in: np.ndarray
    copy: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    logits_rows: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def to_wire(self) -> tuple[list[int], np.ndarray]:
        """(sizes, payload): the block tables' width first, then each array flattened, in field order."""
        arrays = [np.array([self.block_tables.shape[1] if self.block_tables.ndim == 2 else 0])]
        arrays += [np.asarray(getattr(self, f.name), dtype=np.int64).ravel() for f in fields(self)]
        return [len(a) for a in arrays], np.concatenate(arrays).astype(np.int64, copy=False)

    @classmethod
    def from_wire(cls, sizes: list[int], payload: np.ndarray) -> "StepInputs":
        """The inverse of ``to_wire``."""
        bounds = np.cumsum([0] + sizes[:1 + len(fields(cls))])
        parts = [payload[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
        width, arrays = int(parts[0][0]), dict(zip((f.name for f in fields(cls)), parts[1:]))
        for name in ("swap_out", "swap_in", "copy"):
            arrays[name] = arrays[name].reshape(-1, 2)
        arrays["block_tables"] = arrays["block_tables"].reshape(-1, width) if width else \
            arrays["block_tables"].reshape(0, 0)
        return cls(**arrays)
