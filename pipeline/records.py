"""The records that travel between roles as Dask futures.

They hold CPU tensors of token ids, masks and per-token floats: kilobytes to a few
megabytes per step. Models and weights never travel in them (see weights.py).
Shapes: B = samples in the record, P = padded prompt length, R = padded response length.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace

import torch


def on_device(value, device):
    """`value` (a tensor, or a dict, tuple or dataclass of such values, or anything else,
    returned as it is) on `device`. From the CPU to a GPU through pinned memory and without
    blocking: a copy from pageable memory would wait for all the GPU's queued work first."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and torch.device(device).type == "cuda":
            return value.pin_memory().to(device, non_blocking=True)
        return value.to(device)
    if isinstance(value, dict):
        return {key: on_device(item, device) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(on_device(item, device) for item in value)
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: on_device(getattr(value, f.name), device) for f in fields(value)})
    return value


@dataclass(frozen=True)
class CarriedRow:
    """A sample a partial rollout left unfinished (train.partial_rollouts), or a finished
    sibling of one (its group is trained whole): the next request continues it where it
    stopped, with the newer weights, and keeps the tokens it has."""

    prompt_ids: list[int]            # the prompt, unpadded
    response_ids: list[int]          # the tokens generated so far (none: it never started)
    logprobs: list[float]            # their behaviour logprobs, from the versions that sampled them
    group_id: int
    born: int | None                 # the policy version of its first token (None: no token yet)
    ended: bool = False              # it reached its end already; only its group is unfinished


@dataclass
class GenerationRequest:
    """One rollout worker's share of a step's prompts."""

    prompt_ids: list[list[int]]      # unpadded prompt token ids, one list per prompt
    group_ids: list[int]             # a global id per prompt: its samples form one GRPO group
    samples_per_prompt: int          # n: each prompt is sampled n times
    max_new_tokens: int
    temperature: float
    seed: int                        # sampling seed for this shard (reproducible runs)
    # A response ends at the engine's EOS id, at any of these ids (an instruct model's ends
    # of turn) or once its text contains any of these strings. Both end rows the same way in
    # every engine (engines/hf.py: response_mask_until_stop).
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    # Sampling filters on the temperature-scaled distribution (0 / 1.0 / 0.0: off). They only
    # choose which tokens can be sampled: behaviour logprobs stay the unfiltered ones.
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # Partial rollouts (train.partial_rollouts, the cuda_graph engine): rows carried from the
    # request before go first. The engine may end the request once `complete_groups` groups
    # have every sample finished (0: every sample runs to its end) and no carried row that
    # started before version `finish_born_before` is left; what is unfinished then is carried.
    carried: tuple[CarriedRow, ...] = ()
    complete_groups: int = 0
    finish_born_before: int = 0
    # True (train.partial_keep_kv, the cuda_graph engine): the rows this request leaves live
    # in its slots stay there, and a carried row the last such request left there decodes on
    # from its keys and values instead of being prefilled again.
    keep_kv: bool = False

    @property
    def partial(self) -> bool:
        return bool(self.carried) or self.complete_groups > 0


@dataclass
class Rollout:
    """Generated samples: prompt left-padded to P, response right-padded to R.

    Row i of `input_ids` is [pad.. prompt | response ..pad]; columns >= P are the response.
    """

    input_ids: torch.Tensor          # (B, P+R) int64
    attention_mask: torch.Tensor     # (B, P+R) int64: 1 on prompt and response tokens
    response_mask: torch.Tensor      # (B, R) float32: 1 on generated tokens up to and including the stop
    behavior_logprobs: torch.Tensor  # (B, R) float32: log pi_behavior(token) of the policy that sampled it
    group_ids: torch.Tensor          # (B,) int64: prompt id; GRPO normalises rewards within a group
    policy_version: int              # version of the weights that generated every row
    prompt_length: int               # P
    # (B,) bool: the response reached max_new_tokens without any stop. Engines always set it;
    # a record built by hand without it says no row was clipped.
    clipped: torch.Tensor | None = None
    # Partial rollouts: (B,) bool, the rows the request ended before they did (carried to the
    # next one); (B,) int64, the policy version of each row's first token (-1: none yet).
    # Without partial rollouts no row is unfinished and every row is of policy_version.
    unfinished: torch.Tensor | None = None
    born: torch.Tensor | None = None

    def __post_init__(self):
        rows = self.input_ids.shape[0]
        if self.clipped is None:
            self.clipped = torch.zeros(rows, dtype=torch.bool)
        if self.unfinished is None:
            self.unfinished = torch.zeros(rows, dtype=torch.bool)
        if self.born is None:
            self.born = torch.full((rows,), self.policy_version, dtype=torch.long)

    @property
    def responses(self) -> torch.Tensor:
        """(B, R) the generated token ids."""
        return self.input_ids[:, self.prompt_length:]

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def token_ids(self, row: int) -> tuple[list[int], list[int]]:
        """Row `row`'s prompt and response token ids, padding left out."""
        prompt = self.input_ids[row, :self.prompt_length][self.attention_mask[row, :self.prompt_length].bool()]
        return prompt.tolist(), self.responses[row][self.response_mask[row].bool()].tolist()

    def all_token_ids(self) -> tuple[list[list[int]], list[list[int]]]:
        """token_ids of every row: (prompts, responses), in one pass over the batch."""
        return (_real_tokens(self.input_ids[:, :self.prompt_length], self.attention_mask[:, :self.prompt_length]),
                _real_tokens(self.responses, self.response_mask))

    def select(self, rows: torch.Tensor) -> Rollout:
        """The rows `rows` (a 1-D index tensor) of every per-sample field."""
        return replace(self, **_rows_of(self, rows))


def _real_tokens(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's ids where `mask` is set, as lists (one boolean select, one tolist)."""
    keep = mask.bool()
    flat = ids[keep].tolist()
    out, start = [], 0
    for count in keep.sum(-1).tolist():
        out.append(flat[start:start + count])
        start += count
    return out


SHOWN_TEXT = 200  # characters of a prompt or response that a message about a sample shows


@dataclass(frozen=True)
class SampleProblem:
    """Why one sample cannot be trained on: what a role found wrong with it."""

    row: int                         # the sample's row in its record
    role: str                        # the role that found it: "reward", "reference", "critic", "advantages"
    error: str                       # the original exception ("ZeroDivisionError: ...") or the bad value
    prompt: str = ""                 # the decoded texts, cut short (empty where the role has none)
    response: str = ""


@dataclass
class RewardInputs:
    """What the reward functions see of one shard's prompts besides the texts, by group id."""

    prompts: dict[int, str | list]   # the row's prompt as given: text, or a list of chat messages
    fields: dict[int, dict]          # the row's other fields (answer, solution, ...)


@dataclass
class Scores:
    """One reward shard's output: a score per row, NaN on the rows listed in `problems`."""

    values: torch.Tensor             # (B,) float32: the weighted sum of the rewards
    problems: list[SampleProblem]
    # Each reward's own value by name, (B,) float32, NaN where it returned None or failed.
    components: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.values.shape[0]

    def select(self, rows: torch.Tensor) -> Scores:
        """The rows `rows` (problems are dropped: selecting happens after screening)."""
        return Scores(self.values[rows], [], {name: values[rows] for name, values in self.components.items()})


def join_scores(shards: list[Scores]) -> Scores:
    """The shards' scores in shard order (the order join_shards puts the rows in)."""
    problems, offset = [], 0
    for shard in shards:
        problems += [replace(p, row=p.row + offset) for p in shard.problems]
        offset += len(shard)
    names = list(shards[0].components) if shards else []
    return Scores(torch.cat([s.values for s in shards]), problems,
                  {name: torch.cat([s.components[name] for s in shards]) for name in names})


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
    prompt_length: int               # P

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> Experience:
        """The rows `rows` (a 1-D index tensor or a slice) of every per-sample field."""
        return replace(self, **_rows_of(self, rows))


def _rows_of(record, rows) -> dict[str, torch.Tensor]:
    return {f.name: getattr(record, f.name)[rows] for f in fields(record)
            if isinstance(getattr(record, f.name), torch.Tensor)}


def join_shards(rollouts: list[Rollout], **per_token: list[torch.Tensor]) -> tuple[Rollout, dict[str, torch.Tensor]]:
    """One step's shards from several rollout workers as one record, padded once: prompts
    left-padded to the widest P, responses and every (B_shard, R_shard) tensor in
    `per_token` (reference logprobs, critic values, shard by shard) right-padded to the
    widest R with zeros (masked out by the response mask)."""
    prompt_length = max(p.prompt_length for p in rollouts)
    response_length = max(p.response_mask.shape[1] for p in rollouts)
    versions = {p.policy_version for p in rollouts}
    if len(versions) != 1:
        raise ValueError(f"rollout shards come from different policy versions {sorted(versions)}")

    def cat(tensors: list[torch.Tensor], with_prompt: bool = False) -> torch.Tensor:
        padded = []
        for t, shard in zip(tensors, rollouts):
            prompt = shard.prompt_length if with_prompt else 0   # (B, P+R) or (B, R) columns
            left = prompt_length - shard.prompt_length if with_prompt else 0
            padded.append(torch.nn.functional.pad(t, (left, response_length - (t.shape[1] - prompt))))
        return torch.cat(padded)

    rollout = Rollout(
        input_ids=cat([p.input_ids for p in rollouts], with_prompt=True),
        attention_mask=cat([p.attention_mask for p in rollouts], with_prompt=True),
        response_mask=cat([p.response_mask for p in rollouts]),
        behavior_logprobs=cat([p.behavior_logprobs for p in rollouts]),
        group_ids=torch.cat([p.group_ids for p in rollouts]),
        policy_version=rollouts[0].policy_version,
        prompt_length=prompt_length,
        clipped=torch.cat([p.clipped for p in rollouts]),
        unfinished=torch.cat([p.unfinished for p in rollouts]),
        born=torch.cat([p.born for p in rollouts]),
    )
    return rollout, {name: cat(parts) for name, parts in per_token.items() if parts}


def rank_shards(num_rows: int, world_size: int, mini_batches: int, role: str = "trainable"
                ) -> list[list[torch.Tensor]]:
    """Split rows 0..num_rows-1 into per-rank lists of mini-batch row indices.

    Global mini-batch j is a contiguous block of rows; rank r trains on the r-th slice of
    every block. So the union over ranks of mini-batch j is the same set of rows whatever
    the world size, and an update on 2 ranks equals the update on 1 (gradients summed).
    Slices differ by at most one row; a rank with none would have nothing to train on (and
    under FSDP nothing to run its share of the collectives with): refused.
    """
    blocks = torch.arange(num_rows).tensor_split(mini_batches)
    if len(blocks[-1]) < world_size:   # tensor_split puts the shorter blocks last
        raise ValueError(f"{role}: mini-batch {len(blocks) - 1} has {len(blocks[-1])} rows for {world_size} ranks; "
                         f"every rank needs at least one row of each mini-batch. Fix: raise train.prompts_per_step "
                         f"or train.samples_per_prompt, lower train.mini_batches, or give the {role} role fewer workers")
    return [[block.tensor_split(world_size)[rank] for block in blocks] for rank in range(world_size)]


def even_chunks(num_rows: int, count: int) -> list[slice]:
    """`count` consecutive row slices whose sizes differ by at most one (the first are the
    longer ones), covering rows 0..num_rows-1 in order."""
    base, longer = divmod(num_rows, count)
    stops = [(i + 1) * base + min(i + 1, longer) for i in range(count)]
    return [slice(start, stop) for start, stop in zip([0, *stops[:-1]], stops)]
