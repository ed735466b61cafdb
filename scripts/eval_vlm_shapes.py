"""Colour accuracy of a vision-language model on held-out `shapes` colour questions.

    .venv/bin/python scripts/eval_vlm_shapes.py OUTPUT/checkpoint/step-N [--questions 120 --seed 1000]

Reads a Hugging Face export (``checkpoint.last_save_in_hf``; the byte tokenizer) and scores each
question by forced choice: the answer is the colour whose assistant turn (the colour name and
``<|im_end|>``) has the highest log-probability under the model. Prints one JSON line with the
accuracy and chance (1 / number of colours). The questions come from a seed the training data
does not use, so they are fresh images.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_rl.data.packing import pack  # noqa: E402
from torchtitan_rl.data.shapes import COLOURS, colour_rows  # noqa: E402
from torchtitan_rl.data.tokenizer import ByteTokenizer  # noqa: E402
from torchtitan_rl.data.vision_samples import RowPlanner, VisionDataConfig, build_sample  # noqa: E402
from torchtitan_rl.hf_checkpoint import load_hf_weights, read_hf_model_args  # noqa: E402
from torchtitan_rl.models.vlm.model import VisionInputs, VLMModel  # noqa: E402
from torchtitan_rl.recipes.base import vision_packing  # noqa: E402


@torch.no_grad()
def colour_accuracy(model: VLMModel, vision: VisionDataConfig, num_questions: int, seed: int) -> float:
    """Share of ``num_questions`` colour questions whose most likely answer is the true colour."""
    planner, packing = RowPlanner(ByteTokenizer(), vision), vision_packing(model.args)
    correct = 0
    for index, row in enumerate(colour_rows(num_questions, seed)):
        truth = row["messages"][-1]["content"]
        candidates = []
        for colour in COLOURS:
            messages = row["messages"][:-1] + [{"role": "assistant", "content": colour}]
            planned = planner.plan_row({"messages": messages}, index, f"question {index}", None)
            candidates.append(build_sample(planned, vision))
        mb = pack(candidates, vision=packing)
        vision_inputs = VisionInputs(mb.image_patches, mb.image_grids, mb.vision_index)
        logprobs = model.output(model(mb.input_ids, mb.positions, mb.seq_ids, vision=vision_inputs)).log_softmax(-1)
        token_logprobs = logprobs.gather(1, mb.labels[:, None])[:, 0] * mb.loss_mask
        scores = torch.zeros(len(candidates)).index_add_(0, mb.seq_ids, token_logprobs)
        correct += list(COLOURS)[int(scores.argmax())] == truth
    return correct / num_questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", help="Hugging Face export directory of a model.name = 'vlm' run")
    parser.add_argument("--questions", type=int, default=120)
    parser.add_argument("--seed", type=int, default=1000, help="seed of the held-out questions")
    parser.add_argument("--max-image-tokens", type=int, default=16, help="training.max_image_tokens of the run")
    args = parser.parse_args()
    model_args = read_hf_model_args(args.export)
    model = VLMModel(model_args)
    load_hf_weights(model, args.export)
    vision = VisionDataConfig(
        model_args.vision.patch_size,
        model_args.spatial_merge_size,
        args.max_image_tokens,
        max_patches_per_side=model_args.vision.max_patches_per_side,
    )
    accuracy = colour_accuracy(model.eval(), vision, args.questions, args.seed)
    print(json.dumps({"colour_accuracy": accuracy, "chance": 1 / len(COLOURS), "questions": args.questions}))


if __name__ == "__main__":
    main()
