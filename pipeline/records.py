"""The records that travel between roles as Dask futures.

They hold CPU tensors of token ids, masks and per-token floats: kilobytes to a few
megabytes per step. Models and weights never travel in them (see weights.py).
Shapes: B = samples in the record, P = padded prompt length, R = padded response length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class GenerationRequest:
    """One rollout worker's share of a step's prompts."""

    prompt_ids: list[list[int]]      # unpadded prompt token ids, one list per prompt
    group_ids: list[int]             # a global id per prompt: its samples form one GRPO group
    samples_per_prompt: int          # n: each prompt is sampled n times
    max_new_tokens: int
    temperature: float
    seed: int                        # sampling seed for this shard (reproducible runs)


@dataclass
class Rollout:
    """Generated samples: prompt left-padded to P, response right-padded to R.

    Row i of `input_ids` is [pad.. prompt | response ..pad]; columns >= P are the response.
    """

    input_ids: torch.Tensor          # (B, P+R) int64
    attention_mask: torch.Tensor     # (B, P+R) int64: 1 on prompt and response tokens
    response_mask: torch.Tensor      # (B, R) float32: 1 on generated tokens up to and including EOS
    behavior_logprobs: torch.Tensor  # (B, R) float32: log pi_behavior(token) of the policy that sampled it
    group_ids: torch.Tensor          # (B,) int64: prompt id; GRPO normalises rewards within a group
    policy_version: int              # version of the weights that generated every row
    prompt_length: int               # P

    @property
    def responses(self) -> torch.Tensor:
        """(B, R) the generated token ids."""
        return self.input_ids[:, self.prompt_length:]

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class Experience:
    """What a policy update consumes: a rollout plus everything scored and estimated on it."""

    input_ids: torch.Tensor          # (B, P+R) int64
    attention_mask: torch.Tensor     # (B, P+R) int64
    response_mask: torch.Tensor      # (B, R) float32
    behavior_logprobs: torch.Tensor  # (B, R) log pi_behavior, from the rollout worker
    ref_logprobs: torch.Tensor       # (B, R) log pi_ref, for the KL term
    advantages: torch.Tensor         # (B, R) A_t (GAE for PPO, group-normalised reward for GRPO)
    returns: torch.Tensor            # (B, R) critic targets R_t = A_t + V_t (zeros for GRPO)
    old_values: torch.Tensor         # (B, R) V_t at rollout time (zeros for GRPO)
    policy_version: torch.Tensor     # (B,) int64: version that generated each row
    prompt_length: int               # P

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> Experience:
        """The rows `rows` (a 1-D index tensor or a slice) of every per-sample field."""
        picked = {f.name: getattr(self, f.name)[rows] for f in fields(self) if f.name != "prompt_length"}
        return replace(self, **picked)


def concat_rollouts(parts: list[Rollout]) -> Rollout:
    """Join shards from several rollout workers, re-padding to the widest prompt/response."""
    prompt_length = max(p.prompt_length for p in parts)
    response_length = max(p.response_mask.shape[1] for p in parts)
    padded = [_pad_rollout(p, prompt_length, response_length) for p in parts]
    versions = {p.policy_version for p in parts}
    if len(versions) != 1:
        raise ValueError(f"rollout shards come from different policy versions {sorted(versions)}")
    return Rollout(
        input_ids=torch.cat([p.input_ids for p in padded]),
        attention_mask=torch.cat([p.attention_mask for p in padded]),
        response_mask=torch.cat([p.response_mask for p in padded]),
        behavior_logprobs=torch.cat([p.behavior_logprobs for p in padded]),
        group_ids=torch.cat([p.group_ids for p in padded]),
        policy_version=parts[0].policy_version,
        prompt_length=prompt_length,
    )


def _pad_rollout(rollout: Rollout, prompt_length: int, response_length: int) -> Rollout:
    """Left-pad the prompt part and right-pad the response part with zeros (pad, masked out)."""
    left = prompt_length - rollout.prompt_length
    right = response_length - rollout.response_mask.shape[1]
    if left == 0 and right == 0:
        return rollout
    pad_ids = lambda t: torch.nn.functional.pad(t, (left, right))  # noqa: E731 - two uses below
    pad_resp = lambda t: torch.nn.functional.pad(t, (0, right))  # noqa: E731
    return Rollout(
        input_ids=pad_ids(rollout.input_ids), attention_mask=pad_ids(rollout.attention_mask),
        response_mask=pad_resp(rollout.response_mask),
        behavior_logprobs=pad_resp(rollout.behavior_logprobs), group_ids=rollout.group_ids,
        policy_version=rollout.policy_version, prompt_length=prompt_length,
    )


def rank_shards(num_rows: int, world_size: int, mini_batches: int) -> list[list[torch.Tensor]]:
    """Split rows 0..num_rows-1 into per-rank lists of mini-batch row indices.

    Global mini-batch j is a contiguous block of rows; rank r trains on the r-th slice of
    every block. So the union over ranks of mini-batch j is the same set of rows whatever
    the world size, and an update on 2 ranks equals the update on 1 (gradients summed).
    """
    blocks = torch.arange(num_rows).tensor_split(mini_batches)
    return [[block.tensor_split(world_size)[rank] for block in blocks] for rank in range(world_size)]
