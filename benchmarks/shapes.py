"""The model shape the GPU benchmarks use: Qwen2-0.5B's config with random weights (no hub),
saved with a word-level tokenizer that covers its whole 151 936-token vocabulary, so a
random policy's samples decode to text ("w123 w77 ...") and prompts of N words are N tokens."""

from __future__ import annotations

import os
from pathlib import Path

VOCAB = 151936


def qwen2_05b_config(layers: int = 24):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                       bos_token_id=1)


def word_tokenizer():
    """<pad>=0, <eos>=1, then one token per word "w2" .. "w151935", split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def save_qwen2_05b(directory: str | os.PathLike, *, seed: int = 0, layers: int = 24) -> Path:
    """Write the random bf16 model and its tokenizer to `directory`. Built on the CPU: a
    benchmark's driver process must not hold a CUDA context of its own."""
    import torch
    from transformers import Qwen2ForCausalLM

    path = Path(directory)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(qwen2_05b_config(layers)).to(torch.bfloat16)
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def word_prompts(count: int, words: int, seed: int = 0) -> list[str]:
    """`count` prompts of exactly `words` tokens each."""
    import random

    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(2, VOCAB)}" for _ in range(words)) for _ in range(count)]


def end_with_probability(model, eos_id: int, probability):
    """Make `model` end a response with `probability` at every token, whatever it would have
    said: its EOS logit becomes the log-sum-exp of the other logits plus logit(probability),
    so response lengths are geometric (mean ~1/probability, cut at max_new_tokens), the
    long-tailed shape of reasoning tasks. A forward hook on the output embedding (returns
    the hook's handle); generation and training forwards see the same distribution.

    `probability`: a float, or a 0-d tensor on the model's device whose value may change
    between calls (0: never end). torch.compile does not re-trace a hook added after it
    compiled, so a compiled caller that changes the probability hooks a tensor once, first."""
    import math

    import torch

    def shift():
        if isinstance(probability, torch.Tensor):
            return torch.log(probability) - torch.log1p(-probability)
        return math.log(probability / (1 - probability))

    def hook(module, args, logits):
        eos = torch.arange(logits.shape[-1], device=logits.device) == eos_id   # (setting one item would sync)
        # exp(target) / (sum of the others' exp + exp(target)) = probability, exactly.
        target = logits.float().masked_fill(eos, float("-inf")).logsumexp(-1, keepdim=True).detach() + shift()
        return torch.where(eos, target.to(logits.dtype), logits)

    return model.get_output_embeddings().register_forward_hook(hook)


def add_engine_options(parser) -> None:
    """--decode-attention and --unfused: the cuda_graph engine's options, for A/B runs."""
    parser.add_argument("--decode-attention", choices=["sdpa", "kernel"], default="kernel",
                        help="the cuda_graph engine's decode attention: the Triton kernel "
                             "(pipeline/engines/decode_kernel.py, the default) or SDPA")
    parser.add_argument("--unfused", action="store_true",
                        help="the cuda_graph engine's projections unfused (fuse_projections: false)")


def engine_options(args) -> dict:
    """The cuda_graph engine's keyword arguments (rollout.cuda_graph_args) from add_engine_options' flags."""
    return {"decode_attention": args.decode_attention, "fuse_projections": not args.unfused}


def decode_seconds(steps_at: dict[int, int], step_ms: dict[int, float], floor: int = 0) -> float:
    """Seconds of a request's decode steps: steps_at[s] steps at s slots, each taking
    step_ms[s] milliseconds (the cuda_graph engine's last_stats). With `floor`, the steps at
    fewer slots are timed at the floor's step: the tail had stopped shrinking there."""
    return sum(steps * step_ms[max(slots, floor)] for slots, steps in steps_at.items()) / 1000


def mean_geometric_length(probability: float, cap: int) -> float:
    """Expected response length when each token ends it with `probability`, cut at `cap`."""
    return (1 - (1 - probability) ** cap) / probability


def geometric_lengths(count: int, mean: float, cap: int, seed: int = 0) -> list[int]:
    """`count` response lengths >= 1 of mean about `mean`, cut at `cap`: a sampled response
    that stops with probability 1 / mean after every token (long-tailed, as RL rollouts are)."""
    import torch

    uniform = torch.rand(count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    draws = torch.ceil(torch.log1p(-uniform) / torch.log1p(torch.tensor(-1.0 / mean, dtype=torch.float64)))
    return [int(min(cap, max(1, n))) for n in draws.tolist()]


def padded_rows(prompt_lengths: list[int], response_lengths: list[int], vocab: int, *, prompt_width: int,
                response_width: int, seed: int = 0):
    """(ids, mask), each (B, prompt_width + response_width), laid out as a rollout is: prompts
    of the given real lengths left-padded, responses right-padded, pad id 0, random tokens."""
    import torch

    ids = torch.randint(2, vocab, (len(prompt_lengths), prompt_width + response_width),
                        generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros_like(ids)
    for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths)):
        mask[row, prompt_width - prompt:prompt_width + response] = 1
    return ids * mask, mask


def share_prompts(ids, mask, prompt_width: int, samples: int):
    """(ids, mask) of padded_rows with every `samples` consecutive rows given their first
    row's prompt (tokens and padding), as a GRPO group's samples share one."""
    import torch

    first = torch.arange(ids.shape[0], device=ids.device) // samples * samples
    ids, mask = ids.clone(), mask.clone()
    ids[:, :prompt_width], mask[:, :prompt_width] = ids[first, :prompt_width], mask[first, :prompt_width]
    return ids, mask


def partial_requests(engine, draw_prompts, groups: int, samples: int, new: int, max_staleness: int,
                     request_groups: int, count: int, keep_kv: bool = False, ahead: int = 0, draw_count=None):
    """`count` consecutive requests as train.partial_rollouts makes them: each holds the rows
    the one before carried, then new groups (`draw_prompts(version, draws)`: a prompt for each
    draw number), and ends once `groups` groups are complete (`keep_kv`: as with
    train.partial_keep_kv, rows still in a slot go on there; `ahead`: batches generated ahead
    of the update, partial.batches_ahead; `draw_count(groups, carried, request_groups)`: how
    many groups a request draws, partial.new_groups unless given). Yields (version, rollout,
    the rows it carries, its seconds, the split into trained and carried rows included)."""
    import time

    import torch

    from pipeline.partial import carried_part, finish_born_before, new_groups
    from pipeline.records import GenerationRequest

    cuda = torch.device(engine.device).type == "cuda"
    carried, drawn = (), 0
    for version in range(count):
        draws = range(drawn, drawn + (draw_count or new_groups)(groups, carried, request_groups))
        drawn = draws.stop
        request = GenerationRequest(draw_prompts(version, draws), list(draws), samples, new, 1.0, version,
                                    carried=carried, complete_groups=groups,
                                    finish_born_before=finish_born_before(version, max_staleness, ahead),
                                    keep_kv=keep_kv)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        rollout = engine.generate(request, version)
        if cuda:
            torch.cuda.synchronize()
        carried = carried_part(rollout, groups, request.finish_born_before)
        yield version, rollout, carried, time.perf_counter() - start
