"""Read the scalars a run logged to TensorBoard back into plain Python numbers.

Used by ``scripts/loss_compare.py`` and the integration tests, so loss curves are compared
from exactly what a user would see in TensorBoard.
"""

import os

from tensorboard.backend.event_processing import event_accumulator

_SIZE_GUIDANCE = {
    # 0 = keep every event (the default keeps a sample of 10 000 scalars per tag).
    event_accumulator.SCALARS: 0,
    event_accumulator.TENSORS: 0,
    # Nothing else is needed: skip loading images, audio, histograms, ...
    event_accumulator.COMPRESSED_HISTOGRAMS: 1,
    event_accumulator.IMAGES: 1,
    event_accumulator.AUDIO: 1,
    event_accumulator.HISTOGRAMS: 1,
}


def event_files(tb_dir: str) -> list[str]:
    """Every TensorBoard event file under ``tb_dir`` (recursively: one sub-folder per run is
    TensorBoard's usual layout), sorted by path."""
    found = []
    for root, _dirs, files in os.walk(tb_dir):
        found += [os.path.join(root, f) for f in files if "tfevents" in f]
    return sorted(found)


def read_scalars(tb_dir: str) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar logged under ``tb_dir``.

    Reads each event file found under ``tb_dir`` (the folder itself and its sub-folders)
    with TensorBoard's ``EventAccumulator``, keeping every event (no down-sampling).
    Scalars written as ``simple_value`` (``torch.utils.tensorboard``) and as 0-d tensors
    (``tf.summary``) are both read.

    When the same (tag, step) was logged more than once -- a run that was restarted into
    the same folder, or several event files / run sub-folders -- the **newest** value wins:
    the one with the latest wall time, ties broken by the later file in path order (event
    file names start with their creation time) and then by the later event in the file.

    Values are those TensorBoard stores: ``simple_value`` is a float32, so expect float32
    rounding (about 6e-8 relative) against the numbers the trainer printed.

    Raises ``ValueError`` when ``tb_dir`` is not a folder or holds no event files.
    """
    if not os.path.isdir(tb_dir):
        raise ValueError(f"TensorBoard folder {tb_dir!r} does not exist (or is not a folder)")
    files = event_files(tb_dir)
    if not files:
        raise ValueError(
            f"no TensorBoard event files (*tfevents*) under {tb_dir!r}; was the run started with "
            "--metrics.enable_tensorboard true, and did it reach its first logged step?"
        )
    # (tag, step) -> (wall_time, file index, event index, value); the max key is the newest.
    newest: dict[tuple[str, int], tuple[float, int, int, float]] = {}
    for file_index, path in enumerate(files):
        acc = event_accumulator.EventAccumulator(path, size_guidance=_SIZE_GUIDANCE, purge_orphaned_data=False)
        acc.Reload()
        tags = acc.Tags()
        for tag in tags.get(event_accumulator.SCALARS, []):
            for event_index, event in enumerate(acc.Scalars(tag)):
                _keep_newest(newest, tag, event.step, (event.wall_time, file_index, event_index), event.value)
        for tag in tags.get(event_accumulator.TENSORS, []):
            for event_index, event in enumerate(acc.Tensors(tag)):
                value = _scalar_tensor_value(event.tensor_proto)
                if value is not None:
                    _keep_newest(newest, tag, event.step, (event.wall_time, file_index, event_index), value)
    scalars: dict[str, dict[int, float]] = {}
    for (tag, step), (*_order, value) in sorted(newest.items()):
        scalars.setdefault(tag, {})[step] = value
    return scalars


def read_texts(tb_dir: str) -> dict[str, dict[int, str]]:
    """``{tag: {step: text}}`` of every text summary under ``tb_dir``, the newest of a (tag, step)
    logged twice winning as in ``read_scalars``. Tags are as TensorBoard lists them:
    ``SummaryWriter.add_text(tag, ...)`` stores ``{tag}/text_summary``."""
    from tensorboard.util import tensor_util

    files = event_files(tb_dir)
    if not files:
        raise ValueError(f"no TensorBoard event files (*tfevents*) under {tb_dir!r}")
    newest: dict[tuple[str, int], tuple[float, int, int, str]] = {}
    for file_index, path in enumerate(files):
        acc = event_accumulator.EventAccumulator(path, size_guidance=_SIZE_GUIDANCE, purge_orphaned_data=False)
        acc.Reload()
        for tag in acc.Tags().get(event_accumulator.TENSORS, []):
            if acc.SummaryMetadata(tag).plugin_data.plugin_name != "text":
                continue
            for event_index, event in enumerate(acc.Tensors(tag)):
                text = tensor_util.make_ndarray(event.tensor_proto).reshape(-1)[0]
                key, order = (tag, int(event.step)), (event.wall_time, file_index, event_index)
                if key not in newest or order >= tuple(newest[key][:3]):
                    newest[key] = (*order, text.decode() if isinstance(text, bytes) else str(text))
    texts: dict[str, dict[int, str]] = {}
    for (tag, step), (*_order, text) in sorted(newest.items()):
        texts.setdefault(tag, {})[step] = text
    return texts


def _keep_newest(newest: dict, tag: str, step: int, order: tuple, value: float) -> None:
    key = (tag, int(step))
    if key not in newest or order >= tuple(newest[key][:3]):
        newest[key] = (*order, float(value))


def _scalar_tensor_value(tensor_proto) -> float | None:
    """The value of a 0-d (or single-element) numeric tensor summary, else None."""
    from tensorboard.util import tensor_util

    try:
        array = tensor_util.make_ndarray(tensor_proto)
    except Exception:  # noqa: BLE001  (strings, unknown dtypes: not a scalar we can compare)
        return None
    if array.size != 1 or array.dtype.kind not in "biuf":
        return None
    return float(array.reshape(()))
