"""Every check `svrmad run` can make without reading a weight, made once before it loads a model,
writes a file or takes the folder's lock: the flags, the dataset, the run folder's settings, the
device, the checkpoint folder (config.json and its fields, the weight files against their headers,
the quantization, the tokenizer and its chat template) and what the methods need.

So a run that is refused leaves the folder as it found it, and a refusal comes in seconds, not
after minutes of loading a large checkpoint. The run repeats the folder check under the lock
(job/run.py `_prepare`): another process may have written between the two.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from svrmad_local.analysis.folder import RunFolder, note
from svrmad_local.analysis.posthoc import recorded_methods
from svrmad_local.analysis.run_config import RunConfig, diff_fingerprints, parse_shard
from svrmad_local.debate.trace import TornLineWarning
from svrmad_local.debate.types import Question
from svrmad_local.job.launch import Dist
from svrmad_local.errors import UserError
from svrmad_local.job.datasets import DatasetError, load_dataset

# The methods that announce the debates they may ask for next (run-ahead starts those): SVR-MAD and
# its ablation variants. The others debate in rounds or ask as they go, so --run-ahead has nothing to start.
ANNOUNCES = ("svr-mad",)


class PreflightError(UserError, ValueError):
    pass


@dataclass
class Checked:
    questions: list[Question]  # the run's questions (after --limit, --category, --shard)
    model: str | None  # the checkpoint folder, None when the folder has nothing left to run


def preflight(cfg: RunConfig, d: Dist) -> Checked:
    """Raise one line naming what is wrong, or return what the run needs; writes nothing (the
    embedded default model is fetched and converted into its cache the first time)."""
    from svrmad_local.grading import set_grader

    cfg.validate()
    set_grader(cfg.grader)  # math-verify missing: one line, before the model loads
    d.check_tp(cfg.tp)  # whole tensor-parallel groups (the one rule dist.py owns)
    if d.world_size > 1 and cfg.device_map:
        raise PreflightError("--device-map with several processes would spread every process over every GPU; "
                             "run one process, or data parallel without --device-map")
    questions = load_questions(cfg)
    folder = RunFolder(cfg.out_dir, create=False)
    done = saved_ids(folder)
    check_settings(folder, cfg, done)
    todo = [q for q in questions if q.id not in done]
    path = model_path(cfg) if todo else None
    if path is not None:
        check_model(cfg, path)
    if cfg.run_ahead and not any(m.split(":")[0] in ANNOUNCES for m in recorded_methods(cfg)):
        note(f"--run-ahead has no effect for {', '.join(cfg.methods)}: only SVR-MAD announces the debates it may "
             "ask for next (the others debate in rounds or ask as they go)")
    return Checked(questions, path)


def shard(questions: list, spec: str) -> list:
    k, n = parse_shard(spec)
    return questions[k::n]


def load_questions(cfg: RunConfig) -> list[Question]:
    questions = load_dataset(cfg.dataset, limit=cfg.limit or None, seed=cfg.seed, category=cfg.category,
                             on_error=cfg.on_error, data_dir=cfg.data_dir)
    questions = shard(questions, cfg.shard) if cfg.shard else questions
    if not questions:
        raise DatasetError(f"dataset {cfg.dataset!r} has no questions to run"
                           + (" (after --category/--shard)" if cfg.category or cfg.shard else ""))
    return questions


def saved_ids(folder: RunFolder) -> set[str]:
    """Questions the folder holds (its own files and the part files an unfinished data-parallel run
    left), read without the lock; nothing when it does not exist yet. A torn last line is passed
    over quietly here: the run cuts it, and says so, once it holds the lock."""
    if not folder.out.is_dir():
        return set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornLineWarning)
        folder.failed()  # every run file read once: a damaged line is one line now, before any write
        return folder.committed_ids() | {i for p in folder.part_dirs()
                                         for i in RunFolder(p, create=False).committed_ids()}


def check_settings(folder: RunFolder, cfg: RunConfig, done: set[str]) -> None:
    """Refuse to add to a folder that holds saved questions of a run with other settings. A folder
    with nothing saved (a start that failed before its first question) is simply taken over."""
    if not folder.out.is_dir():
        return
    meta = folder.read_meta()
    if "fingerprint" not in meta or not (done or folder.errors.is_file() and folder.errors.stat().st_size):
        return
    diff = diff_fingerprints(meta["fingerprint"], cfg.fingerprint())
    if diff:
        raise PreflightError(f"{folder.out} holds a run with other settings ({'; '.join(diff)}); rerun with the "
                             f"folder's settings to resume it, or pass a new --out to start another run")


def model_path(cfg: RunConfig) -> str:
    from svrmad_local.models.default import ensure_default_model

    return str(cfg.model or ensure_default_model(cfg.cache_dir))


def check_model(cfg: RunConfig, path: str) -> None:
    """The checkpoint folder and the device (models.loader.check_folder, no weight read), a tokenizer
    with a chat template that renders the conversations a debate sends (every agent's prompt is a
    chat), and no more tokens in it than the model has embeddings."""
    from svrmad_local.models.chat import ChatError, ChatFormat
    from svrmad_local.models.loader import check_folder, check_vocabulary, load_tokenizer
    from svrmad_local.models.reasoning import effort_kwargs

    checked = check_folder(path, dtype=cfg.dtype, device=cfg.device, device_map=cfg.device_map, tp=cfg.tp > 1,
                           quantization=cfg.quantization)
    tokenizer = load_tokenizer(Path(path))
    if tokenizer is None:
        raise PreflightError(f"{path} has no tokenizer (tokenizer.json, tokenizer_config.json...); the agents' "
                             "prompts are chats, so a run needs one: copy the model's tokenizer files next to its weights")
    if not getattr(tokenizer, "chat_template", None):
        raise PreflightError(f"the tokenizer in {path} has no chat template; the agents' prompts are chats: use the "
                             "instruct (chat) release of the model, or add its chat_template to tokenizer_config.json")
    check_vocabulary(tokenizer, checked.config, Path(path))
    try:
        ChatFormat(tokenizer, None, effort_kwargs(tokenizer.chat_template, cfg.reasoning_effort, path)).probe()
    except ChatError as exc:
        raise PreflightError(f"{path}: {exc}") from None
