"""train.share_prompts: rows with the same prompt packed as one sequence (the prompt once,
then each response), by hand; the keys each response sees, in the block mask's terms and in
the attention tiles'; logprobs, entropy and gradients equal to the padded rows' on a real tiny
model (the actor loss's gradients are checked in test_packing.py too); the token counts a
budget reads; and where the actor turns it on."""

from __future__ import annotations

import types

import pytest
import torch

from pipeline.config import TrainConfig, TrainConfigError, make_train_config
from pipeline.models import load_causal_lm
from pipeline.packing import SHARED_PROMPTS, computed_tokens, pack_shared_prompts, prompt_units
from pipeline.roles.forward import choose_packing, response_logprobs_and_entropy
from pipeline.roles.shared_attention import SHARED_PROMPT_ATTENTION, PromptsThenResponses

PROMPT, RESPONSE = 4, 3


def _hand_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 0 and 2 share prompt [5, 6] (left-padded), row 1 has prompt [4, 5, 6, 7]."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0],
                        [4, 5, 6, 7, 3, 0, 0],
                        [0, 0, 5, 6, 9, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1, 0, 0],
                         [0, 0, 1, 1, 1, 0, 0]])
    return ids, mask


def test_shared_prompt_layout_by_hand():
    ids, mask = _hand_rows()
    assert prompt_units(ids, mask[:, :PROMPT].bool()).tolist() == [0, 1, 0]
    shared = pack_shared_prompts(ids, mask, PROMPT)
    # Units: [5, 6 | 7, 8 | 9] and [4, 5, 6, 7 | 3], 5 tokens each: one packed row of 16.
    assert shared.plan.lengths == (5, 5) and shared.plan.bins == ((0, 1),) and shared.plan.width == 16
    assert shared.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 5, 6, 7, 3] + [0] * 6]
    # A response continues its prompt's positions; the filler counts from 0, below the longest row (5).
    assert shared.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]]
    assert shared.part.tolist() == [[0, 0, 1, 1, 2, 0, 0, 0, 0, 1] + [0] * 6]
    assert shared.unit.tolist() == [[0] * 5 + [1] * 5 + [2] * 6]   # the filler: a unit of its own
    # Row 0's tokens 7, 8 are predicted from positions 1 (the prompt's last) and 2; row 1's 3
    # from 8; row 2's 9 from position 1 too: the shared prompt's last token.
    assert shared.predictors.tolist() == [1, 2, 8, 1]
    assert shared.outputs.tolist() == [0, 1, 3, 6]     # (row, column) -> row * 3 + column


def test_each_response_sees_its_prompt_and_itself():
    shared = pack_shared_prompts(*_hand_rows(), PROMPT)
    index = torch.arange(shared.input_ids.shape[1])
    seen = shared.visible(0, None, index[:, None], index[None, :])
    assert seen[:5, :5].int().tolist() == [[1, 0, 0, 0, 0],    # prompt 5
                                           [1, 1, 0, 0, 0],    # prompt 6
                                           [1, 1, 1, 0, 0],    # 7 (row 0)
                                           [1, 1, 1, 1, 0],    # 8 (row 0)
                                           [1, 1, 0, 0, 1]]    # 9 (row 2): the prompt and itself, not row 0
    assert not seen[5:, :5].any() and not seen[10:, :10].any()   # no unit sees another, nor the filler
    assert (seen[5:10, 5:10] == torch.ones(5, 5, dtype=torch.bool).tril()).all()   # the second: causal


def test_budget_counts_a_shared_prompt_once():
    ids, mask = _hand_rows()
    batch = types.SimpleNamespace(input_ids=ids, attention_mask=mask, prompt_length=PROMPT)
    assert computed_tokens(batch, True) == [4, 5, 3]
    assert computed_tokens(batch, SHARED_PROMPTS) == [4, 5, 1]   # row 2's prompt is row 0's
    assert computed_tokens(batch, False) == [7, 7, 7]


def _group_rows(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three groups (prompts of 6, 3 and 1 tokens, left-padded to 6) of 3, 2 and 3 samples,
    responses of 0-9 tokens, rows shuffled: a group's rows are not consecutive."""
    generator = torch.Generator().manual_seed(seed)
    prompt_width, response_width = 6, 9
    groups = [(6, (9, 2, 5)), (3, (0, 7)), (1, (4, 9, 1))]
    rows, masks = [], []
    for prompt_len, responses in groups:
        prompt = torch.randint(2, vocab, (prompt_len,), generator=generator)
        for response_len in responses:
            row = torch.zeros(prompt_width + response_width, dtype=torch.long)
            row_mask = torch.zeros_like(row)
            row[prompt_width - prompt_len:prompt_width], row_mask[prompt_width - prompt_len:prompt_width] = prompt, 1
            row[prompt_width:prompt_width + response_len] = torch.randint(2, vocab, (response_len,),
                                                                          generator=generator)
            row_mask[prompt_width:prompt_width + response_len] = 1
            rows.append(row)
            masks.append(row_mask)
    order = torch.randperm(len(rows), generator=generator)
    return torch.stack(rows)[order], torch.stack(masks)[order]


def test_attention_tiles_by_hand(monkeypatch):
    """The hand rows' units as tiles: prompts [5, 6] (flat 0-1) and [4, 5, 6, 7] (5-8);
    responses [7, 8] (2-3), [3] (9) and [9] (4), in tiles by length."""
    from pipeline.roles import shared_attention

    shared = pack_shared_prompts(*_hand_rows(), PROMPT)
    tiles = PromptsThenResponses.of(shared)
    prompts = tiles.prompts
    assert prompts.gather.tolist() == [[0, 1, 0, 0], [5, 6, 7, 8]]           # past a prompt's end: its start
    assert tiles.prompt_mask()[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert tiles.prompt_mask()[1, 0].int().tolist() == torch.ones(4, 4).tril().int().tolist()
    # Three rows cut three ways, the shortest responses first: row 1's [3] and row 2's [9],
    # as wide as each other, share a tile; row 0's [7, 8] has its own.
    assert [tile.gather.tolist() for tile in tiles.responses] == [[[9], [4]], [[2, 3]]]
    assert [tile.unit.tolist() for tile in tiles.responses] == [[1, 0], [0]]
    # Row 1's response sees its prompt's four keys and itself, row 2's its prompt's two and
    # itself; row 0's its prompt's two, then itself causally.
    assert tiles.response_mask(tiles.responses[0])[:, 0].int().tolist() == [[[1, 1, 1, 1, 1]], [[1, 1, 0, 0, 1]]]
    assert tiles.response_mask(tiles.responses[1])[0, 0].int().tolist() == [[1, 1, 0, 0, 1, 0],
                                                                             [1, 1, 0, 0, 1, 1]]
    assert tiles.place.tolist() == [0, 1, 5, 6, 7, 8, 9, 4, 2, 3]
    # Responses of one length make one tile whatever RESPONSE_TILES says.
    equal_ids, equal_mask = _hand_rows()
    equal_mask[0, 5] = 0   # row 0 keeps one response token, as rows 1 and 2 have
    assert len(PromptsThenResponses.of(pack_shared_prompts(equal_ids, equal_mask, PROMPT)).responses) == 1
    # One tile: as wide as the longest response; a row's padding repeats its first token.
    monkeypatch.setattr(shared_attention, "RESPONSE_TILES", 1)
    [tile] = PromptsThenResponses.of(shared).responses
    assert tile.gather.tolist() == [[9, 9], [4, 4], [2, 3]] and tile.pick.tolist() == [0, 2, 4, 5]


def test_shared_prompt_logprobs_entropy_and_gradients_equal_padded(policy):
    """Shared prompts in the attention tiles against the padded rows computed with eager
    attention (another implementation): values and every parameter's gradient."""
    import copy

    shared_model = copy.deepcopy(policy)
    assert choose_packing(shared_model, True, True) == SHARED_PROMPTS
    assert shared_model.config._attn_implementation == SHARED_PROMPT_ATTENTION
    policy.set_attn_implementation("eager")
    ids, mask = _group_rows(policy.config.vocab_size)
    response = mask[:, 6:].bool()
    padded = response_logprobs_and_entropy(policy, ids, mask, 6, 0.7, entropy_grad=True)
    shared = response_logprobs_and_entropy(shared_model, ids, mask, 6, 0.7, entropy_grad=True, pack=SHARED_PROMPTS)
    assert pack_shared_prompts(ids, mask, 6).plan.real_tokens == int(mask.sum()) - 2 * 6 - 1 * 3 - 2 * 1
    for name, want, got in zip(("logprobs", "entropy"), padded, shared):
        torch.testing.assert_close(got[response], want[response], rtol=0, atol=1e-5, msg=name)
        assert (got[~response] == 0).all(), name
    (padded[0][response].sum() + padded[1][response].sum()).backward()
    (shared[0][response].sum() + shared[1][response].sum()).backward()
    for (name, want), got in zip(policy.named_parameters(), shared_model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_model_with_shared_prompt_attention_still_runs_padded_rows(tiny_model):
    """Other masks reach transformers' SDPA attention unchanged: the same logprobs as before."""
    from pipeline.roles.forward import response_logprobs

    model = load_causal_lm(tiny_model).eval()
    ids, mask = _group_rows(model.config.vocab_size)
    response = mask[:, 6:].bool()
    before = response_logprobs(model, ids, mask, 6, 1.0)[response]
    assert choose_packing(model, True, True) == SHARED_PROMPTS
    torch.testing.assert_close(response_logprobs(model, ids, mask, 6, 1.0)[response], before, rtol=0, atol=1e-6)
    torch.testing.assert_close(response_logprobs(model, ids, mask, 6, 1.0, pack=True)[response], before,
                               rtol=0, atol=1e-5)


def test_shared_prompts_apply_with_packing(tiny_model):
    model = load_causal_lm(tiny_model)
    attention = model.config._attn_implementation
    assert choose_packing(model, False, True) is False    # nothing packed: nothing shared
    assert choose_packing(model, True, False) is True     # turned off
    assert model.config._attn_implementation == attention
    assert choose_packing(model, True, True) == SHARED_PROMPTS
    assert model.config._attn_implementation == SHARED_PROMPT_ATTENTION  # what the tiles need


def test_an_architecture_with_sliding_windows_packs_rows_and_says_why(caplog):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64, use_sliding_window=True, sliding_window=8,
                         max_window_layers=1)
    model = Qwen2ForCausalLM(config)
    attention = model.config._attn_implementation
    with caplog.at_level("WARNING", logger="dask_rl"):
        assert choose_packing(model, True, True) is True
        assert choose_packing(model, True, True) is True     # asked again: no second warning
    assert model.config._attn_implementation == attention   # left as it was
    [warning] = [r.getMessage() for r in caplog.records]
    assert "train.share_prompts cannot run on Qwen2ForCausalLM" in warning and "sliding_attention" in warning


def _tiny(architecture: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if architecture == "gpt2":   # learned positions, a fused query/key/value projection
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                          bos_token_id=0, eos_token_id=0)).eval()
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64)).eval()


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_other_architectures_share_prompts_as_well(architecture):
    """The tiles reach the attention through transformers' keyword arguments, whatever the
    architecture builds its masks from: GPT-2 and Llama give the padded rows' logprobs."""
    from pipeline.roles.forward import response_logprobs

    model = _tiny(architecture)
    ids, mask = _group_rows(model.config.vocab_size)
    response = mask[:, 6:].bool()
    padded = response_logprobs(model, ids, mask, 6, 1.0)[response]
    assert choose_packing(model, True, True) == SHARED_PROMPTS
    shared = response_logprobs(model, ids, mask, 6, 1.0, pack=SHARED_PROMPTS)[response]
    torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5)


def test_the_reference_shares_prompts_too(tiny_model):
    """train.share_prompts reaches the reference role: its logprobs with each group's prompt
    computed once equal those of whole rows."""
    from pipeline.records import Rollout
    from pipeline.roles.reference import ReferenceRole

    whole = ReferenceRole(tiny_model, device="cpu", micro_batch_size=4)
    shared = ReferenceRole(tiny_model, device="cpu", micro_batch_size=4, share_prompts=True)
    assert (whole.packing, shared.packing) == (True, SHARED_PROMPTS)
    ids, mask = _group_rows(whole.model.config.vocab_size)
    response = mask[:, 6:].float()
    rollout = Rollout(ids, mask, response, torch.zeros_like(response), torch.zeros(len(ids), dtype=torch.long), 0, 6)
    torch.testing.assert_close(shared.logprobs(rollout, 0.7), whole.logprobs(rollout, 0.7), rtol=0, atol=1e-5)


def test_the_tiles_placeholder_mask_is_never_attended_as_a_mask():
    """A model that would not hand the tiles down to its attention meets the placeholder mask
    alone: an error naming the cause, never an attention over every pair."""
    from pipeline.roles.shared_attention import attention, tiles_inputs

    model = _tiny("llama")
    placeholder = tiles_inputs(None)["attention_mask"]
    query = torch.randn(1, 4, 3, 8)
    with pytest.raises(RuntimeError, match="not handed the shared-prompt tiles"):
        attention(model.model.layers[0].self_attn, query, query[:, :2], query[:, :2], placeholder)


def test_share_prompts_config():
    assert TrainConfig().share_prompts is False
    assert make_train_config({"share_prompts": True}).share_prompts is True
    with pytest.raises(TrainConfigError, match="share_prompts"):
        make_train_config({"share_prompts": "yes"})


def test_grpo_with_shared_prompts_trains_as_without(shared_cluster, shared_config, tiny_model, prompts):
    """End to end on the CPU cluster: on-policy GRPO (groups of 4 samples a prompt, a KL
    penalty from the reference) with train.share_prompts gives the same rewards, tokens, KL
    and losses, step for step, as the same run packing whole rows: the same sums, in another
    order of additions."""
    from pipeline.fleet.tasks import submit
    from pipeline.rewards import digit_fraction
    from pipeline.trainer import HybridTrainer

    runs, attention = [], []
    for share in (False, True):
        with HybridTrainer(tiny_model, digit_fraction, shared_config, algorithm="grpo", prompts=prompts,
                           cluster=shared_cluster, steps=2, samples_per_prompt=4, prompts_per_step=4,
                           max_new_tokens=8, actor_lr=1e-3, kl_coef=0.05, share_prompts=share,
                           show_progress=False) as trainer:
            runs.append(trainer.train())
            attention.append([submit(shared_cluster.client, role, _attention, role).result()
                              for role in ("actor", "reference")])
    assert attention == [["sdpa"] * 2, [SHARED_PROMPT_ATTENTION] * 2]   # the second run did share its prompts
    plain, shared = runs
    assert [(r.reward_mean, r.tokens) for r in shared] == [(r.reward_mean, r.tokens) for r in plain]
    for a, b in zip(plain, shared):
        assert b.kl_mean == pytest.approx(a.kl_mean, rel=1e-4, abs=1e-6)
        for key in ("policy_loss", "grad_norm", "entropy"):
            assert b.losses[key] == pytest.approx(a.losses[key], rel=1e-4, abs=1e-6), (a.step, key)


def _attention(role: str) -> str:
    from pipeline.roles.host import role_state

    state = role_state(role)
    return (state.trainer.model if role == "actor" else state.model).config._attn_implementation
