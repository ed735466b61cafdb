"""The reward model of a GRPO run (``rl.reward_model``) as ``rl.reward_model_scores`` scores
with it: the path checked (a Hugging Face one-label sequence classifier of the policy's
tokenizer), then loaded as a frozen replica."""

import os

import tokenizers
import torch
from torch import nn

from torchtitan_rl.data.tokenizer import ByteTokenizer, Tokenizer
from torchtitan_rl.hf_checkpoint import TOKENIZER_FILE, load_hf_weights, read_hf_model_args
from torchtitan_rl.hf_tokenizer_files import byte_tokenizer_json
from torchtitan_rl.models.registry import spec_for_args


def reward_model_args(path: str, tokenizer: Tokenizer, attn_backend: str):
    """The model args of the reward model at ``path`` (``rl.reward_model``), checked: a Hugging
    Face directory of a one-label sequence classifier, dense, whose tokenizer is the policy's
    ``tokenizer``. Every mistake is a ValueError naming the key and the path."""
    key = f"rl.reward_model = {path!r}"
    if not os.path.isdir(path):
        raise ValueError(f"{key}: no such directory")
    try:
        args = read_hf_model_args(path, attn_backend)
    except ValueError as err:
        raise ValueError(
            f"{key}: {err} (a Hugging Face directory is needed: a reward model run writes one with "
            "checkpoint.last_save_in_hf)"
        ) from None
    if not getattr(args, "score_head", False):
        raise ValueError(
            f"{key}: a language model, not a reward model: its config.json names no one-label "
            "*ForSequenceClassification architecture"
        )
    if args.score_per_token:
        raise ValueError(f"{key}: a critic (*ForTokenClassification, a value per token), not a reward model")
    if args.num_experts:
        raise ValueError(f"{key}: a reward model with mixture-of-experts layers is not supported")
    _check_vocabulary(key, path, args.vocab_size, tokenizer)
    return args


def _check_vocabulary(key: str, path: str, vocab_size: int, tokenizer: Tokenizer) -> None:
    """The reward model reads the policy's token ids: its tokenizer must map every token to the
    same id, and its embedding must have a row for each."""
    file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(file):
        raise ValueError(
            f"{key}: no {TOKENIZER_FILE} to check that it reads the policy's token ids; copy the reward "
            "model's tokenizer files into the directory"
        )
    theirs = tokenizers.Tokenizer.from_file(file).get_vocab(with_added_tokens=True)
    # The byte tokenizer has no file of its own: an export writes byte_tokenizer_json's.
    json_tokenizer = byte_tokenizer_json() if isinstance(tokenizer, ByteTokenizer) else tokenizer
    ours = json_tokenizer.get_vocab(with_added_tokens=True)
    if theirs != ours:
        differing = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda item: (item[1], item[0]))
        token = differing[0][0]
        raise ValueError(
            f"{key}: its tokenizer ({file}, {len(theirs)} tokens) is not the policy's ({len(ours)} tokens): "
            f"{len({t for t, _ in differing})} tokens differ, e.g. {token!r} is id {theirs.get(token)} there and "
            f"{ours.get(token)} here. A reward model scores the policy's token ids, so it must share its tokenizer"
        )
    if vocab_size < len(ours):
        raise ValueError(f"{key}: vocab_size {vocab_size} in its config.json is smaller than its {len(ours)} tokens")


def load_reward_model(args, path: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The reward model at ``path`` (its ``reward_model_args``), frozen, on ``device`` in ``dtype``."""
    with torch.device("meta"):
        model = spec_for_args(args).model_cls(args)
    # Loading casts each tensor to its parameter's dtype: the replica's.
    model = model.to_empty(device=device).to(dtype).eval().requires_grad_(False)
    load_hf_weights(model, path)
    return model
