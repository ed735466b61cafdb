"""A preference row → the chosen and the rejected sample's tokens, images included.

Accepted rows:

- plain: ``{"prompt": str, "chosen": str, "rejected": str}``; each side is tokenized as the
  SFT row ``{"prompt": prompt, "completion": side}`` (loss on the completion and its EOS);
- conversational: ``"prompt"`` (or ``"messages"``) a list of chat messages, and ``"chosen"`` /
  ``"rejected"`` each the assistant's reply, a string or a list holding one assistant message;
  each side is tokenized as the SFT row ``{"messages": prompt + [reply]}``, with the loss on the
  final reply only (its content and ``<|im_end|>``): assistant turns of the prompt are context,
  not what the pair compares;
- implicit prompt (no ``prompt`` / ``messages``): ``"chosen"`` and ``"rejected"`` are whole
  conversations that share every message but their final assistant turn; what they share is
  the prompt.

Images are given as in SFT rows (``data.chat``): content parts of the prompt's messages, or
``<image>`` markers with a top-level ``"images"`` list; never in a reply. Both sides carry the
prompt's images.

Any row may carry a numeric ``"margin"`` (0 when absent): by how much a reward model's score of
the chosen side should exceed the rejected one's (``losses.reward_model``). DPO ignores it.
"""

import dataclasses
import math
from numbers import Real
from typing import Any

from torchtitan_rl.data.chat import TRAINED_ROLE, TokenizedRow, conversation_problem, tokenize_row_with_images
from torchtitan_rl.data.tokenizer import Tokenizer
from torchtitan_rl.data.vision_samples import PlannedSample, RowPlanner

SIDES = ("chosen", "rejected")
PREFERENCE_FORMATS = (
    "{'prompt': str, 'chosen': str, 'rejected': str}, {'prompt' or 'messages': [chat messages], "
    "'chosen': str or [one assistant message], 'rejected': likewise}, or {'chosen': [chat messages], "
    "'rejected': [chat messages]} sharing all but their final assistant turn"
)


def _problem(text: str, row: dict[str, Any]) -> ValueError:
    columns = sorted(key for key, value in row.items() if value is not None)
    return ValueError(f"invalid preference row with columns {columns}: {text}; expected {PREFERENCE_FORMATS}")


def preference_margin(row: dict[str, Any]) -> float:
    """The row's ``margin`` (0 without one); a ValueError unless it is a finite number."""
    value = row.get("margin")
    if value is None:  # also a row without it, of a dataset merged from files with and without the column
        return 0.0
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"invalid preference row: 'margin' must be a finite number, got {value!r}")
    return float(value)


def _kind(value: Any) -> str:
    return f"a list of {len(value)} messages" if isinstance(value, list) else f"a {type(value).__name__}"


def _reply(value: Any, side: str, row: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of one side of a pair with an explicit prompt."""
    if isinstance(value, str):
        return {"role": TRAINED_ROLE, "content": value}
    if not isinstance(value, list) or len(value) != 1:
        raise _problem(f"{side!r} must be a string or a list holding one assistant message, got {_kind(value)}", row)
    problem = conversation_problem(value)
    if problem is not None:
        raise _problem(f"{side!r}: {problem}", row)
    if value[0]["role"] != TRAINED_ROLE:
        raise _problem(f"{side!r} must be the assistant's reply, got a {value[0]['role']!r} turn", row)
    return value[0]


def _implicit_prompt(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages ``chosen`` and ``rejected`` share, and the final assistant turn of each."""
    conversations = [row[side] for side in SIDES]
    for side, conversation in zip(SIDES, conversations):
        if not isinstance(conversation, list):
            raise _problem(
                f"without a 'prompt' or 'messages' column, 'chosen' and 'rejected' must be whole conversations "
                f"(lists of chat messages), got {_kind(conversation)} {side!r}",
                row,
            )
        problem = conversation_problem(conversation)
        if problem is not None:
            raise _problem(f"{side!r}: {problem}", row)
        if conversation[-1]["role"] != TRAINED_ROLE:
            raise _problem(
                f"the final turn of {side!r} is a {conversation[-1]['role']!r} turn, not the assistant's", row
            )
    chosen, rejected = conversations
    if chosen[:-1] != rejected[:-1]:
        index = next((k for k, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1])) if a != b), None)
        where = (
            f"message {index} differs"
            if index is not None
            else f"'chosen' has {len(chosen)} messages, 'rejected' {len(rejected)}"
        )
        raise _problem(
            f"'chosen' and 'rejected' differ before their final assistant turn ({where}); without a 'prompt' "
            "column they must share every message but that turn",
            row,
        )
    if len(chosen) == 1:
        raise _problem("'chosen' and 'rejected' share no message: the pair has no prompt", row)
    return chosen[:-1], [chosen[-1], rejected[-1]]


def _conversation_side(
    messages: list[dict[str, Any]], images: dict[str, Any], tokenizer: Tokenizer, base_dir: str | None
) -> TokenizedRow:
    """The SFT tokens of ``messages`` with only its final (assistant) turn trained."""
    full = tokenize_row_with_images({"messages": messages, **images}, tokenizer, base_dir)
    # The final turn's header is never trained, so the last run of targets is exactly that
    # turn's content and <|im_end|> (trained whatever the content), whatever turns precede it.
    end = max(j for j, trained in enumerate(full.target_mask) if trained) + 1
    start = end
    while start > 0 and full.target_mask[start - 1]:
        start -= 1
    return TokenizedRow(full.tokens, [start <= j < end for j in range(len(full.tokens))], full.images)


def tokenize_preference_row(
    row: dict[str, Any], tokenizer: Tokenizer, base_dir: str | None = None
) -> tuple[TokenizedRow, TokenizedRow]:
    """``(chosen, rejected)``: the tokens, loss targets and images of each side of ``row`` (see
    the module docstring for the formats); a row of no accepted format is a ValueError naming
    what is wrong. A relative image path is relative to ``base_dir`` as in SFT rows."""
    missing = [side for side in SIDES if row.get(side) is None]
    if missing:
        raise _problem(f"it has no {' and no '.join(map(repr, missing))}", row)
    if row.get("prompt") is not None and row.get("messages") is not None:
        raise _problem("it has both 'prompt' and 'messages'; give the prompt in one of them", row)
    key = "prompt" if row.get("prompt") is not None else "messages"
    prompt = row.get(key)
    # Columns a row does not use are None when datasets merges files with different columns.
    images = {"images": row["images"]} if row.get("images") is not None else {}
    sides = []
    if isinstance(prompt, str):
        for side in SIDES:
            if not isinstance(row[side], str):
                raise _problem(
                    f"with a string {key!r} (a plain pair), {side!r} must be a string, got {_kind(row[side])}", row
                )
            try:
                sides.append(
                    tokenize_row_with_images({"prompt": prompt, "completion": row[side], **images}, tokenizer, base_dir)
                )
            except ValueError as err:
                raise ValueError(f"{side!r}: {err}") from err
        return sides[0], sides[1]
    if prompt is None:
        prompt, replies = _implicit_prompt(row)
    else:
        if not isinstance(prompt, list):
            raise _problem(f"{key!r} must be a string or a list of chat messages, got {_kind(prompt)}", row)
        problem = conversation_problem(prompt)
        if problem is not None:
            raise _problem(f"{key!r}: {problem}", row)
        replies = [_reply(row[side], side, row) for side in SIDES]
    for side, reply in zip(SIDES, replies):
        try:
            sides.append(_conversation_side([*prompt, reply], images, tokenizer, base_dir))
        except ValueError as err:
            raise ValueError(f"{side!r}: {err}") from err
    return sides[0], sides[1]


def plan_preference_row(
    planner: RowPlanner, row: dict[str, Any], row_index: int, where: str, base_dir: str | None
) -> tuple[PlannedSample, PlannedSample]:
    """``RowPlanner.plan_row`` of both sides of a preference row: ``(chosen, rejected)``, each
    with image placeholders and patch grids and the row's ``margin``. Errors are prefixed with
    ``where`` (the row)."""
    try:
        chosen, rejected = tokenize_preference_row(row, planner.tokenizer, base_dir)
        margin = preference_margin(row)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
    return (
        dataclasses.replace(planner.plan_tokenized(chosen, row_index, f"{where} {SIDES[0]}"), margin=margin),
        dataclasses.replace(planner.plan_tokenized(rejected, row_index, f"{where} {SIDES[1]}"), margin=margin),
    )
