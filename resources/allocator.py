"""Micro-batch sizing from free device memory, and halving on out-of-memory.

Before an optimizer step the trainable roles ask how many rows fit: the configured
micro-batch size, lowered when free GPU memory divided by the measured bytes per token says
fewer fit. If a forward/backward still runs out of memory, the role halves the micro-batch
and redoes the same optimizer step from zero gradients; gradients are sums over global
token counts, so the result is the same whatever the split. Pure logic here; the caller
reads the device (torch.cuda.mem_get_info on its own GPU).
"""

from __future__ import annotations

from dataclasses import dataclass


class OutOfMemoryAtOneRow(RuntimeError):
    """Even a single row does not fit: smaller micro-batches cannot help."""


@dataclass
class MicroBatchAllocator:
    headroom: float = 0.8                 # share of free memory a micro-batch may plan to use
    bytes_per_token: float | None = None  # the largest peak activation bytes per token seen so far

    def rows(self, max_rows: int, tokens_per_row: int, free_bytes: int | None) -> int:
        """Rows per micro-batch: at most `max_rows`, at least 1.

        Without a measurement or a memory reading (CPU) the configured size stands.
        """
        if free_bytes is None or not self.bytes_per_token or tokens_per_row <= 0:
            return max_rows
        fit = int(self.headroom * free_bytes / (self.bytes_per_token * tokens_per_row))
        return max(1, min(max_rows, fit))

    def observe(self, peak_bytes: int, tokens: int) -> None:
        """Record a micro-batch's peak extra memory; keep the worst case per token."""
        if tokens > 0 and peak_bytes > 0:
            self.bytes_per_token = max(self.bytes_per_token or 0.0, peak_bytes / tokens)

    @staticmethod
    def backoff(rows: int) -> int:
        """The next size after an out-of-memory error at `rows`."""
        if rows <= 1:
            raise OutOfMemoryAtOneRow("out of memory with a micro-batch of one row: the model, its optimizer "
                                      "state and one sequence do not fit this device; shorten max_new_tokens "
                                      "or prompts, use fsdp over more GPUs, or a smaller model")
        return rows // 2
