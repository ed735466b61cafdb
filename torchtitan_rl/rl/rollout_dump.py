"""What a GRPO run keeps of what its policy generated: every trained rollout and every evaluation
on disk (``rollout_files``), and a few of them as a TensorBoard text table and on the console.

Where the records come from: a rollout's facts that only the sampler knows (its group, reward,
stop reason, turns) travel with its training sample (``Sample.rollout_info``, set by
``to_samples``) through the data-parallel balancing; after the update each data-parallel rank
packs its samples with what the update computed (proximal log-probs, correction weights) into
one batch of concatenated tensors (``sample_batch``) and the batches go to rank 0 in one
``gather_object`` over the ``batch`` mesh (CP / TP peers hold copies: only the first peer
sends). Evaluation records are gathered over the training ranks, which split the held-out
prompts. Rank 0 makes and decodes the few table rows at once and hands the step to a writer
thread, which makes the other records, decodes them and writes the file off the training path;
at most one step waits behind the one being written, so a slow disk slows training down rather
than growing memory.

Routing replay (``moe.router_replay``): samples that carry the sampler's experts
(``Sample.routed_experts``) keep them in a binary file beside the step's records,
``step-{N}.routing.npy`` (numpy's format, read with ``read_routing``): per sample the rows of
``routed_experts`` from its first recorded input position to its end, record after record in
the file's order, uint8 when every stored id fits in a byte, else int16 (-1: not recorded).
A record's ``routed_experts`` field locates its rows: ``{"first", "offset", "num"}`` = its
input positions ``first .. first + num - 1`` are the file's rows ``offset .. offset + num - 1``
(null without recorded routing). The file is written before the records, so a step's records
never name a file that is missing or partial.
"""

import io
import logging
import math
import os
import queue
import re
import threading

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from torchtitan_rl import rollout_files
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.data.tokenizer import Tokenizer
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.rl.env_rollouts import EpisodeRollout, decode_completion
from torchtitan_rl.rl.generator import Rollout
from torchtitan_rl.rl.tasks import Reward

logger = logging.getLogger(__name__)

# The text summaries' tags; TensorBoard lists them with "/text_summary" appended (``add_text``).
ROLLOUT_TABLE_TAG = "rollouts/samples"
EVAL_TABLE_TAG = "eval/samples"
_TABLE_TEXT_CHARS = 2000  # of a prompt or completion in a table cell; the dump keeps all of it
_CONSOLE_WIDTH = 160
_ROUTING_FILE = re.compile(r"step-(\d+)\.routing\.npy")


# ------------------------------------------------------------------ what a record is made of


def describe_images(rollout: Rollout) -> list[dict]:
    """The rollout's images as references: a path where there is one, else what it is."""
    described = []
    for image in rollout.images:
        source = image.source
        if isinstance(source, dict):
            source = source.get("path") or source.get("bytes")
        if isinstance(source, (str, os.PathLike)):
            text = os.fspath(source)
        elif isinstance(source, (bytes, bytearray, memoryview)):
            text = f"<{len(source)} bytes of encoded image>"
        else:
            text = f"<{type(source).__name__}>"
        described.append({"source": text, "where": image.where, "grid": list(image.grid)})
    return described


def turn_lengths(rollout: Rollout) -> list[tuple[str, int]] | None:
    """An episode's completion as (role, number of tokens) turns: runs of sampled tokens are the
    assistant's, runs between them the environment's observations (roles from the episode);
    None for a single-turn rollout."""
    if not isinstance(rollout, EpisodeRollout):
        return None
    turns: list[tuple[str, int]] = []
    num_observations = 0
    for sampled in rollout.loss_mask:
        if turns and turns[-1][0] == sampled:
            turns[-1] = (sampled, turns[-1][1] + 1)
            continue
        turns.append((sampled, 1))
    named = []
    for sampled, length in turns:
        if sampled:
            named.append(("assistant", length))
            continue
        roles = rollout.observation_roles
        named.append((roles[num_observations] if num_observations < len(roles) else "environment", length))
        num_observations += 1
    return named


def rollout_info(
    group: int, rollout: Rollout, reward: Reward, advantage: float, behaviour_logprob_mean: float | None
) -> dict:
    """What a training sample carries of its rollout for the dump (``Sample.rollout_info``)."""
    is_episode = isinstance(rollout, EpisodeRollout)
    return {
        "group": group,
        "sample": rollout.sample_index,
        "num_prompt_tokens": len(rollout.prompt_tokens),
        "turns": turn_lengths(rollout),
        "stop_reason": rollout.stop_reason,
        "end_reason": rollout.end_reason if is_episode else None,
        "num_turns": rollout.num_turns if is_episode else 1,
        "reward": reward.total,
        "correct": reward.correct,
        "reward_components": dict(reward.components),
        "advantage": advantage,
        "version": rollout.version,
        "behaviour_logprob_mean": behaviour_logprob_mean,
        "images": describe_images(rollout),
    }


def sample_batch(samples: list[Sample], step: int, with_routing: bool = True) -> dict:
    """This rank's trained ``samples`` at ``step`` as rank 0 takes them: their rollouts' facts,
    their tokens and loss masks concatenated, and per sample the mean over its loss tokens of what
    the update computed (proximal log-probs, correction weights; NaN without loss tokens). A few
    tensor operations for the rank's whole share: the training thread does nothing per token."""
    num_samples = len(samples)
    lengths = [len(sample) for sample in samples]
    batch = {"step": step, "infos": [sample.rollout_info for sample in samples], "lengths": lengths}
    assert all(info is not None for info in batch["infos"]), "RL samples from to_samples"
    if not samples:
        return {**batch, "input_ids": torch.zeros(0, dtype=torch.long), "loss_mask": torch.zeros(0, dtype=torch.bool)}
    routing_firsts, routing_rows = recorded_routing(samples) if with_routing else ([None] * num_samples, None)
    mask = torch.cat([sample.loss_mask for sample in samples])
    segment = torch.repeat_interleave(torch.arange(num_samples), torch.tensor(lengths))
    num_loss = torch.zeros(num_samples, dtype=torch.float64).index_add_(0, segment, mask.double())

    def loss_token_means(name: str) -> torch.Tensor | None:
        if any(getattr(sample, name) is None for sample in samples):
            return None
        values = torch.where(mask, torch.cat([getattr(sample, name) for sample in samples]).double(), 0.0)
        sums = torch.zeros(num_samples, dtype=torch.float64).index_add_(0, segment, values)
        return torch.where(num_loss > 0, sums / num_loss.clamp(min=1), float("nan"))

    return {
        **batch,
        # int32: half the bytes rank 0 receives (a vocabulary has fewer than 2**31 tokens).
        "input_ids": torch.cat([sample.input_ids for sample in samples]).to(torch.int32),
        "last_labels": torch.stack([sample.labels[-1] for sample in samples]),
        "loss_mask": mask,
        "proximal": loss_token_means("prox_logprobs"),
        "weights": loss_token_means("rollout_weights"),
        "routing_firsts": routing_firsts,
        "routing_rows": routing_rows,
    }


def recorded_routing(samples: list[Sample]) -> tuple[list[int | None], torch.Tensor | None]:
    """Per sample the first input position with recorded experts (None: none), and the rows of
    ``routed_experts`` from there to each sample's end, concatenated and ``compact``."""
    firsts, rows = [], []
    for sample in samples:
        recorded = None if sample.routed_experts is None else sample.routed_experts[:, 0, 0] >= 0
        if recorded is None or not bool(recorded.any()):
            firsts.append(None)
            continue
        firsts.append(int(recorded.int().argmax()))
        rows.append(sample.routed_experts[firsts[-1] :])
    return firsts, compact(torch.cat(rows)) if rows else None


def compact(experts: torch.Tensor) -> torch.Tensor:
    """``experts`` as uint8 when every value fits in a byte (-1 does not), else int16."""
    fits = int(experts.min()) >= 0 and int(experts.max()) <= 255
    return experts.to(torch.uint8 if fits else torch.int16)


def _mean_at(means: torch.Tensor | None, i: int) -> float | None:
    value = None if means is None else float(means[i])
    return None if value is None or math.isnan(value) else value


def batch_records(batches: list[dict], selected: set | None = None) -> list[dict]:
    """The records before decoding (token ids, no text) of the gathered ``sample_batch``es, in
    (group, sample) order; with ``selected`` only those whose (group, sample) it holds."""
    records = []
    for batch in batches:
        start = routing_start = 0
        for i, (info, length) in enumerate(zip(batch["infos"], batch["lengths"])):
            end, begin = start + length, start
            start = end
            first = batch["routing_firsts"][i]
            routing = None
            if first is not None:
                routing = (first, batch["routing_rows"][routing_start : routing_start + length - first])
                routing_start += length - first
            if selected is not None and (info["group"], info["sample"]) not in selected:
                continue
            tokens = batch["input_ids"][begin:end].tolist() + [int(batch["last_labels"][i])]
            # Input t predicts token t + 1: the completion's loss flags start at num_prompt - 1.
            trained = batch["loss_mask"][begin + info["num_prompt_tokens"] - 1 : end].tolist()
            turns = None
            if info["turns"] is not None:
                turns, position = [], 0
                for role, num_tokens in info["turns"]:
                    turns.append((role, num_tokens, any(trained[position : position + num_tokens])))
                    position += num_tokens
            records.append(
                {
                    **info,
                    "step": batch["step"],
                    "token_ids": tokens,
                    "turns": turns,
                    "num_loss_tokens": sum(trained),
                    "staleness": batch["step"] - 1 - info["version"],
                    "proximal_logprob_mean": _mean_at(batch["proximal"], i),
                    "correction_weight_mean": _mean_at(batch["weights"], i),
                    "routed_experts": None,  # where its rows are in the step's routing file, once written
                    "routing": routing,  # (first input position, its recorded rows) for that file
                }
            )
    return sorted(records, key=lambda r: (r["group"], r["sample"]))


# ------------------------------------------------------------------ the routing file


def routing_file(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}.routing.npy")


def write_routing(folder: str, step: int, records: list[dict]) -> None:
    """Write the recorded routing of ``batch_records``' ``records`` (in their order) as step
    ``step``'s routing file under ``folder``, whole or not at all, and point each record's
    ``routed_experts`` at its rows; no file when none has any."""
    parts, offset = [], 0
    for record in records:
        if record["routing"] is None:
            continue
        first, rows = record["routing"]
        record["routed_experts"] = {"first": first, "offset": offset, "num": len(rows)}
        parts.append(rows)
        offset += len(rows)
    if not parts:
        return
    os.makedirs(folder, exist_ok=True)
    path = routing_file(folder, step)
    with open(f"{path}.partial", "wb") as out:
        np.save(out, compact(torch.cat(parts)).numpy())
    os.replace(f"{path}.partial", path)


def read_routing(folder: str, step: int, record: dict) -> np.ndarray | None:
    """A dumped rollout record's recorded experts ``[num, MoE layers, top_k]`` (its input
    positions ``first .. first + num - 1``) from step ``step``'s routing file; None without."""
    where = record["routed_experts"]
    if where is None:
        return None
    rows = np.load(routing_file(folder, step), mmap_mode="r")
    return np.array(rows[where["offset"] : where["offset"] + where["num"]])


def remove_routing_after(folder: str, step: int) -> None:
    """Delete the routing files of the steps after ``step`` (``RolloutLog.start``)."""
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if (m := _ROUTING_FILE.fullmatch(name)) and int(m.group(1)) > step:
                os.remove(os.path.join(folder, name))


def completion_entry(rollout: Rollout, reward: Reward) -> dict:
    """One evaluated completion before decoding (``eval_record``)."""
    turns = turn_lengths(rollout)
    return {
        "token_ids": rollout.completion_tokens,
        "turns": None if turns is None else [(role, length, role == "assistant") for role, length in turns],
        "correct": reward.correct,
        "reward": reward.total,
        "stop_reason": rollout.stop_reason,
    }


def eval_record(
    step: int, prompt_index: int, answer: str, greedy: dict, samples: list[dict], pass_at_k: float, rollout: Rollout
) -> dict:
    """One held-out prompt's evaluation before decoding: its greedy and ``k`` sampled
    completions (``completion_entry``)."""
    return {
        "kind": "eval",
        "step": step,
        "prompt_index": prompt_index,
        "prompt": None,  # decoded from prompt_ids on rank 0
        "prompt_ids": rollout.prompt_tokens,
        "answer": answer,
        "k": len(samples),
        "greedy": greedy,
        "samples": samples,
        "num_correct": sum(s["correct"] for s in samples),
        "pass@1": float(greedy["correct"]),
        "pass@k": pass_at_k,
        "images": describe_images(rollout),
    }


# ------------------------------------------------------------------ decoding (rank 0)


def _decoded_turns(tokenizer: Tokenizer, completion: list[int], turns: list | None) -> list[dict] | None:
    if turns is None:
        return None
    decoded, start = [], 0
    for role, length, trained in turns:
        ids = completion[start : start + length]
        decoded.append(
            {"role": role, "text": decode_completion(tokenizer, ids), "token_ids": ids, "trained": bool(trained)}
        )
        start += length
    return decoded


def decode_rollout(tokenizer: Tokenizer, raw: dict) -> dict:
    """The dumped form of a ``batch_records`` record: text instead of token ids (an episode's turns keep theirs)."""
    num_prompt = raw["num_prompt_tokens"]
    prompt, completion = raw["token_ids"][:num_prompt], raw["token_ids"][num_prompt:]
    return {
        "kind": "rollout",
        "step": raw["step"],
        "group": raw["group"],
        "sample": raw["sample"],
        "prompt": decode_completion(tokenizer, prompt),
        "completion": decode_completion(tokenizer, completion),
        "turns": _decoded_turns(tokenizer, completion, raw["turns"]),
        "num_prompt_tokens": num_prompt,
        "num_completion_tokens": len(completion),
        "num_loss_tokens": raw["num_loss_tokens"],
        "stop_reason": raw["stop_reason"],
        "end_reason": raw["end_reason"],
        "num_turns": raw["num_turns"],
        "reward": raw["reward"],
        "correct": raw["correct"],
        "reward_components": raw["reward_components"],
        "advantage": raw["advantage"],
        "version": raw["version"],
        "staleness": raw["staleness"],
        "behaviour_logprob_mean": raw["behaviour_logprob_mean"],
        "proximal_logprob_mean": raw["proximal_logprob_mean"],
        "correction_weight_mean": raw["correction_weight_mean"],
        "images": raw["images"],
        "routed_experts": raw["routed_experts"],
    }


def _decode_completion_entry(tokenizer: Tokenizer, entry: dict) -> dict:
    return {
        "completion": decode_completion(tokenizer, entry["token_ids"]),
        "turns": _decoded_turns(tokenizer, entry["token_ids"], entry["turns"]),
        "correct": entry["correct"],
        "reward": entry["reward"],
        "num_completion_tokens": len(entry["token_ids"]),
        "stop_reason": entry["stop_reason"],
    }


def decode_eval(tokenizer: Tokenizer, raw: dict) -> dict:
    """The dumped form of an ``eval_record``."""
    decoded = {
        "prompt": decode_completion(tokenizer, raw["prompt_ids"]),
        "greedy": _decode_completion_entry(tokenizer, raw["greedy"]),
        "samples": [_decode_completion_entry(tokenizer, s) for s in raw["samples"]],
    }
    return {key: decoded.get(key, value) for key, value in raw.items() if key != "prompt_ids"}


# ------------------------------------------------------------------ tables


def table_rows(records: list, num_rows: int) -> list:
    """``num_rows`` records spread evenly over ``records`` (one from each equal part: different
    prompts), in order."""
    if num_rows >= len(records):
        return list(records)
    return [records[-(-len(records) * i // num_rows)] for i in range(num_rows)]  # the first of part i


def _cell(text: str) -> str:
    text = text if len(text) <= _TABLE_TEXT_CHARS else text[:_TABLE_TEXT_CHARS] + " …"
    # Every line break Python knows (sampled bytes hold \x0b, \x1c, ...): one row per record.
    return "<br>".join(text.replace("|", "\\|").splitlines())


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A TensorBoard text summary (markdown) of ``rows``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(str(value)) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def console_table(title: str, header: list[str], rows: list[list]) -> str:
    table = Table(title=title, show_lines=True)
    for name in header:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(str(value) for value in row))
    out = io.StringIO()
    Console(file=out, width=_CONSOLE_WIDTH, force_terminal=False).print(table)
    return out.getvalue()


ROLLOUT_COLUMNS = ["group", "sample", "reward", "advantage", "prompt", "completion"]
EVAL_COLUMNS = ["prompt", "answer", "greedy completion", "correct", "pass@k"]


def rollout_row(record: dict) -> list:
    return [
        record["group"],
        record["sample"],
        f"{record['reward']:.4g}",
        f"{record['advantage']:.4g}",
        record["prompt"],
        record["completion"],
    ]


def eval_row(record: dict) -> list:
    return [
        record["prompt"],
        record["answer"],
        record["greedy"]["completion"],
        record["greedy"]["correct"],
        f"{record['pass@k']:.4g}",
    ]


# kind -> (TensorBoard tag, columns, a record's row)
_TABLES = {
    rollout_files.ROLLOUTS: (ROLLOUT_TABLE_TAG, ROLLOUT_COLUMNS, rollout_row),
    rollout_files.EVALS: (EVAL_TABLE_TAG, EVAL_COLUMNS, eval_row),
}


# ------------------------------------------------------------------ the log


class RolloutLog:
    """A GRPO run's rollout and evaluation records: gathered to rank 0, dumped
    (``rl.dump_rollouts``), shown in TensorBoard (``rl.log_samples``) and printed
    (``rl.print_samples``, every ``metrics.log_freq`` steps)."""

    def __init__(self, job_config, tokenizer: Tokenizer, parallel_dims: ParallelDims, rank: int, tb_writer):
        rl = job_config.rl
        self.dump, self.num_table_rows, self.print_rows = rl.dump_rollouts, rl.log_samples, rl.print_samples
        self.log_freq = job_config.metrics.log_freq
        self.folders = {kind: os.path.join(job_config.job.dump_folder, kind) for kind in rollout_files.KINDS}
        self.tokenizer, self.parallel_dims, self.rank = tokenizer, parallel_dims, rank
        self.tb_writer = tb_writer
        self.enabled = self.dump or self.num_table_rows > 0
        # Recorded experts weigh L * k bytes per token: only for the dump, and only when asked for.
        self.dump_routing = self.dump and rl.dump_routing
        # The step being written and at most one more: the bound on what rank 0 holds.
        self._pending: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if self.enabled and self.dump and rank == 0:
            self._thread = threading.Thread(target=self._write_loop, name="rollout-dump", daemon=True)
            self._thread.start()

    def start(self, last_step: int) -> None:
        """Before the run's first step: drop the files of the steps after ``last_step`` (the step
        a resumed run restarts after) and any partial file, so that every step has one file, that
        of the run that trained it; a fresh run (``last_step`` 0) drops every file, its step-0
        evaluation included (it evaluates step 0 again)."""
        if self.rank != 0 or not self.dump:
            return
        after = last_step if last_step > 0 else -1
        removed = [step for folder in self.folders.values() for step in rollout_files.remove_steps_after(folder, after)]
        remove_routing_after(self.folders[rollout_files.ROLLOUTS], after)
        if removed:
            logger.info("rollout dump: removed %d file(s) of steps after step %d", len(removed), last_step)

    def log_step(self, step: int, samples: list[Sample]) -> None:
        """Record the trained ``samples`` of this rank at ``step`` (collective over the training ranks)."""
        if not self.enabled:
            return
        peers = self.parallel_dims.mesh("replica")
        if peers is not None and peers.get_local_rank() != 0:
            return  # the first peer's samples are the same
        gathered = _gather(sample_batch(samples, step, self.dump_routing), self.parallel_dims.mesh("batch"))
        if gathered is None:
            return
        order = sorted((info["group"], info["sample"]) for batch in gathered for info in batch["infos"])
        shown = batch_records(gathered, set(table_rows(order, self.num_table_rows)))
        self._publish(rollout_files.ROLLOUTS, step, shown, lambda: batch_records(gathered), decode_rollout)

    def log_eval(self, step: int, raw: list[dict], group: dist.ProcessGroup | None) -> None:
        """Record this rank's ``eval_record``s of the evaluation after ``step`` (collective over ``group``)."""
        if not self.enabled:
            return
        gathered = [raw]
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size(group) if self.rank == 0 else None
            dist.gather_object(raw, gathered, dst=0, group=group)
        if self.rank != 0:
            return
        records = sorted((r for part in gathered for r in part), key=lambda r: r["prompt_index"])
        shown = table_rows(records, self.num_table_rows)
        self._publish(rollout_files.EVALS, step, shown, lambda: records, decode_eval)

    def _publish(self, kind: str, step: int, shown: list[dict], all_records, decode) -> None:
        """Rank 0: the table of the ``shown`` records now (few); ``all_records()`` (the step's
        records before decoding) made, decoded and written by the writer thread."""
        tag, header, row = _TABLES[kind]
        shown = [decode(self.tokenizer, r) for r in shown]
        if shown and self.tb_writer is not None:
            self.tb_writer.add_text(tag, markdown_table(header, [row(r) for r in shown]), step)
        if shown and self.print_rows and step % self.log_freq == 0:
            logger.info("\n%s", console_table(f"{tag} at step {step}", header, [row(r) for r in shown]))
        if self.dump:
            self._raise_writer_error()
            self._pending.put((kind, step, all_records, decode))

    def _write_loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                if self._error is not None:
                    continue  # reported on the main thread; drain
                kind, step, all_records, decode = item
                try:
                    records = all_records()
                    if kind == rollout_files.ROLLOUTS:
                        write_routing(self.folders[kind], step, records)
                    decoded = (decode(self.tokenizer, r) for r in records)
                    rollout_files.write_step(self.folders[kind], step, decoded)
                except BaseException as err:  # noqa: BLE001  (re-raised on the training thread)
                    self._error = err
            finally:
                self._pending.task_done()

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"rl.dump_rollouts: writing under {self.folders} failed: {self._error}") from self._error

    def close(self) -> None:
        """Write what is queued, then stop the writer; a write's failure is raised here."""
        if self._thread is None:
            return
        self._pending.put(None)
        self._thread.join()
        self._thread = None
        self._raise_writer_error()


def _gather(raw: list[dict], batch_mesh) -> list[list[dict]] | None:
    """Every data-parallel rank's ``raw`` on the first one (None elsewhere)."""
    if batch_mesh is None:
        return [raw]
    group = batch_mesh.get_group()
    is_first = batch_mesh.get_local_rank() == 0
    gathered = [None] * batch_mesh.size() if is_first else None
    dist.gather_object(raw, gathered, dst=dist.get_global_rank(group, 0), group=group)
    return gathered
