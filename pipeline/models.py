"""Model and tokenizer loading, the critic's value head, the position ids every forward
pass over a rollout uses, and the tiny local models used by the quickstart and the tests
(no hub is needed for either)."""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import torch
from torch import nn

# The quickstart's character tokenizer: every character is one token, so a person can read
# what the policy writes and a reward on characters is easy to check by eye.
TINY_CHARS = string.ascii_lowercase + string.digits + " .,?!:+-="
TINY_SPECIALS = ("<pad>", "<eos>")
# The chat variant's turn markers and template, in Qwen's format: a turn is
# "<|im_start|>{role}\n{content}<|im_end|>\n", the generation prompt "<|im_start|>assistant\n".
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")
QWEN_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_char_tokenizer(chat: bool = False):
    """A fast tokenizer with one token per character of TINY_CHARS (pad=0, eos=1).

    `chat`: a newline character and the turn markers are added after them, and the
    tokenizer carries QWEN_CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TINY_SPECIALS + tuple(TINY_CHARS) + (("\n",) if chat else ()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    if chat:
        tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_MARKERS)})
        tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def create_tiny_model(directory: str | os.PathLike, *, hidden_size: int = 64, layers: int = 2,
                      heads: int = 2, seed: int = 0, chat: bool = False) -> Path:
    """Write a randomly initialised Qwen2-architecture causal LM and its character tokenizer
    to `directory` and return the path. The defaults train in minutes on two CPU cores.

    `chat`: the tokenizer has Qwen's chat template and turn markers, and the generation
    config lists two end-of-turn ids as an instruct model's does: <|im_end|> and <eos>."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_char_tokenizer(chat)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if chat:
        model.generation_config = GenerationConfig(
            bos_token_id=1, pad_token_id=0,
            eos_token_id=[tokenizer.convert_tokens_to_ids(CHAT_MARKERS[1]), tokenizer.eos_token_id])
    path = Path(directory)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_tokenizer(path: str | os.PathLike):
    """Load a tokenizer saved beside a model.

    transformers 5 picks the tokenizer class from the model type, so a generic tokenizer
    saved beside a Qwen2 config would come back as Qwen2Tokenizer and encode wrongly. When
    the saved class is the generic fast backend, load tokenizer.json directly instead.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_file = Path(path) / "tokenizer_config.json"
    if config_file.exists():
        saved = json.loads(config_file.read_text()).get("tokenizer_class")
        if saved in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(path) / "tokenizer.json"))
            special = json.loads(config_file.read_text())
            tokenizer.pad_token = special.get("pad_token") or special.get("eos_token")
            tokenizer.eos_token = special.get("eos_token")
            template = Path(path) / "chat_template.jinja"  # where transformers 5 saves a template
            tokenizer.chat_template = template.read_text() if template.is_file() else special.get("chat_template")
            return tokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(model_dir: str | os.PathLike, tokenizer) -> tuple[int, ...]:
    """The ids that end a response of this model: its generation_config.json's eos_token_id
    (an int or a list: instruct models list their end-of-turn ids there, e.g. Qwen2.5-Instruct
    [151645, 151643]) and the tokenizer's EOS id, each once, in that order. A model without
    a generation config (or one naming no EOS) ends at the tokenizer's EOS alone."""
    from transformers import GenerationConfig

    try:
        listed = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: nothing listed there
        listed = None
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    ids = [*listed, tokenizer.eos_token_id]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def context_length(path: str | os.PathLike) -> int | None:
    """How many tokens (prompt + response) the model at `path` takes: its config's
    max_position_embeddings, or None when the config names no limit."""
    from transformers import AutoConfig

    value = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def load_causal_lm(path: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device)


def sharing_twin(model: nn.Module) -> nn.Module:
    """A second module of `model`'s class, on its own copy of the config, whose parameters,
    buffers and other tensors are `model`'s own objects: nothing is copied. A rollout engine
    hosted in the actor's process changes its module's attention and mode; on a twin that
    leaves the trained module as it is, and every optimizer step, which writes the tensors in
    place, reaches the engine with no weight sync. Tied weights stay tied (one object)."""
    import copy

    with torch.device("meta"):   # built without memory; every tensor is replaced below
        twin = type(model)(copy.deepcopy(model.config))
    pairs = list(zip(twin.named_modules(), model.named_modules()))
    if [name for name, _ in twin.named_modules()] != [name for name, _ in model.named_modules()]:
        raise ValueError(f"{type(model).__name__}: a module built from its config differs from the loaded one, so "
                         f"a rollout cannot share its tensors. Fix: give the rollout workers of its own (remove "
                         f"rollout.hosted_by)")
    for (_, mine), (_, theirs) in pairs:
        mine._parameters.update(theirs._parameters)
        mine._buffers.update(theirs._buffers)
        for name, value in vars(theirs).items():   # tensors kept as plain attributes (e.g. rotary's originals)
            if isinstance(value, torch.Tensor):
                setattr(mine, name, value)
    return twin


class ModelSourceError(FileNotFoundError):
    """A model argument that names neither a local model directory nor a hub model."""


def check_model_source(source: str | os.PathLike, key: str) -> None:
    """Raise ModelSourceError naming `key` unless transformers finds a model config at
    `source` (a local directory, or a hub id it can reach or has cached)."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        where = "the directory holds no config.json" if Path(source).is_dir() else \
            "it is no local directory, and no hub model of that id could be loaded"
        reason = str(error).strip().splitlines()[0][:200]
        raise ModelSourceError(f"{key}: {str(source)!r}: {where} ({reason}). Fix: give the directory a model was "
                               f"saved to with save_pretrained, or a hub id such as 'Qwen/Qwen2-0.5B' "
                               f"(with network access or a filled cache).") from None


def materialize(model_or_path, directory: str | os.PathLike, tokenizer=None, key: str = "actor_model") -> str:
    """Return a local directory holding the model (and tokenizer), so workers can load it.

    A path or hub id is checked and returned as is (a wrong one raises ModelSourceError
    naming `key`); an already-built transformers model object is saved into `directory`
    once, since models must not travel through the scheduler.
    """
    if isinstance(model_or_path, (str, os.PathLike)):
        check_model_source(model_or_path, key)
        return str(model_or_path)
    if not hasattr(model_or_path, "save_pretrained"):
        raise TypeError(f"expected a model path, hub id or transformers model, got {type(model_or_path).__name__}")
    Path(directory).mkdir(parents=True, exist_ok=True)
    model_or_path.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return str(directory)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) positions that skip left padding, as generation assigned them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


VALUE_HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """The critic: a causal LM's transformer body with a scalar head on every position.

    Initialised from the policy's weights (the usual PPO choice: the critic starts from a
    model that already reads the text) with a zero head, so initial values are 0.
    """

    def __init__(self, path: str | os.PathLike, dtype: torch.dtype = torch.float32):
        super().__init__()
        from transformers import AutoModel

        self.body = AutoModel.from_pretrained(path, dtype=dtype)
        self.head = nn.Linear(self.body.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        head_file = Path(path) / VALUE_HEAD_FILE
        if head_file.is_file():  # a critic saved by a run: its trained head comes back too
            from safetensors.torch import load_file

            self.head.load_state_dict({k: v.to(dtype) for k, v in load_file(str(head_file)).items()})

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """The body in Hugging Face format (AutoModel loads it) and the value head beside it."""
        from safetensors.torch import save_file

        self.body.save_pretrained(path)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()},
                  str(Path(path) / VALUE_HEAD_FILE))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) ids and mask -> (B, L) values, one per position. Packed rows (packing.py)
        come without a mask and with their `positions`, restarting at each sequence."""
        if attention_mask is not None:
            positions = position_ids(attention_mask)
        # No cache: transformers reads packed sequences from the positions only without one.
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                           use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1)


def load_sequence_scorer(path: str | os.PathLike, *, device: str = "cpu"):
    """A reward model: a sequence-classification model with one output per sequence."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    return model.to(device).eval()
